// The AVX2 and AVX-512 kernels: vector_loops.h compiled once per instruction set.
//
// Function-level target attributes rather than per-file -m flags: the rest of this file, and any
// header function the compiler emits out of line here (c10::Half's conversions, the scalar loops
// the vector ones end with), stays baseline x86-64. With -mavx512f on the file, such a function
// could be the copy the linker keeps for the whole library and fault on an AVX2-only CPU.
#include "ops/cpu/cpu_kernels.h"

#if OPTAMP_CPU_X86
#include <immintrin.h>

namespace amp::ops::detail::cpu {

namespace avx2 {
namespace {
#define OPTAMP_VEC_TARGET __attribute__((target("avx2,fma,f16c")))
#include "ops/cpu/vec_avx2.h"
#include "ops/cpu/vector_loops.h"
#undef OPTAMP_VEC_TARGET
}  // namespace
}  // namespace avx2

// GCC 12's AVX-512 intrinsics pass a deliberately uninitialized register (the merge operand of an
// unmasked operation) and -Wmaybe-uninitialized reports it where they are inlined: a false
// positive (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
namespace {
#define OPTAMP_VEC_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#include "ops/cpu/vec_avx512.h"
#include "ops/cpu/vector_loops.h"
#undef OPTAMP_VEC_TARGET
}  // namespace
}  // namespace avx512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Taking the addresses is baseline code; the vector code runs only once cpu_isa() picked it.
template <typename T>
Kernels<T> avx2_kernels() {
  return {&avx2::unscale_vec<T>, &avx2::check_vec<T>, &avx2::axpby_vec<T>};
}
template <typename T>
Kernels<T> avx512_kernels() {
  return {&avx512::unscale_vec<T>, &avx512::check_vec<T>, &avx512::axpby_vec<T>};
}

template Kernels<float> avx2_kernels<float>();
template Kernels<c10::Half> avx2_kernels<c10::Half>();
template Kernels<c10::BFloat16> avx2_kernels<c10::BFloat16>();
template Kernels<float> avx512_kernels<float>();
template Kernels<c10::Half> avx512_kernels<c10::Half>();
template Kernels<c10::BFloat16> avx512_kernels<c10::BFloat16>();

}  // namespace amp::ops::detail::cpu
#endif
