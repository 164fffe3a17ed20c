#pragma once
// The per-element math of optamp::unscale_check_ and optamp::axpby_check_, shared by the CPU
// kernels (the scalar path and the tails of the vector paths, ops/cpu/cpu_kernels.h) and both
// paths of the CUDA kernels (the 16-byte vector loop and the scalar tail). The CPU's AVX2 and
// AVX-512 bodies compute the same operations in the same order on 8 or 16 lanes;
// tests/cpp/test_unscale_math.cpp checks every path against these functions bit for bit, and the
// functions themselves on edge values.
//
// The non-finite check looks at the value as it is stored, after rounding to the gradient's
// dtype: that catches inf/NaN in the input (inf * s stays inf, NaN stays NaN) and also finite
// gradients that the multiplication or the rounding pushed out of range (a tiny loss scale gives
// a large 1/scale; an fp16 gradient can overflow on the way back). A step that would write such
// a value into a gradient is an overflow like any other.
#include <c10/macros/Macros.h>

#include <cmath>

namespace amp::ops::detail {

C10_HOST_DEVICE inline bool is_finite_float(float v) {
#ifdef __CUDA_ARCH__
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// Products and sums rounded one at a time (no fused multiply-add), so CPU and CUDA agree bitwise.
C10_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
C10_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// v * inv_scale in fp32, rounded to T; `bad` is set when the stored value is not finite.
template <typename T>
C10_HOST_DEVICE inline T unscale_element(T v, float inv_scale, bool& bad) {
  const T out = static_cast<T>(mul_rn(static_cast<float>(v), inv_scale));
  bad |= !is_finite_float(static_cast<float>(out));
  return out;
}

// Whether an unscale by inv_scale is only the read-only check below (check_element).
C10_HOST_DEVICE inline bool unscale_is_check(float inv_scale) { return inv_scale == 1.0f; }

// The whole job of an unscale by exactly 1.0 (a fixed loss scale of 1, O0/O3/O4/O5): v * 1.0 is
// v for every dtype, so the value as stored is the input, and only the check is left (a read-only
// pass, half the memory traffic of a multiply-and-store).
template <typename T>
C10_HOST_DEVICE inline void check_element(T v, bool& bad) {
  bad |= !is_finite_float(static_cast<float>(v));
}

// a * x + b * y in fp32, rounded to T; `bad` is set when x or the stored value is not finite.
template <typename T>
C10_HOST_DEVICE inline T axpby_element(T x, T y, float a, float b, bool& bad) {
  const float xf = static_cast<float>(x);
  const T out = static_cast<T>(add_rn(mul_rn(a, xf), mul_rn(b, static_cast<float>(y))));
  bad |= !is_finite_float(xf) || !is_finite_float(static_cast<float>(out));
  return out;
}

}  // namespace amp::ops::detail
