// AVX-512F lanes for vector_loops.h: 16 fp32 lanes (the 16-bit dtypes' bits in 256-bit
// registers). No include guard: included once, by vector_kernels.cpp, inside namespace avx512 with
// OPTAMP_VEC_TARGET set.
//
// bf16 is rounded with integer operations, not AVX512-BF16's vcvtneps2bf16: that instruction
// flushes subnormal inputs and results to zero, where c10::BFloat16(float) (and the CUDA kernels)
// keep them, so it would break bit-for-bit agreement.
#include "ops/cpu/vec_u16x16.h"

struct Vec : U16x16 {
  static constexpr int64_t kLanes = 16;
  using F = __m512;
  // The 16-bit dtypes' non-finite test (U16x16), next to fp32's 512-bit one below.
  using U16x16::any_all_ones;
  using U16x16::max_exponent;

  OPTAMP_VEC_TARGET static F set1(float v) { return _mm512_set1_ps(v); }
  OPTAMP_VEC_TARGET static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  OPTAMP_VEC_TARGET static F add(F a, F b) { return _mm512_add_ps(a, b); }

  // The lanes' bits as T stores them.
  OPTAMP_VEC_TARGET static __m512i bits(const float* p) { return _mm512_loadu_si512(p); }
  template <typename T16>
  OPTAMP_VEC_TARGET static __m256i bits(const T16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }

  // The lanes as fp32 (exact for every T).
  OPTAMP_VEC_TARGET static F load(const float* p) { return _mm512_loadu_ps(p); }
  OPTAMP_VEC_TARGET static F load(const c10::Half* p) { return _mm512_cvtph_ps(bits(p)); }
  OPTAMP_VEC_TARGET static F load(const c10::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits(p)), 16));
  }

  // v rounded to T as static_cast<T>(float) rounds, stored at p; returns the bits stored.
  OPTAMP_VEC_TARGET static __m512i store(float* p, F v) {
    _mm512_storeu_ps(p, v);
    return _mm512_castps_si512(v);
  }
  OPTAMP_VEC_TARGET static __m256i store(c10::Half* p, F v) {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return h;
  }
  // Round to nearest even, NaN -> 0x7fc0: c10::BFloat16(float)'s bits.
  OPTAMP_VEC_TARGET static __m256i store(c10::BFloat16* p, F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    const __m256i h = _mm512_cvtepi32_epi16(r);  // truncates; every lane is below 2^16 here
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return h;
  }

  // Lanewise maximum of `seen` and the exponent fields of `b`; whether a lane reached all ones.
  OPTAMP_VEC_TARGET static __m512i max_exponent(__m512i seen, __m512i b, uint32_t e) {
    return _mm512_max_epu32(seen, _mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(e))));
  }
  OPTAMP_VEC_TARGET static bool any_all_ones(__m512i seen, uint32_t e) {
    return _mm512_cmpeq_epi32_mask(seen, _mm512_set1_epi32(static_cast<int>(e))) != 0;
  }
};

// The lanes vector_loops.h runs T in: 16 for every dtype.
template <typename T>
struct LanesFor {
  using type = Vec;
};
