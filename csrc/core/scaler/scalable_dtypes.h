#pragma once
// Internal: the dtypes loss scaling takes, for the parameters a scale_loss guard is given
// (scale_loss.cpp, at entry) and the gradients a LossScaler unscales (loss_scaler.cpp).

#include <c10/core/ScalarType.h>

namespace amp::detail {

// Complex ones are unscaled and checked as the float pairs they are made of (loss_scaler.cpp).
inline bool loss_scalable(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16 || t == c10::kComplexFloat ||
         t == c10::kComplexHalf;
}

// Their names, for the errors that refuse the others.
inline constexpr char kLossScalableDtypes[] = "float32, float16, bfloat16, complex64 or complex32";

}  // namespace amp::detail
