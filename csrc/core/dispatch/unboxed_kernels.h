#pragma once
// Internal: unboxed casting kernels for the operators a training step calls most (matmuls, the
// binary arithmetic ops, layer_norm, gelu, attention). The boxed CastKernel serves any schema,
// but every call pays for boxing its arguments into a stack and unboxing them again below; these
// take the arguments as they are and redispatch through at::_ops, as native autocast's kernels
// do. Same policy, same steps (CastKernel::plan / route / cast_argument): only the
// argument handling differs.

#include <ATen/core/operator_name.h>
#include <torch/library.h>

#include <string>

#include "dispatch/cast_kernel.h"

namespace amp::detail {

// Registers the unboxed kernel of `name` ("aten::add.Tensor" as `qualified`) on `library`,
// following `kernel`'s policies, when the operator is one of the hot ones; false otherwise (the
// caller registers the boxed kernel). `kernel` must outlive the registration.
bool register_unboxed(torch::Library& library, const c10::OperatorName& name,
                      const std::string& qualified, const CastKernel* kernel);

}  // namespace amp::detail
