// The AVX-512 vector loops compiled for any x86-64 CPU: vec_avx512.h and vector_loops.h, the
// files the library builds its AVX-512 path from, with the intrinsics supplied by SIMDe's portable
// implementations instead of the CPU (no target attribute). Most machines this project's CI and
// sessions get have no AVX-512, where CpuIsa.Avx512PathMatchesTheScalarPathBitForBit is skipped;
// test_unscale_isa.cpp runs these loops through the same checks there.
//
// No ATen here: SIMDe's aliases (macros named like the intrinsics and their types) must come before
// any <immintrin.h>, which ATen's headers pull in.
#if __has_include(<simde/x86/avx512.h>)
#define OPTAMP_HAVE_SIMDE 1
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include <cstdint>

// Intrinsics the loops use that SIMDe 0.7.4 (Debian 12's libsimde-dev) lacks, by their documented
// semantics: lanewise widening and truncation, F16C's conversions on each half. Newer SIMDe
// defines them.
#ifndef _mm512_cvtepu16_epi32
static inline simde__m512i optamp_mm512_cvtepu16_epi32(simde__m256i a) {
  uint16_t in[16];
  uint32_t out[16];
  simde_mm256_storeu_si256(in, a);
  for (int i = 0; i < 16; ++i) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu16_epi32 optamp_mm512_cvtepu16_epi32
#endif
#ifndef _mm512_cvtph_ps
static inline simde__m512 optamp_mm512_cvtph_ps(simde__m256i a) {
  const simde__m256 lo = simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(a));
  const simde__m256 hi = simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(a, 1));
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
#define _mm512_cvtph_ps optamp_mm512_cvtph_ps
#endif
#ifndef _mm512_cvtps_ph
// SIMDe's F16C conversion rounds to nearest even whatever the immediate asks; any other rounding
// is made to fail the comparison (all lanes 0xffff) rather than pass as nearest.
static inline simde__m256i optamp_mm512_cvtps_ph(simde__m512 a, int rounding) {
  if ((rounding & 0x7) != SIMDE_MM_FROUND_TO_NEAREST_INT) return simde_mm256_set1_epi16(-1);
  const simde__m256 hi = simde_mm512_castps512_ps256(simde_mm512_castpd_ps(
      simde_mm512_castpd256_pd512(simde_mm512_extractf64x4_pd(simde_mm512_castps_pd(a), 1))));
  return simde_mm256_set_m128i(simde_mm256_cvtps_ph(hi, rounding),
                               simde_mm256_cvtps_ph(simde_mm512_castps512_ps256(a), rounding));
}
#define _mm512_cvtps_ph optamp_mm512_cvtps_ph
#endif
#ifndef _mm512_cvtepi32_epi16
static inline simde__m256i optamp_mm512_cvtepi32_epi16(simde__m512i a) {
  uint32_t in[16];
  uint16_t out[16];
  simde_mm512_storeu_si512(in, a);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint16_t>(in[i]);
  return simde_mm256_loadu_si256(out);
}
#define _mm512_cvtepi32_epi16 optamp_mm512_cvtepi32_epi16
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

#endif  // __has_include(<simde/x86/avx512.h>)

#include "avx512_emulated.h"

#if OPTAMP_HAVE_SIMDE
namespace amp::test::emulated_avx512 {
using ops::detail::cpu::axpby_scalar;
using ops::detail::cpu::check_scalar;
using ops::detail::cpu::ExponentBits;
using ops::detail::cpu::unscale_scalar;
#define OPTAMP_VEC_TARGET
#include "ops/cpu/vec_avx512.h"
#include "ops/cpu/vector_loops.h"
#undef OPTAMP_VEC_TARGET
}  // namespace amp::test::emulated_avx512

namespace amp::test {

bool emulated_avx512_available() { return true; }

template <typename T>
ops::detail::cpu::Kernels<T> emulated_avx512_kernels() {
  using namespace emulated_avx512;
  return {&unscale_vec<T>, &check_vec<T>, &axpby_vec<T>};
}

}  // namespace amp::test

#else  // no SIMDe: the test that uses these reports itself skipped

namespace amp::test {

bool emulated_avx512_available() { return false; }

template <typename T>
ops::detail::cpu::Kernels<T> emulated_avx512_kernels() {
  return {};
}

}  // namespace amp::test
#endif

namespace amp::test {
template ops::detail::cpu::Kernels<float> emulated_avx512_kernels<float>();
template ops::detail::cpu::Kernels<c10::Half> emulated_avx512_kernels<c10::Half>();
template ops::detail::cpu::Kernels<c10::BFloat16> emulated_avx512_kernels<c10::BFloat16>();
}  // namespace amp::test
