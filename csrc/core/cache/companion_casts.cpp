#include "cache/companion_casts.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "cache/batched_cast.h"

namespace amp::detail {
namespace {

// The copy's values are held strongly until an op takes it (they have no other owner before
// that), then weakly: the op that took it holds it while it needs it (a linear saves it for its
// backward), and a later cast of the same result finds it while it is alive. A thread that never
// reaches a step end (the autograd engine's device threads, which run the recomputed forwards of
// activation checkpointing) so keeps no taken copy alive after its backward, nor until process
// exit.
//
// Its gradient edge (the node that made it, which the taker's gradient must reach) is held weakly
// until then: held strongly it would keep the whole graph of the forward that made it alive, with
// the activations saved for the backward, past the life the user gives the result. Natively a
// forward whose output is dropped (a validation loop without no_grad, an eager forward just before
// a CUDA graph capture) frees its graph at once; a companion kept it until the thread's step end
// (and, before a capture, kept the parameters' grad accumulators made on the eager stream, which
// the captured backward then used: CUDA refused it). The source's own graph holds the node while
// the source is alive, and a companion is only served for a live source.
struct Companion {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> source;  // empty until offered
  std::int64_t version = 0;                                        // the source's at the offer
  std::int64_t copy_version = 0;  // the copy's: one modified through a view is not served again
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // the copy's
  bool exact = false;  // the source is the copy widened (offer_companion)
  at::Tensor values;   // until taken: the copy's memory, without its node (if it has one)
  std::optional<std::weak_ptr<torch::autograd::Node>> node;  // until taken: its grad_fn, if any
  std::uint32_t input_nr = 0;
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> taken;  // after
};

// `t`'s memory in a tensor of its own with no autograd history, sharing `t`'s version counter (an
// in-place change through either shows in both).
at::Tensor values_of(const at::Tensor& t) {
  at::Tensor values = tensor_over(t, t.sizes(), t.strides(), t.storage_offset());
  values.unsafeGetTensorImpl()->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return values;
}

// Four: a GELU's result is cast by the op right after it; a few more cover a result used by a
// later op of the same block. Each slot holds one activation-sized copy at most, and the copy is
// normally held by the op that used it (saved for its backward) anyway.
constexpr std::size_t kSlots = 4;

struct Ring {
  std::array<Companion, kSlots> slots;
  std::size_t next = 0;
};

Ring& ring() {
  thread_local Ring r;
  return r;
}

// The slot's copy if it is still alive and unchanged; the first take gives the values the copy's
// gradient edge (if its node is gone the result it was offered for is too) and leaves a weak
// reference to them.
std::optional<at::Tensor> take_copy(Companion& slot) {
  at::Tensor copy;
  if (slot.values.defined()) {
    std::shared_ptr<torch::autograd::Node> node;
    if (slot.node) {
      node = slot.node->lock();
      if (!node) {
        slot = Companion();
        return std::nullopt;
      }
    }
    copy = std::exchange(slot.values, at::Tensor());
    if (node) torch::autograd::impl::set_gradient_edge(copy, {std::move(node), slot.input_nr});
    slot.taken.emplace(copy.getIntrusivePtr());
    slot.node.reset();
  } else if (slot.taken) {
    auto impl = slot.taken->lock();
    if (!impl) return std::nullopt;
    copy = at::Tensor(std::move(impl));
  } else {
    return std::nullopt;
  }
  if (copy._version() != slot.copy_version) return std::nullopt;
  return copy;
}

}  // namespace

void offer_companion(const at::Tensor& source, const at::Tensor& companion, bool exact) {
  Ring& r = ring();
  Companion& slot = r.slots[r.next];
  r.next = (r.next + 1) % kSlots;
  slot.source.emplace(source.getIntrusivePtr());
  slot.version = source._version();
  slot.copy_version = companion._version();
  slot.dtype = companion.scalar_type();
  slot.exact = exact;
  // A copy with no node (a leaf, or one made without autograd) holds no graph: kept as it is.
  const std::shared_ptr<torch::autograd::Node>& node = companion.grad_fn();
  slot.values = node ? values_of(companion) : companion;
  slot.node = node ? std::optional<std::weak_ptr<torch::autograd::Node>>(node) : std::nullopt;
  slot.input_nr = companion.output_nr();
  slot.taken.reset();
}

namespace {

std::optional<at::Tensor> find(const at::TensorBase& source, c10::ScalarType dtype,
                               bool exact_only) {
  const c10::TensorImpl* impl = source.unsafeGetTensorImpl();
  for (Companion& slot : ring().slots) {
    // A dead source's address may be reused by a new tensor: the weak reference tells.
    if (!slot.source || slot.source->_unsafe_get_target() != impl || slot.source->expired()) {
      continue;
    }
    if (slot.version != source._version() || slot.dtype != dtype) continue;
    if (exact_only && !slot.exact) continue;
    if (auto copy = take_copy(slot)) return copy;
  }
  return std::nullopt;
}

std::optional<at::Tensor> find_exact(const at::TensorBase& source) {
  for (const auto dtype : {c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    if (auto copy = find(source, dtype, /*exact_only=*/true)) return copy;
  }
  return std::nullopt;
}

}  // namespace

std::optional<at::Tensor> find_companion(const at::Tensor& source, c10::ScalarType dtype) {
  return find(source, dtype, /*exact_only=*/false);
}

namespace {

// Whether the gradient that reaches `t` is looked at: kept (retain_grad) or handed to a hook
// registered on it. A computation that reads the companion instead sends its gradient past `t`.
bool gradient_is_observed(const at::TensorBase& t) {
  if (t.retains_grad()) return true;
  const auto& fn = t.grad_fn();
  return fn && !fn->tensor_pre_hooks().empty();
}

// Whether `t` is a view a view op made (`logits.view(-1, vocab)`), whose gradient reaches its
// base unchanged. A custom autograd Function that returns its input makes a view too
// (CreationMeta::IN_CUSTOM_FUNCTION) whose node must see the gradient: a module's full backward
// hooks wrap its outputs so (torch.nn.modules._functions.BackwardHookFunction), and reading the
// base's companion instead never ran them.
bool is_plain_view(const at::TensorBase& t) {
  const auto* meta = torch::autograd::impl::get_view_autograd_meta(t);
  return meta != nullptr && meta->get_creation_meta() == torch::autograd::CreationMeta::DEFAULT;
}

}  // namespace

std::optional<at::Tensor> find_reduced_companion(const at::Tensor& source) {
  if (gradient_is_observed(source)) return std::nullopt;
  if (auto copy = find_exact(source)) return copy;
  if (!is_plain_view(source) || !source.is_contiguous()) return std::nullopt;
  const at::TensorBase& base = source._base();
  if (base.numel() != source.numel() || base.storage_offset() != source.storage_offset() ||
      !base.is_contiguous() || gradient_is_observed(base)) {
    return std::nullopt;
  }
  auto copy = find_exact(base);
  if (!copy || !copy->is_contiguous()) return std::nullopt;
  return copy->view(source.sizes());
}

void drop_companions() { ring() = Ring(); }

}  // namespace amp::detail
