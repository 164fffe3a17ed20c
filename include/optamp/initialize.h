#pragma once
// amp::initialize: the entry point (docs/opt_levels.md, docs/cpp.md, docs/design.md).
//
//   auto handle = amp::initialize(model, optimizer, "O2");
//   auto loss = criterion(model->forward(x), y);
//   { auto scaled = amp::scale_loss(loss, optimizer); scaled.backward(); }
//   optimizer.step();
//
// O0: nothing changes. O1/O4: the dispatcher casting rules. O2/O5: the model keeps its fp32
// parameters (the master weights, stepped by the user's unchanged optimizer) and every op sees
// each non-batch-norm parameter/buffer as a cached fp16/bf16 working copy. O3: the model is cast
// to fp16 (pure fp16 training).

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <initializer_list>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

#include "optamp/export.h"
#include "optamp/opt_level.h"
#include "optamp/optimizer_ref.h"

namespace amp {

// What initialize set up; describe() is Apex's report of the resolved options.
class OPTAMP_API Handle {
 public:
  explicit Handle(Properties properties) : properties_(std::move(properties)) {}
  const Properties& properties() const { return properties_; }
  std::string describe() const { return properties_.describe(); }

 private:
  Properties properties_;
};

using ModulePtr = std::shared_ptr<torch::nn::Module>;

// The general form: any number of models and optimizers (optimizers may be empty: inference).
// Validates everything before changing anything; errors leave model, optimizer and amp state
// as they were. One initialize per process at a time: any second call (same or another
// model/optimizer) is a ValueError until amp::reset().
OPTAMP_API Handle initialize(const std::vector<ModulePtr>& models,
                             const std::vector<torch::optim::Optimizer*>& optimizers,
                             OptLevel level, const Options& options = {});
OPTAMP_API Handle initialize(const std::vector<ModulePtr>& models,
                             const std::vector<torch::optim::Optimizer*>& optimizers,
                             std::string_view level, const Options& options = {});

// A model as the list form takes it: a ModuleHolder (`Net net;` from TORCH_MODULE), a
// shared_ptr to a module, or a module itself (also one on the stack, which initialize uses
// without owning it: keep it alive while amp is initialized).
class OPTAMP_API ModuleRef {
 public:
  template <typename Contained>
  ModuleRef(torch::nn::ModuleHolder<Contained>& holder)  // NOLINT(google-explicit-constructor)
      : ptr_(holder.ptr()) {}
  template <typename T, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>>>
  ModuleRef(const std::shared_ptr<T>& module)  // NOLINT(google-explicit-constructor)
      : ptr_(module) {}
  ModuleRef(torch::nn::Module& module);  // NOLINT(google-explicit-constructor)
  const ModulePtr& ptr() const { return ptr_; }

 private:
  ModulePtr ptr_;
};

// The list form with the natural spellings: initialize({generator, discriminator},
// {g_opt, d_opt}, "O1", options) with holders, shared_ptrs or modules, and optimizer
// references or pointers.
OPTAMP_API Handle initialize(std::initializer_list<ModuleRef> models,
                             std::initializer_list<OptimizerRef> optimizers, OptLevel level,
                             const Options& options = {});
OPTAMP_API Handle initialize(std::initializer_list<ModuleRef> models,
                             std::initializer_list<OptimizerRef> optimizers, std::string_view level,
                             const Options& options = {});

// One model (a ModuleHolder such as torch::nn::Linear or a user `TORCH_MODULE`, or a
// shared_ptr) and one optimizer, or none.
template <typename Model, typename Level>
Handle initialize(Model& model, torch::optim::Optimizer& optimizer, Level level,
                  const Options& options = {});
template <typename Model, typename Level>
Handle initialize(Model& model, Level level, const Options& options = {});

// Turns everything off: casting on this thread, level rules, parameter registry, caches and
// loss scalers. Afterwards initialize may be called for a new model/optimizer.
OPTAMP_API void reset();

// True between initialize and reset.
OPTAMP_API bool is_initialized();

// Marks a module whose own parameters and buffers stay fp32 at O2/O3/O5 (as batch-norm modules
// do under keep_batchnorm_fp32). Call before initialize.
OPTAMP_API void keep_in_fp32(const torch::nn::Module& module);

// ---- implementation of the templates --------------------------------------------------------
namespace detail {
template <typename Model>
ModulePtr as_module_ptr(Model& model) {
  if constexpr (std::is_base_of_v<torch::nn::Module, std::decay_t<Model>>) {
    return ModuleRef(model).ptr();  // owned by a shared_ptr or not (a module on the stack)
  } else if constexpr (std::is_convertible_v<Model&, ModulePtr>) {
    return model;
  } else {
    return model.ptr();  // torch::nn::ModuleHolder
  }
}
}  // namespace detail

template <typename Model, typename Level>
Handle initialize(Model& model, torch::optim::Optimizer& optimizer, Level level,
                  const Options& options) {
  return initialize(std::vector<ModulePtr>{detail::as_module_ptr(model)},
                    std::vector<torch::optim::Optimizer*>{&optimizer}, level, options);
}

template <typename Model, typename Level>
Handle initialize(Model& model, Level level, const Options& options) {
  return initialize(std::vector<ModulePtr>{detail::as_module_ptr(model)},
                    std::vector<torch::optim::Optimizer*>{}, level, options);
}

}  // namespace amp
