#include "cache/autograd_cast.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/variable.h>

namespace amp::detail {
bool records_autograd_now() {
  return c10::GradMode::is_enabled() &&
         !c10::impl::tls_local_dispatch_key_set().excluded_.has_any(c10::autograd_dispatch_keyset);
}

bool is_plain_for_autograd(const at::Tensor& t) {
  static const c10::DispatchKeySet kOtherAutograd({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::NestedTensor,
  });
  if (t.layout() != c10::kStrided || t.key_set().has_any(kOtherAutograd)) return false;
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta == nullptr || meta->fw_grad_ == nullptr;
}

// Why no node: every cast of a training forward costs a ToCopyBackward node, made in the forward
// and run in the backward (the engine's per-node work: scheduling, its input buffer, restoring
// thread-local state). At O2/O5 every parameter is cast each step, at O1/O4 every listed op's
// inputs: on a GPU, where a small model's eager step waits on the host, those nodes were most of
// O2's host work above native autocast's (which records them too).
//
// What changes: gradients of one cast used by several ops (a tied embedding, an RNN's weights at
// each time step) are converted one by one and summed in fp32 where the source's gradients meet,
// where ToCopyBackward summed them in fp16 and converted once: more accurate, not bit-identical
// to Apex's or native autocast's sum. With one use (nearly every cast) the result is the same.
//
// Where the node stays: tensors that are not is_plain_for_autograd (their autograd is not only
// the engine's, or a cast made below autograd would drop their forward-mode tangent), and
// activations (anything but a leaf or a view of one). The engine converts a gradient inside the
// node that made it (validate_outputs), while that node's incoming gradients and saved tensors
// are still alive; ToCopyBackward converts it afterwards, once they are freed. For a parameter
// that is a parameter-sized gradient; for an activation it is activation-sized, and the largest
// sets the backward's peak: GPT-2 small's logits, cast to fp32 for the loss, had their 393 MB
// bf16 gradient made beside two 785 MB fp32 ones (peak +393 MB at O4 on the CPU).
namespace {
bool is_parameter_like(const at::Tensor& t) {
  if (t.is_leaf()) return true;
  return t.is_view() && t._base().is_leaf();  // e.g. a tied LM head's weight.t()
}
}  // namespace

at::Tensor cast_for_autograd(const at::Tensor& source, c10::ScalarType dtype,
                             bool records_autograd) {
  if (!records_autograd || source.scalar_type() == dtype || !source.requires_grad() ||
      !is_parameter_like(source) || !is_plain_for_autograd(source)) {
    return source.to(dtype);
  }
  at::Tensor cast;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    cast = source.to(dtype);
  }
  give_gradient_edge(cast, source);
  return cast;
}

void give_gradient_edge(const at::Tensor& copy, const at::Tensor& source) {
  torch::autograd::impl::set_gradient_edge(copy, torch::autograd::impl::gradient_edge(source));
}

}  // namespace amp::detail
