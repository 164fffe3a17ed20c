// AVX2/F16C lanes for vector_loops.h: 8 fp32 lanes. No include guard: included once, by
// vector_kernels.cpp, inside namespace avx2 with OPTAMP_VEC_TARGET set.
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
  OPTAMP_VEC_TARGET static F load(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits(p)), 16));
  }

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
  // Round to nearest even, NaN -> 0x7fc0: c10::BFloat16(float)'s bits.
  OPTAMP_VEC_TARGET static __m128i store(c10::BFloat16* p, F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m128i h =
        _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return h;
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
