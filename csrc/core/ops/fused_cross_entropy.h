#pragma once
// cross_entropy of fp16/bf16 logits [rows, classes] with class-index targets, as one op: the loss
// from each row's log-sum-exp and its target's logit, the gradient `(softmax(x) - onehot(target))
// * grad` written straight into the logits' dtype.
//
// Why: Apex's lists run cross_entropy in fp32, and torch computes it as log_softmax + nll_loss:
// the fp32 log-probabilities are written, saved for the backward and read again, and nll_loss's
// backward writes a dense fp32 gradient of the logits' size (zero but at the targets) that
// log_softmax's backward reads twice. At GPT-2 small's logits (4096 x 50257) that is about 4.9 GB
// of memory traffic per step where the loss needs about 1.2 (the reduced logits read in the
// forward, read again and their gradient written in the backward), and 0.8 GB of saved fp32
// log-probabilities where this op saves the reduced logits, half that (docs/design.md, "Apex's
// fp32 cross_entropy without a widened copy of the logits").
//
// Values: the loss within fp32 rounding of torch's, the gradient within the reduced dtype's; the
// CPU kernels compute the same formulas with torch's ops (ops/softmax_math.h has the CUDA
// kernels' per-element math). A row whose target is ignore_index adds 0 to the loss and gets a
// zero gradient (NaN where its logits hold a NaN, as torch's does).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace amp::detail {

// cross_entropy(x.float(), target, reduction=..., ignore_index=...) for reduced 2-D `x` on the
// CPU or CUDA with 1-D int64 class-index targets (no class weights, no label smoothing: the
// caller checks those), recording autograd when `records_autograd` and `x` requires grad;
// std::nullopt where the op does not apply. The cross_entropy replacement calls it for CUDA
// logits only: on the CPU log_softmax + nll_loss run the cast path's own ops, bit for bit, and
// memory traffic is not what a CPU step waits on.
std::optional<at::Tensor> fused_cross_entropy(const at::Tensor& x, const at::Tensor& target,
                                              int64_t reduction, int64_t ignore_index,
                                              bool records_autograd);

// The checks of the ops' arguments (optamp::fused_cross_entropy and its backward, callable by
// anyone), each a ValueError naming the op and the argument, what was expected and what was
// given. The rows and classes of `self`.
struct CrossEntropyRows {
  int64_t rows, cols;
};
CrossEntropyRows checked_cross_entropy_rows(const at::Tensor& self, const at::Tensor& target,
                                            const char* op);
void check_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& self,
                                  const at::Tensor& target, const at::Tensor& row_stats);

}  // namespace amp::detail
