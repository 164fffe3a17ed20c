// optamp::widened_softmax and optamp::widened_log_softmax: schemas, CPU kernels, and the autograd
// node that ties each into the graph (ops/widened_softmax.h says why; the CUDA kernels are in
// cuda/widened_softmax_cuda.cu).
#include "ops/widened_softmax.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cache/autograd_cast.h"
#include "common/compiled_autograd.h"
#include "common/dtypes.h"

namespace amp::detail {
namespace {

using torch::autograd::variable_list;

// What differs between the two kinds: the ops' names, torch's fp32 ops that compute them (the
// CPU kernels and every device's double backward), the node's name.
template <SoftmaxKind Kind>
struct Softmax {
  static constexpr bool kLog = Kind == SoftmaxKind::kLogSoftmax;
  static constexpr const char* kOp = kLog ? "widened_log_softmax" : "widened_softmax";
  static constexpr const char* kBackwardOp =
      kLog ? "widened_log_softmax_backward" : "widened_softmax_backward";
  static constexpr const char* kNode =
      kLog ? "WidenedLogSoftmaxBackward" : "WidenedSoftmaxBackward";

  static void forward_out(at::Tensor& out, const at::Tensor& input) {
    kLog ? at::_log_softmax_out(out, input, 1, false) : at::_softmax_out(out, input, 1, false);
  }
  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
    return kLog ? at::_log_softmax_backward_data(grad, output, dim, at::kFloat)
                : at::_softmax_backward_data(grad, output, dim, at::kFloat);
  }
  static void backward_out(at::Tensor& out, const at::Tensor& grad, const at::Tensor& output) {
    kLog ? at::_log_softmax_backward_data_out(out, grad, output, 1, at::kFloat)
         : at::_softmax_backward_data_out(out, grad, output, 1, at::kFloat);
  }
};

const char* op_name(SoftmaxKind kind, bool backward) {
  using Log = Softmax<SoftmaxKind::kLogSoftmax>;
  using Plain = Softmax<SoftmaxKind::kSoftmax>;
  if (kind == SoftmaxKind::kSoftmax) return backward ? Plain::kBackwardOp : Plain::kOp;
  return backward ? Log::kBackwardOp : Log::kOp;
}

SoftmaxRows checked_rows(const at::Tensor& t, int64_t dim, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.dim() >= 1, op, ": ", arg, " must have at least one dimension, got ", t.dim(),
                    "-D");
  TORCH_CHECK_VALUE(dim >= -t.dim() && dim < t.dim() && (dim + t.dim()) % t.dim() == t.dim() - 1,
                    op, ": dim must be the last dimension of ", arg, " (", t.dim() - 1,
                    " or -1), got ", dim);
  const int64_t cols = t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

}  // namespace

SoftmaxRows checked_forward_rows(SoftmaxKind kind, const at::Tensor& self, int64_t dim) {
  const char* op = op_name(kind, /*backward=*/false);
  TORCH_CHECK_VALUE(is_reduced_float(self.scalar_type()), op,
                    ": self must be float16 or bfloat16, got ", self.scalar_type());
  return checked_rows(self, dim, op, "self");
}

SoftmaxRows checked_backward_rows(SoftmaxKind kind, const at::Tensor& grad,
                                  const at::Tensor& output, int64_t dim,
                                  at::ScalarType input_dtype) {
  const char* op = op_name(kind, /*backward=*/true);
  TORCH_CHECK_VALUE(grad.scalar_type() == at::kFloat && output.scalar_type() == at::kFloat, op,
                    ": grad and output must be float32, got ", grad.scalar_type(), " and ",
                    output.scalar_type());
  TORCH_CHECK_VALUE(grad.sizes() == output.sizes(), op, ": grad must have output's shape ",
                    output.sizes(), ", got ", grad.sizes());
  TORCH_CHECK_VALUE(is_reduced_float(input_dtype), op,
                    ": input_dtype must be float16 or bfloat16, got ", input_dtype);
  return checked_rows(output, dim, op, "output");
}

namespace {

// The CPU kernels run the cast path's torch ops a block of rows at a time: each row's values are
// those ops' (torch's CPU kernels compute a row on its own, whatever rows come with it), while
// the fp32 intermediates the whole tensor would need at once are a block's. Unblocked, the
// backward held the incoming gradient, the saved result and an fp32 gradient of the logits' size
// together before narrowing it, one reduced gradient more than the cast path's two nodes hold
// (GPT-2's logits: 3 x 785 MB + 393 MB). A block is at most 32 MiB of fp32 and at most an eighth
// of the rows, so it stays well under that gradient at any size that matters; a tensor of under
// 1 MiB of fp32 (a classifier's batch of logits) is one block, its few ops not multiplied.
int64_t rows_per_block(int64_t rows, int64_t cols) {
  const int64_t row_bytes = 4 * std::max<int64_t>(cols, 1);
  const int64_t most = std::max<int64_t>(1, (int64_t{32} << 20) / row_bytes);
  const int64_t least = std::max<int64_t>(1, (int64_t{1} << 20) / row_bytes);
  return std::min(most, std::max(least, (rows + 7) / 8));
}

// The cast path's ops: widen, then torch's fp32 op. The classes are the last dimension (the
// entry points admit no other), so the rows are every other index.
template <SoftmaxKind Kind>
at::Tensor widened_cpu(const at::Tensor& self, int64_t dim) {
  const auto [rows, cols] = checked_forward_rows(Kind, self, dim);
  const at::Tensor input = self.reshape({rows, cols}).contiguous();
  at::Tensor output = at::empty({rows, cols}, input.options().dtype(at::kFloat));
  const int64_t step = rows_per_block(rows, cols);
  for (int64_t first = 0; first < rows; first += step) {
    const int64_t n = std::min(step, rows - first);
    auto out = output.narrow(0, first, n);
    Softmax<Kind>::forward_out(out, input.narrow(0, first, n).to(at::kFloat));
  }
  return output.view(self.sizes());
}

// The cast path's backward as torch's own (differentiable) ops: the fp32 backward, then the
// narrowing to the input's dtype. Every device's backward under create_graph.
template <SoftmaxKind Kind>
at::Tensor backward_by_torch_ops(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                 at::ScalarType input_dtype) {
  return Softmax<Kind>::backward(grad, output, dim).to(input_dtype);
}

// The same ops, a block of rows at a time (the CPU kernel of the backward op).
template <SoftmaxKind Kind>
at::Tensor widened_backward_cpu(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                at::ScalarType input_dtype) {
  const auto [rows, cols] = checked_backward_rows(Kind, grad, output, dim, input_dtype);
  const at::Tensor g = grad.reshape({rows, cols}).contiguous();
  const at::Tensor out = output.reshape({rows, cols}).contiguous();
  at::Tensor grad_input = at::empty({rows, cols}, out.options().dtype(input_dtype));
  const int64_t step = rows_per_block(rows, cols);
  at::Tensor wide = at::empty({std::min(step, rows), cols}, out.options());
  for (int64_t first = 0; first < rows; first += step) {
    const int64_t n = std::min(step, rows - first);
    auto block = wide.narrow(0, 0, n);
    Softmax<Kind>::backward_out(block, g.narrow(0, first, n), out.narrow(0, first, n));
    grad_input.narrow(0, first, n).copy_(block);
  }
  return grad_input.view(output.sizes());
}

// The op's backward node: the gradient of the fp32 result in, the gradient of the reduced input
// out. Saves the result (as torch's SoftmaxBackward and LogSoftmaxBackward do), not the input.
template <SoftmaxKind Kind>
struct WidenedSoftmaxBackward final : torch::autograd::Node {
  torch::autograd::SavedVariable result;
  int64_t dim = 0;
  at::ScalarType input_dtype = at::kHalf;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor out = result.unpack(shared_from_this());
    if (c10::GradMode::is_enabled()) {
      return {backward_by_torch_ops<Kind>(grads[0], out, dim, input_dtype)};
    }
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow((std::string("optamp::") + Softmax<Kind>::kBackwardOp).c_str(), "")
            .template typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                       at::ScalarType)>();
    return {op.call(grads[0], out, dim, input_dtype)};
  }
  std::string name() const override { return Softmax<Kind>::kNode; }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    amp::detail::refuse_compiled_autograd(Softmax<Kind>::kNode);
  }
  void release_variables() override { result.reset_data(); }
};

// Where torch's own kernels serve better on CUDA, the ops decline. Rows of fewer classes than
// kMinCudaClasses (a classifier's 10), where a warp per row leaves most of its lanes idle while the
// widened copy is a few kilobytes; from 128 (attention over 128 keys and more, a classifier's 1000
// classes) a warp per row runs the row (the CUDA kernels take a block per row above 1024). And a
// softmax of fp16 with no backward to follow: torch reads fp16 and writes fp32 in one kernel when
// asked for an fp32 result (half_to_float), and on an H200 at 98304 x 1024 its forward takes 0.188
// ms against the op's 0.212, its backward 0.510 against 0.299 (the seventh GPU run,
// docs/results.md). log_softmax of fp16 takes the op both ways (4096 x 50257: 0.366 / 0.668 ms
// against torch's 0.503 / 0.727); bf16, which torch widens first, always does.
constexpr int64_t kMinCudaClasses = 128;

}  // namespace

bool cuda_softmax_declines(SoftmaxKind kind, at::ScalarType dtype, int64_t classes,
                           bool backward_follows) {
  if (classes < kMinCudaClasses) return true;
  return kind == SoftmaxKind::kSoftmax && dtype == at::kHalf && !backward_follows;
}

namespace {

template <SoftmaxKind Kind>
std::optional<at::Tensor> widened(const at::Tensor& x, int64_t dim, bool records_autograd) {
  const auto device = x.device().type();
  if (!is_reduced_float(x.scalar_type()) || (device != c10::kCPU && device != c10::kCUDA) ||
      x.dim() < 1 || c10::maybe_wrap_dim(dim, x.dim()) != x.dim() - 1 ||
      !is_plain_for_autograd(x)) {
    return std::nullopt;
  }
  const bool backward_follows = records_autograd && x.requires_grad();
  if (device == c10::kCUDA &&
      cuda_softmax_declines(Kind, x.scalar_type(), x.size(-1), backward_follows)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("optamp::") + Softmax<Kind>::kOp).c_str(), "")
          .template typed<at::Tensor(const at::Tensor&, int64_t)>();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, x.dim() - 1);
  }
  if (backward_follows) {
    auto node = std::shared_ptr<WidenedSoftmaxBackward<Kind>>(new WidenedSoftmaxBackward<Kind>(),
                                                              torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->dim = x.dim() - 1;
    node->input_dtype = x.scalar_type();
    torch::autograd::set_history(out, node);
    node->result = torch::autograd::SavedVariable(out, /*is_output=*/true);
  }
  return out;
}

}  // namespace

std::optional<at::Tensor> widened_log_softmax(const at::Tensor& x, int64_t dim,
                                              bool records_autograd) {
  return widened<SoftmaxKind::kLogSoftmax>(x, dim, records_autograd);
}

std::optional<at::Tensor> widened_softmax(const at::Tensor& x, int64_t dim, bool records_autograd) {
  return widened<SoftmaxKind::kSoftmax>(x, dim, records_autograd);
}

}  // namespace amp::detail

TORCH_LIBRARY_FRAGMENT(optamp, m) {
  m.def("widened_log_softmax(Tensor self, int dim) -> Tensor");
  m.def(
      "widened_log_softmax_backward(Tensor grad, Tensor output, int dim, ScalarType input_dtype) "
      "-> Tensor");
  m.def("widened_softmax(Tensor self, int dim) -> Tensor");
  m.def(
      "widened_softmax_backward(Tensor grad, Tensor output, int dim, ScalarType input_dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(optamp, CPU, m) {
  using amp::detail::SoftmaxKind;
  m.impl("widened_log_softmax", &amp::detail::widened_cpu<SoftmaxKind::kLogSoftmax>);
  m.impl("widened_log_softmax_backward",
         &amp::detail::widened_backward_cpu<SoftmaxKind::kLogSoftmax>);
  m.impl("widened_softmax", &amp::detail::widened_cpu<SoftmaxKind::kSoftmax>);
  m.impl("widened_softmax_backward", &amp::detail::widened_backward_cpu<SoftmaxKind::kSoftmax>);
}
