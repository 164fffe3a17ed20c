// optamp::widened_log_softmax: schema, CPU kernels, and the autograd node that ties it into the
// graph (ops/widened_log_softmax.h says why; the CUDA kernels are in
// cuda/widened_log_softmax_cuda.cu).
#include "ops/widened_log_softmax.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <string>

#include "cache/autograd_cast.h"
#include "common/dtypes.h"

namespace amp::detail {
namespace {

using torch::autograd::variable_list;

// The cast path's ops: widen, then torch's fp32 log_softmax.
at::Tensor widened_log_softmax_cpu(const at::Tensor& self, int64_t dim) {
  return at::_log_softmax(self.to(at::kFloat), dim, /*half_to_float=*/false);
}

// The cast path's backward as torch's own (differentiable) ops: fp32 log_softmax backward, then
// the narrowing to the input's dtype. The CPU kernel of optamp::widened_log_softmax_backward, and
// every device's backward under create_graph.
at::Tensor widened_log_softmax_backward_by_torch_ops(const at::Tensor& grad,
                                                     const at::Tensor& output, int64_t dim,
                                                     at::ScalarType input_dtype) {
  return at::_log_softmax_backward_data(grad, output, dim, at::kFloat).to(input_dtype);
}

// Backward of optamp::widened_log_softmax: the gradient of the fp32 result in, the gradient of
// the reduced input out. Saves the result (as torch's LogSoftmaxBackward does), not the input.
struct WidenedLogSoftmaxBackward final : torch::autograd::Node {
  torch::autograd::SavedVariable result;
  int64_t dim = 0;
  at::ScalarType input_dtype = at::kHalf;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor out = result.unpack(shared_from_this());
    if (c10::GradMode::is_enabled()) {
      return {widened_log_softmax_backward_by_torch_ops(grads[0], out, dim, input_dtype)};
    }
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("optamp::widened_log_softmax_backward", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
    return {op.call(grads[0], out, dim, input_dtype)};
  }
  std::string name() const override { return "WidenedLogSoftmaxBackward"; }
  void release_variables() override { result.reset_data(); }
};

}  // namespace

std::optional<at::Tensor> widened_log_softmax(const at::Tensor& x, int64_t dim,
                                              bool records_autograd) {
  const auto device = x.device().type();
  if (!is_reduced_float(x.scalar_type()) || (device != c10::kCPU && device != c10::kCUDA) ||
      x.dim() < 1 || x.dim() > 2 || c10::maybe_wrap_dim(dim, x.dim()) != x.dim() - 1 ||
      !is_plain_for_autograd(x)) {
    return std::nullopt;
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("optamp::widened_log_softmax", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t)>();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, x.dim() - 1);
  }
  if (records_autograd && x.requires_grad()) {
    auto node = std::shared_ptr<WidenedLogSoftmaxBackward>(new WidenedLogSoftmaxBackward(),
                                                           torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->dim = x.dim() - 1;
    node->input_dtype = x.scalar_type();
    torch::autograd::set_history(out, node);
    node->result = torch::autograd::SavedVariable(out, /*is_output=*/true);
  }
  return out;
}

}  // namespace amp::detail

TORCH_LIBRARY_FRAGMENT(optamp, m) {
  m.def("widened_log_softmax(Tensor self, int dim) -> Tensor");
  m.def(
      "widened_log_softmax_backward(Tensor grad, Tensor output, int dim, ScalarType input_dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(optamp, CPU, m) {
  m.impl("widened_log_softmax", &amp::detail::widened_log_softmax_cpu);
  m.impl("widened_log_softmax_backward", &amp::detail::widened_log_softmax_backward_by_torch_ops);
}
