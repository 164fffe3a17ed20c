// set_data (Module::to, module.to(), `p.data = x`) replaces a tensor's key set with the new
// data's, which drops the substitution key from a registered parameter. Tensor::set_data does not
// go through the dispatcher: it calls autograd's VariableHooks directly. So optamp wraps the
// hooks torch installed, delegating every call, and puts the key back after set_data.
#include <ATen/core/VariableHooksInterface.h>

#include <mutex>

#include "dispatch/substitution_call.h"

namespace amp::detail {
namespace {

using at::TensorBase;

class KeyKeepingVariableHooks final : public at::impl::VariableHooksInterface {
 public:
  explicit KeyKeepingVariableHooks(at::impl::VariableHooksInterface* inner) : inner_(inner) {}

  void set_data(const TensorBase& self, const TensorBase& data) const override {
    inner_->set_data(self, data);
    remark_if_source(self.unsafeGetTensorImpl());
  }

  // ---- the rest: delegated unchanged ----
  TensorBase tensor_data(const TensorBase& t) const override { return inner_->tensor_data(t); }
  TensorBase variable_data(const TensorBase& t) const override { return inner_->variable_data(t); }
  const std::shared_ptr<torch::autograd::Node>& grad_fn(const TensorBase& t) const override {
    return inner_->grad_fn(t);
  }
  unsigned _register_hook(const TensorBase& t,
                          std::function<TensorBase(const TensorBase&)> hook) const override {
    return inner_->_register_hook(t, std::move(hook));
  }
  void remove_hook(const TensorBase& t, unsigned pos) const override {
    inner_->remove_hook(t, pos);
  }
  bool is_view(const TensorBase& t) const override { return inner_->is_view(t); }
  const TensorBase& base(const TensorBase& t) const override { return inner_->base(t); }
  const std::string& name(const TensorBase& t) const override { return inner_->name(t); }
  bool is_leaf(const TensorBase& t) const override { return inner_->is_leaf(t); }
  int64_t output_nr(const TensorBase& t) const override { return inner_->output_nr(t); }
  TensorBase data(const TensorBase& t) const override { return inner_->data(t); }
  int64_t _version(const TensorBase& t) const override { return inner_->_version(t); }
  void retain_grad(const TensorBase& t) const override { inner_->retain_grad(t); }
  bool retains_grad(const TensorBase& t) const override { return inner_->retains_grad(t); }
  void _backward(const at::Tensor& t, at::TensorList inputs,
                 const std::optional<at::Tensor>& gradient, std::optional<bool> keep_graph,
                 bool create_graph) const override {
    inner_->_backward(t, inputs, gradient, keep_graph, create_graph);
  }
  void requires_grad_(const TensorBase& t, bool value) const override {
    inner_->requires_grad_(t, value);
  }
  void basic_autograd_not_implemented_fallback(const c10::OperatorHandle& op,
                                               c10::DispatchKeySet keys,
                                               torch::jit::Stack* stack) const override {
    inner_->basic_autograd_not_implemented_fallback(op, keys, stack);
  }
  std::optional<c10::ScalarType> grad_dtype(const TensorBase& t) const override {
    return inner_->grad_dtype(t);
  }
  void set_grad_dtype(const TensorBase& t,
                      const std::optional<c10::ScalarType>& dtype) const override {
    inner_->set_grad_dtype(t, dtype);
  }

 private:
  at::impl::VariableHooksInterface* inner_;
};

}  // namespace

void install_set_data_hook() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Process lifetime, like the hooks it wraps (torch's are a static of libtorch).
    static auto* hooks = new KeyKeepingVariableHooks(at::impl::GetVariableHooks());
    at::impl::SetVariableHooks(hooks);
  });
}

}  // namespace amp::detail
