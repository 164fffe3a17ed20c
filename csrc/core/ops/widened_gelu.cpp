// optamp::widened_gelu: schema, CPU kernels, and the autograd node that ties it into the graph
// (ops/widened_gelu.h says why; the CUDA kernels are in cuda/widened_gelu_cuda.cu).
#include "ops/widened_gelu.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "cache/autograd_cast.h"
#include "cache/cast_cache.h"
#include "cache/companion_casts.h"
#include "common/compiled_autograd.h"
#include "common/dtypes.h"

namespace amp::detail {
namespace {

using torch::autograd::variable_list;

// The cast path's backward as torch's own (differentiable) ops: widen, fp32 GELU backward, narrow
// to the input's dtype. The CPU kernel of optamp::widened_gelu_backward, and every device's
// backward under create_graph.
at::Tensor widened_gelu_backward_by_torch_ops(const at::Tensor& grad, const at::Tensor& self,
                                              c10::string_view approximate) {
  return at::gelu_backward(grad.to(at::kFloat), self.to(at::kFloat), approximate)
      .to(self.scalar_type());
}

// Backward of optamp::widened_gelu. Inputs: the gradients of the fp32 result (0) and of its
// reduced companion (1), each possibly undefined; output: the gradient of the reduced input.
struct WidenedGeluBackward final : torch::autograd::Node {
  torch::autograd::SavedVariable input;
  std::string approximate;

  variable_list apply(variable_list&& grads) override {
    const at::Tensor x = input.unpack(shared_from_this());
    at::Tensor g = grads[0].defined() && grads[1].defined() ? grads[0] + grads[1].to(at::kFloat)
                   : grads[0].defined()                     ? grads[0]
                                                            : grads[1];
    if (!g.defined()) return {at::Tensor()};
    if (c10::GradMode::is_enabled()) return {widened_gelu_backward_by_torch_ops(g, x, approximate)};
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("optamp::widened_gelu_backward", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
    return {op.call(g, x, approximate)};
  }
  std::string name() const override { return "WidenedGeluBackward"; }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    amp::detail::refuse_compiled_autograd("widened GELU (WidenedGeluBackward)");
  }
  void release_variables() override { input.reset_data(); }
};

std::tuple<at::Tensor, at::Tensor> widened_gelu_cpu(const at::Tensor& self,
                                                    c10::string_view approximate) {
  at::Tensor wide = at::gelu(self.to(at::kFloat), approximate);
  at::Tensor narrow = wide.to(self.scalar_type());
  return {std::move(wide), std::move(narrow)};
}

}  // namespace

std::optional<at::Tensor> widened_gelu(const at::Tensor& x, c10::string_view approximate,
                                       bool records_autograd) {
  const auto device = x.device().type();
  if (!is_reduced_float(x.scalar_type()) || (device != c10::kCPU && device != c10::kCUDA) ||
      (approximate != "none" && approximate != "tanh") || !is_plain_for_autograd(x)) {
    return std::nullopt;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("optamp::widened_gelu", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::string_view)>();
  std::tuple<at::Tensor, at::Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, approximate);
  }
  auto& [wide, narrow] = out;
  if (records_autograd && x.requires_grad()) {
    auto node = std::shared_ptr<WidenedGeluBackward>(new WidenedGeluBackward(),
                                                     torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->input = torch::autograd::SavedVariable(x, /*is_output=*/false);
    node->approximate = std::string(approximate);
    torch::autograd::set_history(wide, node);    // input 0
    torch::autograd::set_history(narrow, node);  // input 1
  }
  count_cast();  // the widening of x, as the cast it replaces counted
  offer_companion(wide, narrow);
  return wide;
}

}  // namespace amp::detail

TORCH_LIBRARY_FRAGMENT(optamp, m) {
  m.def("widened_gelu(Tensor self, str approximate='none') -> (Tensor, Tensor)");
  m.def("widened_gelu_backward(Tensor grad, Tensor self, str approximate='none') -> Tensor");
}

TORCH_LIBRARY_IMPL(optamp, CPU, m) {
  m.impl("widened_gelu", &amp::detail::widened_gelu_cpu);
  m.impl("widened_gelu_backward", &amp::detail::widened_gelu_backward_by_torch_ops);
}
