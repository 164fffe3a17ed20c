#pragma once
// Dtype questions asked across the core.
#include <c10/core/ScalarType.h>

namespace amp::detail {

// fp16 or bf16: the dtypes the levels cast to (not c10::isReducedFloatingType, which counts the
// float8 types too).
inline bool is_reduced_float(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

}  // namespace amp::detail
