// amp::scale_loss for torch::optim optimizers and amp::step: collect the optimizers'
// parameters and call the tensor-level core (core/scaler/scale_loss.cpp), as
// libtorch/initialize.cpp does for core/initialize.cpp.
#include "optamp/scale_loss.h"

#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <string>
#include <utility>
#include <vector>

#include "optamp/core.h"
#include "optamp/fused_optimizers.h"

namespace amp {

namespace {

std::vector<torch::optim::Optimizer*> one(torch::optim::Optimizer& o) { return {&o}; }

}  // namespace

ScaledLoss scale_loss(const at::Tensor& loss, torch::optim::Optimizer& optimizer,
                      ScaleLossOptions options) {
  return scale_loss(loss, one(optimizer), options);
}

namespace {

// Every parameter of the optimizers, and how many each param group holds (the labels that say
// where a parameter sits are made from these only for an error message).
void collect_params(const std::vector<torch::optim::Optimizer*>& optimizers,
                    std::vector<at::Tensor>& params,
                    std::vector<std::vector<size_t>>& group_sizes) {
  TORCH_CHECK_VALUE(!optimizers.empty(), "optimizers must not be empty, got an empty list");
  for (size_t k = 0; k < optimizers.size(); ++k) {
    TORCH_CHECK_VALUE(optimizers[k] != nullptr, "optimizers[", k, "] must not be null");
    size_t count = 0;
    auto& sizes = group_sizes.emplace_back();
    for (const auto& group : optimizers[k]->param_groups()) {
      const auto& ps = group.params();
      params.insert(params.end(), ps.begin(), ps.end());
      sizes.push_back(ps.size());
      count += ps.size();
    }
    TORCH_CHECK_VALUE(
        count > 0,
        optimizers.size() == 1 ? std::string("optimizer") : "optimizers[" + std::to_string(k) + "]",
        " must have at least one parameter, got an optimizer with no parameters");
  }
}

// When every optimizer skips on the device (amp::FusedAdam, ...), the guard hands them its
// overflow flag instead of waiting for it. One that does not makes the whole guard wait, since
// that optimizer's skip needs the flag on the host anyway.
core::DeviceSkip device_skip_of(const std::vector<torch::optim::Optimizer*>& optimizers) {
  std::vector<DeviceSkippingOptimizer*> skipping;
  for (auto* o : optimizers) {
    auto* d = dynamic_cast<DeviceSkippingOptimizer*>(o);
    if (!d) return {};
    skipping.push_back(d);
  }
  return [skipping](const at::Tensor& found_inf) {
    for (auto* d : skipping) d->add_found_inf(found_inf);
  };
}

// How many state entries an SGD holds and the sum of its momentum buffers' version counters:
// either changes when it steps (a first step makes buffers, a later one updates them in place).
std::pair<size_t, int64_t> sgd_state_stamp(const torch::optim::Optimizer& sgd) {
  int64_t versions = 0;
  for (const auto& entry : sgd.state()) {
    // dynamic_cast: a subclass of SGD may keep a state of its own.
    const auto* state = dynamic_cast<const torch::optim::SGDParamState*>(entry.second.get());
    if (state != nullptr && state->momentum_buffer().defined()) {
      versions += state->momentum_buffer()._version();
    }
  }
  return {sgd.state().size(), versions};
}

// torch::optim::SGD writes its parameters through p.data(), which leaves their version counters
// alone, so the guard sees its step inside it only through its state: momentum buffers made (a
// first step) or updated in place. Without momentum it keeps none, and such a step stays unseen.
// amp::FusedSGD needs no witness (its step bumps the parameters' counters).
core::StepWitness sgd_momentum_witness(const std::vector<torch::optim::Optimizer*>& optimizers) {
  struct Watched {
    size_t optimizer;
    const torch::optim::Optimizer* sgd;
    std::pair<size_t, int64_t> at_entry;
  };
  std::vector<Watched> watched;
  for (size_t k = 0; k < optimizers.size(); ++k) {
    const auto* o = optimizers[k];
    if (dynamic_cast<const torch::optim::SGD*>(o) != nullptr &&
        dynamic_cast<const DeviceSkippingOptimizer*>(o) == nullptr) {
      watched.push_back({k, o, sgd_state_stamp(*o)});
    }
  }
  if (watched.empty()) return {};
  return [watched = std::move(watched)]() -> std::optional<std::string> {
    for (const auto& w : watched) {
      if (sgd_state_stamp(*w.sgd) != w.at_entry) {
        return "optimizer " + std::to_string(w.optimizer) +
               " (torch::optim::SGD) made or updated momentum buffers, so it stepped,";
      }
    }
    return std::nullopt;
  };
}

}  // namespace

ScaledLoss scale_loss(const at::Tensor& loss,
                      const std::vector<torch::optim::Optimizer*>& optimizers,
                      ScaleLossOptions options) {
  std::vector<at::Tensor> params;
  std::vector<std::vector<size_t>> group_sizes;
  collect_params(optimizers, params, group_sizes);
  std::vector<const void*> identities(optimizers.begin(), optimizers.end());
  std::vector<std::string> descriptions;
  for (size_t k = 0; k < optimizers.size(); ++k) {
    descriptions.push_back(optimizers.size() == 1 ? std::string("optimizer")
                                                  : "optimizers[" + std::to_string(k) + "]");
  }
  core::check_optimizers_allowed(identities, descriptions);
  return core::scale_loss(
      loss, std::move(params), core::optimizer_param_labels(std::move(group_sizes)), options,
      "optimizer", device_skip_of(optimizers), sgd_momentum_witness(optimizers));
}

namespace {

std::vector<torch::optim::Optimizer*> pointers(std::initializer_list<OptimizerRef> optimizers) {
  std::vector<torch::optim::Optimizer*> out;
  for (const auto& o : optimizers) out.push_back(o.ptr());
  return out;
}

}  // namespace

ScaledLoss scale_loss(const at::Tensor& loss, std::initializer_list<OptimizerRef> optimizers,
                      ScaleLossOptions options) {
  return scale_loss(loss, pointers(optimizers), options);
}

ScaledLoss scale_loss(const at::Tensor& loss, torch::optim::Optimizer& optimizer, int loss_id,
                      bool delay_unscale) {
  return scale_loss(loss, one(optimizer), ScaleLossOptions{loss_id, delay_unscale});
}

bool step(std::initializer_list<OptimizerRef> optimizers) { return step(pointers(optimizers)); }

bool step(torch::optim::Optimizer& optimizer) { return step(one(optimizer)); }

bool step(const std::vector<torch::optim::Optimizer*>& optimizers) {
  std::vector<at::Tensor> params;
  std::vector<std::vector<size_t>> group_sizes;
  collect_params(optimizers, params, group_sizes);
  const bool skip =
      core::take_step_overflows(params, core::optimizer_param_labels(std::move(group_sizes)));
  if (skip) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    return false;
  }
  for (auto* o : optimizers) o->step();
  return true;
}

}  // namespace amp
