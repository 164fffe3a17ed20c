#pragma once
// Internal: the dtypes loss scaling takes, for the parameters a scale_loss guard is given
// (scale_loss.cpp, at entry) and the gradients a LossScaler unscales (loss_scaler.cpp).

#include <c10/core/ScalarType.h>

namespace amp::detail {

// Complex ones are unscaled and checked as the float pairs they are made of (loss_scaler.cpp);
// float64 ones in float64 (ops/multi_tensor.cpp), as torch's GradScaler does.
inline bool loss_scalable(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16 || t == c10::kDouble ||
         t == c10::kComplexFloat || t == c10::kComplexHalf || t == c10::kComplexDouble;
}

// Their names, for the errors that refuse the others.
inline constexpr char kLossScalableDtypes[] =
    "float32, float16, bfloat16, float64, complex64, complex32 or complex128";

}  // namespace amp::detail
