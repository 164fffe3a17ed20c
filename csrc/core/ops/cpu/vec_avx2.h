// AVX2/F16C lanes for vector_loops.h: 8 fp32 lanes, 16 for bf16 (Bf16x16). No include guard:
// included once, by vector_kernels.cpp, inside namespace avx2 with OPTAMP_VEC_TARGET set.
struct Vec {
  static constexpr int64_t kLanes = 8;
  using F = __m256;

  OPTAMP_VEC_TARGET static F set1(float v) { return _mm256_set1_ps(v); }
  OPTAMP_VEC_TARGET static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  OPTAMP_VEC_TARGET static F add(F a, F b) { return _mm256_add_ps(a, b); }

  // The lanes' bits as T stores them.
  OPTAMP_VEC_TARGET static __m256i bits(const float* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <typename T16>
  OPTAMP_VEC_TARGET static __m128i bits(const T16* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }

  // The lanes as fp32 (exact for every T).
  OPTAMP_VEC_TARGET static F load(const float* p) { return _mm256_loadu_ps(p); }
  OPTAMP_VEC_TARGET static F load(const c10::Half* p) { return _mm256_cvtph_ps(bits(p)); }

  // v rounded to T as static_cast<T>(float) rounds, stored at p; returns the bits stored.
  OPTAMP_VEC_TARGET static __m256i store(float* p, F v) {
    _mm256_storeu_ps(p, v);
    return _mm256_castps_si256(v);
  }
  OPTAMP_VEC_TARGET static __m128i store(c10::Half* p, F v) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return h;
  }
  // v's bf16 bits in the low half of each 32-bit lane: round to nearest even, NaN -> 0x7fc0
  // (c10::BFloat16(float)'s bits). Bf16x16 narrows two of these with one pack.
  OPTAMP_VEC_TARGET static __m256i round_to_bf16(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }

  // Lanewise maximum of `seen` and the exponent fields of `b`; whether a lane reached all ones.
  OPTAMP_VEC_TARGET static __m256i max_exponent(__m256i seen, __m256i b, uint32_t e) {
    return _mm256_max_epu32(seen, _mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(e))));
  }
  OPTAMP_VEC_TARGET static __m128i max_exponent(__m128i seen, __m128i b, uint16_t e) {
    return _mm_max_epu16(seen, _mm_and_si128(b, _mm_set1_epi16(static_cast<short>(e))));
  }
  OPTAMP_VEC_TARGET static bool any_all_ones(__m256i seen, uint32_t e) {
    const __m256i hit = _mm256_cmpeq_epi32(seen, _mm256_set1_epi32(static_cast<int>(e)));
    return _mm256_movemask_epi8(hit) != 0;
  }
  OPTAMP_VEC_TARGET static bool any_all_ones(__m128i seen, uint16_t e) {
    return _mm_movemask_epi8(_mm_cmpeq_epi16(seen, _mm_set1_epi16(static_cast<short>(e)))) != 0;
  }
};

#include "ops/cpu/vec_u16x16.h"

// bf16 16 at a time, in two fp32 registers: narrowing back to 16 bits takes a pack and a
// cross-lane permute (AVX2 has no 32->16 bit truncation), and one of each now serves 16 values
// rather than 8. With two per 8 values on the one shuffle port this was the one AVX2 loop slower
// than torch's (docs/benchmarks.md: 1.03-1.06x its time before, 1.00x after). fp32 and fp16 have
// no such step and stay at 8 lanes.
struct Bf16x16 : U16x16 {
  static constexpr int64_t kLanes = 16;
  struct F {
    __m256 lo, hi;
  };

  OPTAMP_VEC_TARGET static F set1(float v) { return {Vec::set1(v), Vec::set1(v)}; }
  OPTAMP_VEC_TARGET static F mul(F a, F b) { return {Vec::mul(a.lo, b.lo), Vec::mul(a.hi, b.hi)}; }
  OPTAMP_VEC_TARGET static F add(F a, F b) { return {Vec::add(a.lo, b.lo), Vec::add(a.hi, b.hi)}; }

  OPTAMP_VEC_TARGET static __m256i bits(const c10::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  OPTAMP_VEC_TARGET static F load(const c10::BFloat16* p) {
    const __m256i raw = bits(p);
    return {widen(_mm256_castsi256_si128(raw)), widen(_mm256_extracti128_si256(raw, 1))};
  }
  // 8 bf16 as fp32: the bits in the upper half of each lane (exact).
  OPTAMP_VEC_TARGET static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  OPTAMP_VEC_TARGET static __m256i store(c10::BFloat16* p, F v) {
    const __m256i packed = _mm256_packus_epi32(Vec::round_to_bf16(v.lo), Vec::round_to_bf16(v.hi));
    const __m256i h = _mm256_permute4x64_epi64(packed, 0xd8);  // lanes back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return h;
  }
};

// The lanes vector_loops.h runs T in.
template <typename T>
struct LanesFor {
  using type = Vec;
};
template <>
struct LanesFor<c10::BFloat16> {
  using type = Bf16x16;
};
