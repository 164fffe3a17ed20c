#pragma once
// Optimizers that skip an overflowing step on the device, so a training step never waits for the
// GPU (torch.optim's fused=True Adam/AdamW in Python are the same idea; LibTorch's C++ optimizers
// have no fused form). amp::FusedSGD is torch::optim::SGD the same way.
//
//   amp::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   amp::initialize(model, optimizer, "O2");
//   {
//     auto scaled = amp::scale_loss(loss, optimizer);
//     scaled.backward();
//   }                    // hands the step's overflow flag to the optimizer; reads nothing back
//   optimizer.step();    // one fused kernel per device and dtype; changes nothing after an
//   overflow
//
// With every optimizer of a guard a DeviceSkippingOptimizer, scale_loss neither waits for the
// overflow flag nor resets gradients: the flag stays on the device and the optimizer's kernel
// skips the update (parameters, moments and step counts unchanged). The scaler's host accessors
// (loss_scaler().last_step_skipped(), ...) wait for the flag only when they are called.

#include <ATen/core/Tensor.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <mutex>
#include <unordered_map>

#include "optamp/export.h"

namespace amp {

// What scale_loss needs from an optimizer to leave the skip on the device.
class OPTAMP_API DeviceSkippingOptimizer {
 public:
  virtual ~DeviceSkippingOptimizer() = default;
  // A guard's overflow flag (one-element float32, 0 or 1). Flags of several guards before one
  // step combine: the step is skipped when any of them overflowed.
  void add_found_inf(const at::Tensor& found_inf);
  // The combined flag for the step that runs now (undefined: no guard since the last step).
  at::Tensor take_found_inf();

 private:
  std::mutex mutex_;
  at::Tensor found_inf_;
};

namespace detail {
// The step counts of a fused Adam(W) as device tensors (the kernel reads them there), keyed by
// parameter; the host's AdamParamState::step is brought up to date when the optimizer is saved.
using DeviceSteps = std::unordered_map<c10::TensorImpl*, at::Tensor>;
}  // namespace detail

// torch::optim::Adam or AdamW (`Base`) stepped by torch's fused kernel, skipped on the device
// after an overflow: the common base of FusedAdam and FusedAdamW (instantiated for those two
// only, in the library).
template <typename Base>
class FusedAdamFamily : public Base, public DeviceSkippingOptimizer {
 public:
  using Base::Base;
  using typename Base::LossClosure;
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  mutable detail::DeviceSteps steps_;
};
extern template class OPTAMP_API FusedAdamFamily<torch::optim::Adam>;
extern template class OPTAMP_API FusedAdamFamily<torch::optim::AdamW>;

// torch::optim::Adam with its update done by torch's fused kernel (at::_fused_adam_), skipped on
// the device after an overflow. Same options, same state, and checkpoints interchangeable with
// torch::optim::Adam. AdamParamState::step() on the host is current only after save(); the
// kernel keeps the count on the parameter's device.
class OPTAMP_API FusedAdam : public FusedAdamFamily<torch::optim::Adam> {
 public:
  using FusedAdamFamily::FusedAdamFamily;
};

// torch::optim::AdamW (decoupled weight decay) the same way, with at::_fused_adamw_.
class OPTAMP_API FusedAdamW : public FusedAdamFamily<torch::optim::AdamW> {
 public:
  using FusedAdamFamily::FusedAdamFamily;
};

// torch::optim::SGD (momentum, dampening, Nesterov, weight decay) with its update done by torch's
// fused kernel (at::_fused_sgd_), skipped on the device after an overflow. Same options, same
// state, checkpoints interchangeable with torch::optim::SGD. A momentum buffer starts as the
// first update's gradient, as torch::optim::SGD's does; with dampening 0 (the default) it is
// made as zeros, so a skipped first step leaves the next step a first step, and nothing is read
// on the host. With dampening != 0 the step that creates buffers under a guard waits once for
// the overflow flag (a skipped first step creates none); later steps read nothing.
class OPTAMP_API FusedSGD : public torch::optim::SGD, public DeviceSkippingOptimizer {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace amp
