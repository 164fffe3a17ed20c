// optamp::fused_cross_entropy and its backward: schemas, CPU kernels (torch's ops computing the
// CUDA kernels' formulas), the autograd node and the entry the cross_entropy replacement calls
// (ops/fused_cross_entropy.h says why; the CUDA kernels are in cuda/widened_softmax_cuda.cu).
#include "ops/fused_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Reduction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <tuple>

#include "cache/autograd_cast.h"
#include "common/compiled_autograd.h"
#include "common/dtypes.h"

namespace amp::detail {
namespace {

using torch::autograd::variable_list;

constexpr const char* kOp = "fused_cross_entropy";
constexpr const char* kBackwardOp = "fused_cross_entropy_backward";

}  // namespace

CrossEntropyRows checked_cross_entropy_rows(const at::Tensor& self, const at::Tensor& target,
                                            const char* op) {
  TORCH_CHECK_VALUE(is_reduced_float(self.scalar_type()), op,
                    ": self must be float16 or bfloat16, got ", self.scalar_type());
  TORCH_CHECK_VALUE(self.dim() == 2 && self.size(1) > 0, op,
                    ": self must be [rows, classes] with at least one class, got shape ",
                    self.sizes());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
                    target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == self.size(0), op,
                    ": target must be [rows] with self's ", self.size(0), " rows, got shape ",
                    target.sizes());
  TORCH_CHECK_VALUE(target.device() == self.device(), op, ": target must be on self's device ",
                    self.device(), ", got ", target.device());
  return {self.size(0), self.size(1)};
}

void check_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& self,
                                  const at::Tensor& target, const at::Tensor& row_stats) {
  const int64_t rows = checked_cross_entropy_rows(self, target, kBackwardOp).rows;
  TORCH_CHECK_VALUE(grad.scalar_type() == at::kFloat && grad.dim() == 1 && grad.size(0) == rows,
                    kBackwardOp, ": grad must be float32 [", rows, "], got ", grad.scalar_type(),
                    " ", grad.sizes());
  TORCH_CHECK_VALUE(row_stats.scalar_type() == at::kFloat && row_stats.dim() == 2 &&
                        row_stats.size(0) == rows && row_stats.size(1) == 2,
                    kBackwardOp, ": row_stats must be float32 [", rows,
                    ", 2] (the forward's), got ", row_stats.scalar_type(), " ", row_stats.sizes());
  TORCH_CHECK_VALUE(grad.device() == self.device() && row_stats.device() == self.device(),
                    kBackwardOp, ": grad and row_stats must be on self's device ", self.device(),
                    ", got ", grad.device(), " and ", row_stats.device());
}

namespace {

// Each row's target class, 0 for an ignored row (`valid` false): an index any row can gather.
at::Tensor class_or_zero(const at::Tensor& target, const at::Tensor& valid) {
  return at::where(valid, target, at::zeros_like(target)).unsqueeze(1);
}

// The gradient of the logits from the rows' probabilities: (probs - onehot(target)) * grad, with
// an ignored row's grad taken as 0 (its probabilities times 0: NaN where they are, as torch's).
at::Tensor gradient_from_probs(const at::Tensor& probs, const at::Tensor& grad,
                               const at::Tensor& target, int64_t ignore_index) {
  const at::Tensor valid = target != ignore_index;
  const at::Tensor g = at::where(valid, grad, at::zeros_like(grad)).unsqueeze(1);
  const at::Tensor onehot = at::zeros_like(probs).scatter_(1, class_or_zero(target, valid),
                                                           valid.to(at::kFloat).unsqueeze(1));
  return (probs - onehot) * g;
}

// The forward with torch's ops: each row's maximum and log(sum(exp(x - max))), and the loss
// -log_softmax(x)[target] = -((x_t - max) - log_sum), as torch's kernels compute log_softmax.
std::tuple<at::Tensor, at::Tensor> fused_cross_entropy_cpu(const at::Tensor& self,
                                                           const at::Tensor& target,
                                                           int64_t ignore_index) {
  const int64_t cols = checked_cross_entropy_rows(self, target, kOp).cols;
  const at::Tensor valid = target != ignore_index;
  TORCH_CHECK_VALUE((((target >= 0) & (target < cols)) | valid.logical_not()).all().item<bool>(),
                    kOp, ": target must hold class indices in [0, ", cols, ") or ignore_index (",
                    ignore_index, ")");
  const at::Tensor x = self.to(at::kFloat);
  const at::Tensor max = x.amax(1);
  const at::Tensor log_sum = (x - max.unsqueeze(1)).exp().sum(1).log();
  const at::Tensor picked = x.gather(1, class_or_zero(target, valid)).squeeze(1);
  const at::Tensor losses = at::where(valid, -((picked - max) - log_sum), at::zeros_like(picked));
  return {losses, at::stack({max, log_sum}, 1)};
}

at::Tensor fused_cross_entropy_backward_cpu(const at::Tensor& grad, const at::Tensor& self,
                                            const at::Tensor& target, const at::Tensor& row_stats,
                                            int64_t ignore_index) {
  check_cross_entropy_backward(grad, self, target, row_stats);
  const at::Tensor max = row_stats.select(1, 0).unsqueeze(1);
  const at::Tensor log_sum = row_stats.select(1, 1).unsqueeze(1);
  const at::Tensor probs = ((self.to(at::kFloat) - max) - log_sum).exp();
  return gradient_from_probs(probs, grad, target, ignore_index).to(self.scalar_type());
}

// The backward as differentiable torch ops, the statistics recomputed from the logits so that a
// second backward (create_graph) sees how they depend on them: every device's backward then.
at::Tensor backward_by_torch_ops(const at::Tensor& grad, const at::Tensor& self,
                                 const at::Tensor& target, int64_t ignore_index) {
  const at::Tensor probs = at::log_softmax(self.to(at::kFloat), 1).exp();
  return gradient_from_probs(probs, grad, target, ignore_index).to(self.scalar_type());
}

// The node of the per-row losses: their gradient in, the logits' (in their dtype) out. Saves the
// reduced logits (half the bytes of the fp32 log-probabilities log_softmax would save), the
// targets and two floats a row.
struct FusedCrossEntropyBackward final : torch::autograd::Node {
  // Saved as variables (torch's nll_loss saves its target so too): a target changed in place
  // before the backward is refused instead of giving another gradient.
  torch::autograd::SavedVariable self, target;
  at::Tensor row_stats;
  int64_t ignore_index = -100;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor x = self.unpack(shared_from_this());
    const at::Tensor classes = target.unpack();
    if (c10::GradMode::is_enabled()) {
      return {backward_by_torch_ops(grads[0], x, classes, ignore_index)};
    }
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("optamp::fused_cross_entropy_backward", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, int64_t)>();
    return {op.call(grads[0].contiguous(), x, classes, row_stats, ignore_index)};
  }
  std::string name() const override { return "FusedCrossEntropyBackward"; }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    amp::detail::refuse_compiled_autograd("fused cross entropy (FusedCrossEntropyBackward)");
  }
  void release_variables() override {
    self.reset_data();
    target.reset_data();
    row_stats.reset();
  }
};

bool applies(const at::Tensor& x, const at::Tensor& target, int64_t reduction) {
  const auto device = x.device().type();
  return (device == c10::kCPU || device == c10::kCUDA) && is_reduced_float(x.scalar_type()) &&
         x.dim() == 2 && x.size(1) > 0 && target.dim() == 1 && target.scalar_type() == at::kLong &&
         target.device() == x.device() && target.size(0) == x.size(0) &&
         (reduction == at::Reduction::None || reduction == at::Reduction::Mean ||
          reduction == at::Reduction::Sum) &&
         is_plain_for_autograd(x);
}

// The count of rows not ignored, as fp32 on the target's device. The comparison writes fp32
// itself: counting its bool result would widen it to int64 first, a copy and a kernel more.
at::Tensor rows_not_ignored(const at::Tensor& target, int64_t ignore_index) {
  at::Tensor valid = at::empty(target.sizes(), target.options().dtype(at::kFloat));
  at::ne_out(valid, target, ignore_index);
  return valid.sum();
}

}  // namespace

std::optional<at::Tensor> fused_cross_entropy(const at::Tensor& x, const at::Tensor& target,
                                              int64_t reduction, int64_t ignore_index,
                                              bool records_autograd) {
  if (!applies(x, target, reduction)) return std::nullopt;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("optamp::fused_cross_entropy", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, int64_t)>();
  at::Tensor losses, row_stats;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(losses, row_stats) = op.call(x, target, ignore_index);
  }
  if (records_autograd && x.requires_grad()) {
    auto node = std::shared_ptr<FusedCrossEntropyBackward>(new FusedCrossEntropyBackward(),
                                                           torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->self = torch::autograd::SavedVariable(x, /*is_output=*/false);
    node->target = torch::autograd::SavedVariable(target, /*is_output=*/false);
    node->row_stats = row_stats;
    node->ignore_index = ignore_index;
    torch::autograd::set_history(losses, node);
  }
  if (reduction == at::Reduction::None) return losses;
  if (reduction == at::Reduction::Sum) return losses.sum();
  // torch's mean: over the rows not ignored (0 / 0, NaN, when every row is), read on the device.
  return losses.sum() / rows_not_ignored(target, ignore_index);
}

}  // namespace amp::detail

TORCH_LIBRARY_FRAGMENT(optamp, m) {
  m.def(
      "fused_cross_entropy(Tensor self, Tensor target, int ignore_index) "
      "-> (Tensor losses, Tensor row_stats)");
  m.def(
      "fused_cross_entropy_backward(Tensor grad, Tensor self, Tensor target, Tensor row_stats, "
      "int ignore_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(optamp, CPU, m) {
  m.impl("fused_cross_entropy", &amp::detail::fused_cross_entropy_cpu);
  m.impl("fused_cross_entropy_backward", &amp::detail::fused_cross_entropy_backward_cpu);
}
