#pragma once
// The per-element math of optamp::widened_gelu and its backward on CUDA (ops/widened_gelu.h says
// what the op is for): GELU and its derivative in fp32, exact (erf) or with torch's tanh
// approximation (approximate="tanh"). The formulas and their order of operations are those of
// torch's own fp32 GELU kernels, so the fused kernel gives an fp32 GELU of the widened input, as
// the op it replaces (a cast to fp32, then torch's GELU) does. The CPU runs the op as those torch
// ops themselves; tests/cpp/test_fused_casts.cpp checks these functions against them.
#include <c10/macros/Macros.h>

#include <cmath>

namespace amp::ops::detail {

struct GeluConstants {
  static constexpr float kSqrtHalf = 0.70710678118654752440f;         // 1/sqrt(2)
  static constexpr float kHalfSqrt2OverPi = 0.39894228040143267794f;  // 1/sqrt(2 pi)
  static constexpr float kBeta = 0.79788456080286535588f;             // sqrt(2/pi)
  static constexpr float kKappa = 0.044715f;
};

C10_HOST_DEVICE inline float gelu_forward_math(float x, bool tanh_approximation) {
  using K = GeluConstants;
  if (tanh_approximation) {
    const float inner = K::kBeta * (x + K::kKappa * (x * x * x));
    return 0.5f * x * (1.0f + ::tanhf(inner));
  }
  return x * 0.5f * (1.0f + ::erff(x * K::kSqrtHalf));
}

// d GELU(x) / dx times the incoming gradient `g`.
C10_HOST_DEVICE inline float gelu_backward_math(float g, float x, bool tanh_approximation) {
  using K = GeluConstants;
  if (tanh_approximation) {
    const float x_sq = x * x;
    const float inner = K::kBeta * (x + K::kKappa * (x_sq * x));
    const float t = ::tanhf(inner);
    const float left = 0.5f * x;
    const float right = 1.0f + t;
    const float left_derivative = 0.5f * right;
    const float right_derivative = (1.0f - t * t) * K::kBeta * (1.0f + 3.0f * K::kKappa * x_sq);
    return g * (left_derivative + left * right_derivative);
  }
  const float cdf = 0.5f * (1.0f + ::erff(x * K::kSqrtHalf));
  const float pdf = ::expf(-0.5f * x * x) * K::kHalfSqrt2OverPi;
  return g * (cdf + x * pdf);
}

}  // namespace amp::ops::detail
