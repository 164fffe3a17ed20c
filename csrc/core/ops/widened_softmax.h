#pragma once
// log_softmax and softmax of fp16/bf16 input computed in fp32, returned in fp32, without a
// widened copy of the input: what Apex's fp32 list asks of a language model's reduced logits (the
// loss's log_softmax) and of attention scores written out (softmax over the keys).
//
// Why: the loss's logits are the largest activation of a language model (GPT-2 small, batch 8 x
// 512: 4096 x 50257). Widening them before log_softmax writes an fp32 copy (read 412 MB, write
// 823 MB), log_softmax reads it again, and the backward's fp32 gradient is narrowed in a pass of
// its own. torch has a kernel that reads fp16 and writes fp32 (and whose backward writes the fp16
// gradient); for bf16 it widens first. On CUDA these ops' kernels beat it for fp16 too, except
// softmax's forward alone (cuda_softmax_declines). optamp::widened_log_softmax reads the reduced
// logits once per pass and writes the fp32 result; its backward (one node, saving the fp32 result
// as torch's does) reads the gradient and the result and writes the reduced gradient. About 3 GB
// less memory traffic per step at GPT-2's logits (docs/design.md, "Apex's fp32 cross_entropy
// without a widened copy").
// optamp::widened_softmax is the same for softmax (the fp32 list's other row): attention written
// out by hand (`scores.softmax(-1)` over 1024 keys) at O4/O5 widened its bf16 scores, a tensor of
// batch x heads x tokens x keys, in every layer.
//
// Values: on the CPU the ops run the cast path's own torch ops (bit for bit); on CUDA one kernel
// per pass with the same fp32 formulas (ops/softmax_math.h), whose sums add in another order
// than torch's kernel: results within fp32 rounding, gradients within the reduced dtype's.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace amp::detail {

// Which of the two: the ops, their CPU and CUDA kernels and their autograd nodes are one template
// over it.
enum class SoftmaxKind { kSoftmax, kLogSoftmax };

// Whether torch's own CUDA kernel serves a reduced input of `classes` per row better than the op:
// rows of under 128 classes, and an fp16 softmax with no backward to follow (torch's kernel reads
// fp16 and writes fp32 in one pass, and its forward is the faster one; the op's backward is).
bool cuda_softmax_declines(SoftmaxKind kind, at::ScalarType dtype, int64_t classes,
                           bool backward_follows);

// log_softmax(x.float(), dim) (softmax(x.float(), dim)) for a reduced `x` when the op applies
// (CPU or CUDA, `dim` the last dimension, on CUDA unless cuda_softmax_declines, a plain tensor),
// recording autograd when `records_autograd` and `x` requires grad; std::nullopt otherwise (the
// caller asks torch's op for an fp32 result, which on CUDA reads fp16 without widening it first).
std::optional<at::Tensor> widened_log_softmax(const at::Tensor& x, int64_t dim,
                                              bool records_autograd);
std::optional<at::Tensor> widened_softmax(const at::Tensor& x, int64_t dim, bool records_autograd);

// The rows the kernels (CPU and CUDA) see: `t` as [rows, cols], its last dimension `dim` the
// classes (a [batch, tokens, vocab] tensor is batch x tokens rows). The checks of the ops'
// arguments, each a ValueError naming the op and the argument, what was expected and what was
// given.
struct SoftmaxRows {
  int64_t rows, cols;
};
SoftmaxRows checked_forward_rows(SoftmaxKind kind, const at::Tensor& self, int64_t dim);
SoftmaxRows checked_backward_rows(SoftmaxKind kind, const at::Tensor& grad,
                                  const at::Tensor& output, int64_t dim,
                                  at::ScalarType input_dtype);

}  // namespace amp::detail
