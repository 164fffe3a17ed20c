#pragma once
// GELU of an fp16/bf16 tensor computed in fp32, returned in fp32, in one kernel: what Apex's fp32
// list asks of `gelu` (docs/casting.md, "Categories"), without the cast in front of it.
//
// Why: the cast-then-GELU that the list implies costs a transformer MLP three passes over its
// widest activation in the forward (widen, fp32 GELU, narrow again at the next linear) and three
// in the backward, where native autocast's fp16 GELU makes one each way; on a GPU that was most of
// what O1/O4 gave the GPU beyond native (docs/benchmarks.md). optamp::widened_gelu reads the
// reduced input once and writes the fp32 result and its fp16/bf16 rounding (the next lower op's
// cast finds that copy: cache/companion_casts.h); its backward (one node, saving the reduced
// input) takes the gradient of either output and writes the input's gradient in one pass.
//
// The values are those of the cast-then-GELU path: on the CPU the op runs exactly those torch ops;
// on CUDA one fused kernel with the same fp32 math (ops/gelu_math.h).
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace amp::detail {

// GELU(x.float()) for a reduced `x` when the fused op applies (CPU or CUDA, approximate "none" or
// "tanh", a plain dense tensor), recording autograd when `records_autograd` and `x` requires
// grad; std::nullopt otherwise (the caller casts and calls aten::gelu).
std::optional<at::Tensor> widened_gelu(const at::Tensor& x, c10::string_view approximate,
                                       bool records_autograd);

}  // namespace amp::detail
