// amp::initialize for LibTorch modules and optimizers: collects tensors, then the shared core.
#include "optamp/initialize.h"
#include "optamp/forward.h"

#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <mutex>
#include <unordered_set>

#include "libtorch/ab_precision.h"
#include "optamp/core.h"

namespace amp {
namespace {

std::mutex g_marks_mutex;
std::unordered_set<const torch::nn::Module*>& fp32_marks() {
  static auto* marks = new std::unordered_set<const torch::nn::Module*>();
  return *marks;
}

bool is_batchnorm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) != nullptr;
}

// The module's own tensors, then its children's, depth first. Module::modules(include_self)
// would need the root to be owned by a shared_ptr (shared_from_this); a module on the stack is
// not. Children are always held by shared_ptrs.
void collect_tree(const torch::nn::Module& module, bool keep_batchnorm, core::ModelTensors& out) {
  const bool keep = (keep_batchnorm && is_batchnorm(module)) || fp32_marks().count(&module);
  auto& target = keep ? out.keep_fp32 : out.reduced;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) target.push_back(p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().defined() && b.value().is_floating_point()) target.push_back(b.value());
  }
  for (const auto& child : module.children()) collect_tree(*child, keep_batchnorm, out);
}

core::ModelTensors collect_models(const std::vector<ModulePtr>& models, bool keep_batchnorm) {
  TORCH_CHECK_VALUE(!models.empty(), "models must contain at least one module, got none");
  core::ModelTensors out;
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  for (std::size_t i = 0; i < models.size(); ++i) {
    TORCH_CHECK_VALUE(models[i] != nullptr, "models[", i, "] must be a module, got nullptr");
    collect_tree(*models[i], keep_batchnorm, out);
    out.identities.push_back(static_cast<const torch::nn::Module*>(models[i].get()));
  }
  for (std::size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = models.size() > 1 ? "models[" + std::to_string(i) + "]." : "";
    for (const auto& p : models[i]->named_parameters(/*recurse=*/true)) {
      out.parameters.push_back(p.value());
      out.names.push_back(prefix + p.key());
    }
  }
  return out;
}

// The state tensors of the built-in optimizers (for the device check) and their epsilon.
template <typename State>
void collect_state(const torch::optim::OptimizerParamState& s, const at::Tensor& param,
                   core::OptimizerTensors& out) {
  const auto* typed = dynamic_cast<const State*>(&s);
  if (!typed) return;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    out.state.push_back(t);
    out.state_owners.push_back(param);
  };
  if constexpr (std::is_same_v<State, torch::optim::SGDParamState>) {
    add(typed->momentum_buffer());
  } else if constexpr (std::is_same_v<State, torch::optim::AdagradParamState>) {
    add(typed->sum());
  } else if constexpr (std::is_same_v<State, torch::optim::RMSpropParamState>) {
    add(typed->square_avg());
    add(typed->momentum_buffer());
    add(typed->grad_avg());
  } else {  // Adam / AdamW
    add(typed->exp_avg());
    add(typed->exp_avg_sq());
    add(typed->max_exp_avg_sq());
  }
}

double group_eps(const torch::optim::OptimizerOptions& options) {
  if (const auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return o->eps();
  if (const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return o->eps();
  if (const auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) return o->eps();
  if (const auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) return o->eps();
  return 0.0;
}

std::vector<core::OptimizerTensors> collect_optimizers(
    const std::vector<torch::optim::Optimizer*>& optimizers) {
  std::vector<core::OptimizerTensors> out;
  for (std::size_t i = 0; i < optimizers.size(); ++i) {
    torch::optim::Optimizer* opt = optimizers[i];
    TORCH_CHECK_VALUE(opt != nullptr, "optimizers[", i, "] must be an optimizer, got nullptr");
    core::OptimizerTensors t;
    t.identity = opt;
    t.description = "optimizer " + std::to_string(i);
    t.steps_through_closure = dynamic_cast<torch::optim::LBFGS*>(opt) != nullptr;
    for (const auto& group : opt->param_groups()) {
      const double eps = group_eps(group.options());
      if (eps > 0 && (t.smallest_eps == 0 || eps < t.smallest_eps)) t.smallest_eps = eps;
      for (const auto& p : group.params()) {
        t.parameters.push_back(p);
        auto it = opt->state().find(p.unsafeGetTensorImpl());
        if (it == opt->state().end()) continue;
        collect_state<torch::optim::SGDParamState>(*it->second, p, t);
        collect_state<torch::optim::AdamParamState>(*it->second, p, t);
        collect_state<torch::optim::AdamWParamState>(*it->second, p, t);
        collect_state<torch::optim::RMSpropParamState>(*it->second, p, t);
        collect_state<torch::optim::AdagradParamState>(*it->second, p, t);
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

Handle initialize(const std::vector<ModulePtr>& models,
                  const std::vector<torch::optim::Optimizer*>& optimizers, OptLevel level,
                  const Options& options) {
  // keep_batchnorm_fp32 is resolved first so the split matches the final properties.
  const Properties preview = resolve(level, options);
  const auto model = collect_models(models, preview.keep_batchnorm_fp32.value_or(false));
  const auto opts = collect_optimizers(optimizers);
  Handle handle(core::initialize(model, opts, level, options));
  detail::start_ab_precision_probe();  // python -m optamp.ab --precision-steps: from here
  return handle;
}

Handle initialize(const std::vector<ModulePtr>& models,
                  const std::vector<torch::optim::Optimizer*>& optimizers, std::string_view level,
                  const Options& options) {
  return initialize(models, optimizers, parse_opt_level(level), options);
}

ModuleRef::ModuleRef(torch::nn::Module& module) : ptr_(module.weak_from_this().lock()) {
  // Not owned by a shared_ptr (a module on the stack): a non-owning pointer to it.
  if (!ptr_) ptr_ = ModulePtr(ModulePtr(), &module);
}

namespace {

std::vector<ModulePtr> module_ptrs(std::initializer_list<ModuleRef> models) {
  std::vector<ModulePtr> out;
  for (const auto& m : models) out.push_back(m.ptr());
  return out;
}

std::vector<torch::optim::Optimizer*> optimizer_ptrs(std::initializer_list<OptimizerRef> opts) {
  std::vector<torch::optim::Optimizer*> out;
  for (const auto& o : opts) out.push_back(o.ptr());
  return out;
}

}  // namespace

Handle initialize(std::initializer_list<ModuleRef> models,
                  std::initializer_list<OptimizerRef> optimizers, OptLevel level,
                  const Options& options) {
  return initialize(module_ptrs(models), optimizer_ptrs(optimizers), level, options);
}

Handle initialize(std::initializer_list<ModuleRef> models,
                  std::initializer_list<OptimizerRef> optimizers, std::string_view level,
                  const Options& options) {
  return initialize(module_ptrs(models), optimizer_ptrs(optimizers), level, options);
}

void reset() {
  core::reset();
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  fp32_marks().clear();
}

bool is_initialized() { return core::is_initialized(); }

ModelBoundary model_boundary(const torch::nn::Module& model) {
  return core::model_boundary(&model);
}

at::Tensor cast_model_output(const at::Tensor& output, c10::ScalarType dtype) {
  return core::cast_model_output(output, dtype);
}

void keep_in_fp32(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  fp32_marks().insert(&module);
}

}  // namespace amp
