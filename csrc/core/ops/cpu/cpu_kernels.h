#pragma once
// The CPU kernels of one contiguous piece of a tensor, one set per instruction set (cpu_isa.h).
//
// The scalar loops here are the reference: they call ops/unscale_math.h per element, as the CUDA
// kernels do. The vector loops (vector_loops.h, compiled per instruction set in
// vector_kernels.cpp) do the same operations in the same order on 8 or 16 lanes and hand their
// leftover elements to the scalar loops; tests/cpp/test_unscale_isa.cpp and test_unscale_math.cpp
// hold every path the CPU can run to these loops bit for bit.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "ops/cpu/cpu_isa.h"
#include "ops/unscale_math.h"

namespace amp::ops::detail::cpu {

// Each kernel returns whether it saw a value ops/unscale_math.h counts as non-finite.
template <typename T>
struct Kernels {
  bool (*unscale)(T* p, int64_t n, float inv_scale);  // also checks (unscale_element)
  bool (*check)(const T* p, int64_t n);               // the unscale by 1.0 (check_element)
  bool (*axpby)(T* out, const T* x, const T* y, int64_t n, float a, float b);
};

template <typename T>
bool unscale_scalar(T* p, int64_t n, float inv_scale) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) p[i] = unscale_element(p[i], inv_scale, bad);
  return bad;
}

template <typename T>
bool check_scalar(const T* p, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) check_element(p[i], bad);
  return bad;
}

template <typename T>
bool axpby_scalar(T* out, const T* x, const T* y, int64_t n, float a, float b) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) out[i] = axpby_element(x[i], y[i], a, b, bad);
  return bad;
}

// The exponent field of T's bits, all ones exactly for inf and NaN: the vector loops test the
// bits a value is stored with, which is is_finite_float(static_cast<float>(value)) without
// converting back. The mask's type is the lane width.
template <typename T>
struct ExponentBits;
template <>
struct ExponentBits<float> {
  static constexpr uint32_t value = 0x7f800000u;
};
template <>
struct ExponentBits<c10::Half> {
  static constexpr uint16_t value = 0x7c00;
};
template <>
struct ExponentBits<c10::BFloat16> {
  static constexpr uint16_t value = 0x7f80;
};

template <typename T>
Kernels<T> scalar_kernels() {
  return {&unscale_scalar<T>, &check_scalar<T>, &axpby_scalar<T>};
}

#if OPTAMP_CPU_X86
// vector_kernels.cpp; to be called only when best_isa() allows them.
template <typename T>
Kernels<T> avx2_kernels();
template <typename T>
Kernels<T> avx512_kernels();
#endif

template <typename T>
Kernels<T> kernels_for(Isa isa) {
#if OPTAMP_CPU_X86
  if (isa == Isa::kAvx512) return avx512_kernels<T>();
  if (isa == Isa::kAvx2) return avx2_kernels<T>();
#endif
  return scalar_kernels<T>();
}

}  // namespace amp::ops::detail::cpu
