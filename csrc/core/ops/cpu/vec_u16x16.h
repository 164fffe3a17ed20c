// The non-finite test on sixteen 16-bit values in a 256-bit register (AVX2 instructions), shared
// by vec_avx2.h (bf16) and vec_avx512.h (fp16 and bf16). No include guard: included by each of
// them, inside its instruction set's namespace, with OPTAMP_VEC_TARGET set.
struct U16x16 {
  // Lanewise maximum of `seen` and the exponent fields of `b`; whether a lane reached all ones.
  OPTAMP_VEC_TARGET static __m256i max_exponent(__m256i seen, __m256i b, uint16_t e) {
    return _mm256_max_epu16(seen, _mm256_and_si256(b, _mm256_set1_epi16(static_cast<short>(e))));
  }
  OPTAMP_VEC_TARGET static bool any_all_ones(__m256i seen, uint16_t e) {
    const __m256i hit = _mm256_cmpeq_epi16(seen, _mm256_set1_epi16(static_cast<short>(e)));
    return _mm256_movemask_epi8(hit) != 0;
  }
};
