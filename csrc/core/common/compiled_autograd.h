#pragma once
// torch._dynamo's compiled autograd traces a backward through each node's and hook's
// compiled_args() / apply_with_saved(). optamp's C++ nodes (gradient buckets, the widened GELU
// and softmax, the fused cross entropy) and the scale_loss guard's hook on the scaled loss have
// neither, and torch's default refusal names a mangled C++ type ("compiled_args nyi, see [Note:
// Compiled Autograd] N5torch8autograd24CppFunctionTensorPreHookE"). They refuse with a message
// that says what refused and what to do instead.

#include <c10/util/Exception.h>

namespace amp::detail {

inline void refuse_compiled_autograd(const char* what) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "optamp's ", what,
      " cannot run under compiled autograd (torch._dynamo.compiled_autograd, "
      "torch._dynamo.config.compiled_autograd): run this backward with it off. torch.compile "
      "itself works with optamp (the model, the loss and optimizer.step, and the backward "
      "AOTAutograd compiles for them).");
}

}  // namespace amp::detail
