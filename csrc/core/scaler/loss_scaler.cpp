// amp::LossScaler: one loss_id's scale, its step (scale, fused unscale/check, update) and
// its log line. The set of scalers: loss_scaler_set.cpp; saving and loading: loss_scaler_state.cpp.
#include "optamp/loss_scaler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/format.h"
#include "common/step_events.h"
#include "ops/multi_tensor.h"
#include "ops/stream_capture.h"
#include "scaler/loss_scaler_impl.h"
#include "scaler/scalable_dtypes.h"
#include "scaler/step_status.h"

namespace amp {
namespace {

using detail::number_name;

constexpr double kFloatMax = 3.4028234663852886e38;

}  // namespace

namespace detail {

LossScalerImpl::LossScalerImpl(const Properties& props, int loss_id)
    : loss_id_(loss_id),
      dynamic_(props.enabled && props.loss_scale.is_dynamic()),
      checks_(props.enabled && (dynamic_ || props.overflow_check)),
      fixed_scale_(!props.enabled ? 1.0 : props.loss_scale.value()),
      init_scale_(props.init_scale),
      growth_factor_(props.growth_factor),
      backoff_factor_(props.backoff_factor),
      growth_interval_(props.growth_interval),
      hysteresis_(props.hysteresis),
      min_loss_scale_(props.min_loss_scale.value_or(0.0)),
      max_loss_scale_(props.max_loss_scale),
      lowest_scale_(std::max(props.min_loss_scale.value_or(0.0), LossScaler::kScaleFloor)),
      has_min_(props.min_loss_scale.has_value()),
      verbosity_(props.verbosity) {}

}  // namespace detail

LossScaler::LossScaler(const Properties& props, int loss_id)
    : impl_(std::make_unique<detail::LossScalerImpl>(props, loss_id)) {
  TORCH_CHECK_VALUE(loss_id >= 0, "loss_id must be >= 0, got ", loss_id);
  TORCH_CHECK_VALUE(impl_->growth_interval_ > 0, "growth_interval must be positive, got ",
                    impl_->growth_interval_);
  TORCH_CHECK_VALUE(impl_->hysteresis_ > 0, "hysteresis must be positive, got ",
                    impl_->hysteresis_);
  const double value = impl_->dynamic_ ? props.init_scale : impl_->fixed_scale_;
  TORCH_CHECK_VALUE(std::isfinite(value) && value >= kScaleFloor && value <= kFloatMax,
                    "loss scale must lie within [2^-126, 3.4e38] (float32's normal range), got ",
                    value);
  impl_->statuses_ = std::make_unique<detail::StepStatusQueue>();
  impl_->loss_scale_ = static_cast<float>(value);
  impl_->scale_ = at::full({}, value, at::kFloat);
  impl_->growth_tracker_ = at::zeros({}, at::kInt);
  impl_->hysteresis_tracker_ = at::full({}, impl_->hysteresis_, at::kInt);
}

LossScaler::~LossScaler() = default;

int LossScaler::loss_id() const { return impl_->loss_id_; }
bool LossScaler::dynamic() const { return impl_->dynamic_; }
bool LossScaler::checks_overflow() const { return impl_->checks_; }
double LossScaler::lowest_scale() const { return impl_->lowest_scale_; }
int64_t LossScaler::hysteresis() const { return impl_->hysteresis_; }

template <typename T>
T LossScaler::settled(const T& field) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  settle_locked(/*wait=*/true);
  return field;
}
double LossScaler::loss_scale() const { return settled(impl_->loss_scale_); }
bool LossScaler::last_step_skipped() const { return settled(impl_->last_step_skipped_); }
int64_t LossScaler::skipped_steps() const { return settled(impl_->skipped_steps_); }
int64_t LossScaler::floor_skips() const { return settled(impl_->floor_skips_); }
int64_t LossScaler::host_waits() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->host_waits_;
}

at::Tensor LossScaler::scale_tensor() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->scale_;
}
at::Tensor LossScaler::growth_tracker() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->growth_tracker_;
}
at::Tensor LossScaler::hysteresis_tracker() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->hysteresis_tracker_;
}
bool LossScaler::pending() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->pending_;
}
void LossScaler::set_found_inf_reducer(FoundInfReducer reducer) {
  FoundInfReducer old;  // destroyed after the lock is released (it may take the GIL)
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  old = std::move(impl_->found_inf_reducer_);
  impl_->found_inf_reducer_ = std::move(reducer);
}
bool LossScaler::has_found_inf_reducer() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return static_cast<bool>(impl_->found_inf_reducer_);
}

void LossScaler::to(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  if (impl_->scale_.device() == device) return;
  impl_->scale_ = impl_->scale_.to(device);
  impl_->growth_tracker_ = impl_->growth_tracker_.to(device);
  impl_->hysteresis_tracker_ = impl_->hysteresis_tracker_.to(device);
}

// As torch.amp.GradScaler: 1/scale in double, rounded to float (one element, the scale's
// device). Callers hold impl_->mutex_.
at::Tensor LossScaler::inverse_scale() const {
  return impl_->scale_.to(at::kDouble).reciprocal().to(at::kFloat).reshape({1});
}

at::Tensor LossScaler::scale(const at::Tensor& loss) { return scale_for_step(loss).scaled; }

LossScaler::ScaledLossValue LossScaler::scale_for_step(const at::Tensor& loss) {
  to(loss.device());
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  // 1/scale is taken together with the
  // multiplication, so a concurrent update of the scale cannot come between them.
  return {loss.to(at::kFloat) * impl_->scale_, inverse_scale()};
}

namespace {

at::Tensor flag_for(std::vector<std::pair<c10::Device, at::Tensor>>& flags,
                    const c10::Device& device) {
  for (auto& [d, t] : flags)
    if (d == device) return t;
  flags.emplace_back(device, at::zeros({1}, at::TensorOptions(at::kFloat).device(device)));
  return flags.back().second;
}

// A complex gradient (a complex64 parameter's: spectral layers, complex-valued networks) is
// unscaled and checked as the float pairs it is made of: a real factor scales both parts, and it
// is finite where both are. The view aliases the gradient, so the kernels update it in place. A
// conjugate view is read through its conjugate (the same memory): neither the factor nor the
// finiteness sees the sign of the imaginary part.
at::Tensor as_real(const at::Tensor& t) {
  if (!t.is_complex()) return t;
  return at::view_as_real(t.is_conj() ? t.conj() : t);
}

// grads[k] += stashes[k] for sparse gradients already unscaled (sparse addition in place), and,
// when the stashes are checked, a check of the sums' values (a multiplication by one).
void add_sparse_stashes(const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& stashes, const at::Tensor& flag,
                        bool check) {
  if (grads.empty()) return;
  std::vector<at::Tensor> sums;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& grad = grads[k];  // add_ updates the gradient itself
    grad.add_(stashes[k]);
    sums.push_back(as_real(grad._values()));
  }
  if (check) ops::unscale_check_(sums, flag, at::ones({1}, flag.options()));
}

// The dense tensors that hold the gradients' values (a sparse gradient's values alias its data),
// grouped by device, and apart where they are tensor subclasses (a tensor-parallel model's DTensor
// gradients beside plain ones: DTensor refuses a foreach op over a mix of the two).
struct ValueGroup {
  c10::Device device;
  bool subclass;
  std::vector<at::Tensor> values;
};
std::vector<ValueGroup> values_by_device(const std::vector<at::Tensor>& grads) {
  std::vector<ValueGroup> groups;
  for (const auto& g : grads) {
    const bool subclass = g.key_set().has(c10::DispatchKey::Python);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const ValueGroup& group) {
      return group.device == g.device() && group.subclass == subclass;
    });
    if (it == groups.end()) it = groups.insert(groups.end(), ValueGroup{g.device(), subclass, {}});
    it->values.push_back(as_real(g.is_sparse() ? g._values() : g));
  }
  return groups;
}

// Clears each device's flag where the carried flag of its device is set.
void discount_carried(std::vector<std::pair<c10::Device, at::Tensor>>& found,
                      const std::vector<at::Tensor>& carried) {
  for (const auto& c : carried) {
    for (auto& [device, flag] : found) {
      if (device == c.device()) flag.mul_(1 - c);
    }
  }
}

}  // namespace

void LossScaler::check_gradients(const std::vector<at::Tensor>& grads,
                                 const std::vector<at::Tensor>& stashed) {
  TORCH_CHECK_VALUE(stashed.empty() || stashed.size() == grads.size(),
                    "stashed must be empty or as long as grads (", grads.size(), "), got ",
                    stashed.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK_VALUE(g.defined(), "grads[", i, "] must be defined");
    TORCH_CHECK_VALUE(g.layout() == at::kStrided || g.layout() == at::kSparse, "grads[", i,
                      "] must be a dense (strided) or sparse COO tensor, got ", g.layout(),
                      "; other layouts are not supported by loss scaling");
    const auto t = g.scalar_type();
    TORCH_CHECK_VALUE(detail::loss_scalable(t), "grads[", i, "] must be ",
                      detail::kLossScalableDtypes, ", got ", t);
    if (!stashed.empty() && stashed[i].defined()) {
      const auto& s = stashed[i];
      TORCH_CHECK_VALUE(s.scalar_type() == t && s.sizes() == g.sizes() &&
                            s.device() == g.device() && s.layout() == g.layout(),
                        "stashed[", i, "] must match grads[", i,
                        "] in dtype, shape, device and layout");
    }
  }
}

// NOLINTNEXTLINE(readability-convert-member-functions-to-static): part of the scaler's API
void LossScaler::unscale_into(const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& stashed, const at::Tensor& inv_scale,
                              DeviceFlags& found, bool check_stash) const {
  // Validate everything before touching anything: never leave grads half-unscaled.
  check_gradients(grads, stashed);
  // A sparse gradient is unscaled through its values (an alias of its data); one with a stash
  // (sparse too) gets the stash added after the unscale, and the sum is checked on its own,
  // since its nonzeros are not the stash's.
  struct DeviceGroup {
    c10::Device device;
    std::vector<at::Tensor> plain, out, stash, sparse_out, sparse_stash;
  };
  std::vector<DeviceGroup> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    DeviceGroup* group = nullptr;
    for (auto& dg : groups)
      if (dg.device == g.device()) group = &dg;
    if (!group) group = &groups.emplace_back(DeviceGroup{g.device(), {}, {}, {}, {}, {}});
    const bool has_stash = !stashed.empty() && stashed[i].defined();
    if (g.is_sparse()) {
      group->plain.push_back(as_real(g._values()));
      if (has_stash) {
        group->sparse_out.push_back(g);
        group->sparse_stash.push_back(stashed[i]);
      }
    } else if (has_stash) {
      group->out.push_back(as_real(g));
      group->stash.push_back(as_real(stashed[i]));
    } else {
      group->plain.push_back(as_real(g));
    }
  }
  for (auto& dg : groups) {
    const at::Tensor flag = flag_for(found, dg.device);
    const at::Tensor inv = inv_scale.device() == dg.device
                               ? inv_scale
                               : inv_scale.to(dg.device, /*non_blocking=*/true);
    if (!dg.plain.empty()) ops::unscale_check_(dg.plain, flag, inv);
    add_sparse_stashes(dg.sparse_out, dg.sparse_stash, flag, check_stash);
    if (dg.out.empty()) continue;
    if (check_stash) {
      ops::axpby_check_(dg.out, dg.out, dg.stash, inv, 1.0, flag);
    } else {
      // The stash is not checked again: after an overflow skipped on the device it still holds
      // that inf, and counting it would back the scale off once per later micro-batch.
      ops::unscale_check_(dg.out, flag, inv);
      at::_foreach_add_(dg.out, dg.stash);
    }
  }
}

void LossScaler::unscale(const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& stashed) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  unscale_into(grads, stashed, inverse_scale(), impl_->found_inf_, /*check_stash=*/true);
  impl_->pending_ = true;
}

namespace {

// Both ways of finishing a step (the guard's finish_step, the low-level update()) end it here:
// the optimizer step comes next, and LibTorch's optimizers update through p.data(), which bumps
// no version counter, so the cast cache must drop its copies (through update() it did not before
// 2026-12-06, and served the first step's weights to every later forward).
LossScaler::StepResult end_step(LossScaler::StepResult result) {
  detail::notify_weights_may_change();
  return result;
}

}  // namespace

bool LossScaler::update() {
  DeviceFlags found;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex_);
    impl_->pending_ = false;
    found = std::move(impl_->found_inf_);
    impl_->found_inf_.clear();
  }
  return end_step(update_from(std::move(found), /*on_device=*/false)).skipped;
}

LossScaler::StepResult LossScaler::finish_step(const std::vector<at::Tensor>& grads,
                                               const std::vector<at::Tensor>& stashed,
                                               const at::Tensor& inv_scale, bool on_device,
                                               const std::vector<at::Tensor>& carried) {
  TORCH_CHECK_VALUE(
      inv_scale.defined() && inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat,
      "inv_scale must be a one-element float32 tensor");
  bool any_stash = false;
  for (const auto& t : stashed) any_stash |= t.defined();
  DeviceFlags found;
  // A fixed scale of 1.0 that checks nothing needs no pass at all (Apex's shortcut).
  const bool identity = !impl_->checks_ && impl_->fixed_scale_ == 1.0 && !any_stash;
  if (!identity && !grads.empty()) {
    unscale_into(grads, any_stash ? stashed : std::vector<at::Tensor>{}, inv_scale, found,
                 /*check_stash=*/!on_device);
  }
  discount_carried(found, carried);
  return end_step(update_from(std::move(found), on_device));
}

std::vector<at::Tensor> LossScaler::rescale(const std::vector<at::Tensor>& grads,
                                            const at::Tensor& inv_scale, bool flags) const {
  const bool identity = !impl_->dynamic_ && impl_->fixed_scale_ == 1.0;  // nothing to multiply
  flags = flags && impl_->checks_;
  if (grads.empty() || (identity && !flags)) return {};
  check_gradients(grads, {});
  DeviceFlags found;
  const at::Tensor scale = at::reciprocal(inv_scale).reshape({});  // 0-dim: a foreach scalar
  for (auto& [device, subclass, values] : values_by_device(grads)) {
    const at::Tensor on_device =
        scale.device() == device ? scale : scale.to(device, /*non_blocking=*/true);
    // The flags say what the gradients held, not what the multiplication made: a gradient the
    // scale pushes out of range is a new overflow, which finish_step's check counts.
    if (flags) {
      ops::unscale_check_(values, flag_for(found, device), at::ones({1}, on_device.options()));
    }
    if (!identity) at::_foreach_mul_(values, on_device);
  }
  std::vector<at::Tensor> out;
  for (auto& [device, flag] : found) out.push_back(std::move(flag));
  return out;
}

LossScaler::StepResult LossScaler::update_from(DeviceFlags found_list, bool on_device) {
  if (!impl_->checks_) {
    std::lock_guard<std::mutex> lock(impl_->mutex_);
    impl_->last_step_skipped_ = false;
    StepResult result;
    result.loss_scale = impl_->loss_scale_;
    result.floor_skips = impl_->floor_skips_;
    return result;
  }
  c10::Device device(c10::kCPU);
  FoundInfReducer reducer;
  {
    std::lock_guard<std::mutex> lock(
        impl_->mutex_);  // impl_->scale_ may be moved by to() on another thread
    device = impl_->scale_.device();
    reducer = impl_->found_inf_reducer_;
  }
  at::Tensor found;
  if (found_list.size() == 1 && found_list[0].first == device) {
    found = found_list[0].second;
  } else {
    found = at::zeros({1}, at::TensorOptions(at::kFloat).device(device));
    for (auto& [d, f] : found_list) found.add_(f.to(device, /*non_blocking=*/true));
  }
  if (reducer) {
    try {
      reduce_found_inf(reducer, found);
    } catch (...) {
      // The guard skips the step (see scale_loss.cpp); the scale stays as it was.
      std::lock_guard<std::mutex> lock(impl_->mutex_);
      // Earlier steps' results first (an error path: waiting is fine).
      settle_locked(/*wait=*/true);
      impl_->last_step_skipped_ = true;
      ++impl_->skipped_steps_;
      throw;
    }
  }
  // Several devices' flags or a reducer (a user's may sum): torch's fused optimizers skip only on
  // a flag of exactly 1.
  if (on_device && (found_list.size() != 1 || reducer)) found = found.ne(0).to(at::kFloat);
  StepResult result;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex_);
    if (found.device() != impl_->scale_.device()) found = found.to(impl_->scale_.device());
    if (impl_->dynamic_) {
      ops::update_scale_(impl_->scale_, impl_->growth_tracker_, impl_->hysteresis_tracker_, found,
                         impl_->growth_factor_, impl_->backoff_factor_, impl_->growth_interval_,
                         impl_->hysteresis_, impl_->lowest_scale_, impl_->max_loss_scale_);
    }
    if (ops::stream_is_capturing(impl_->scale_.device())) {
      // Captured into a CUDA graph: the host sees this step once, at capture, and never its
      // replays, so it keeps no result (querying events or allocating pinned memory would also
      // break the capture), and a floor error waits for an eager step (naming the culprits
      // reads gradients). The scale tensors stay right on the device; the host counters cover
      // eager steps only.
      TORCH_CHECK(on_device,
                  "amp: a scale_loss step captured into a CUDA graph needs optimizers that skip "
                  "on the device (amp::FusedAdam/FusedAdamW, or torch's fused=True Adam/AdamW/SGD "
                  "in Python): skipping on the host would read the overflow flag during capture");
    } else {
      // Earlier results first (in step order), then this step's: overflow flag and new scale
      // together. Skipping on the host: the step's one sync, a blocking copy (earlier steps'
      // results, queued before it on the stream, have arrived by then).
      settle_locked(/*wait=*/false);
      impl_->statuses_->push(at::cat({found.reshape({1}), impl_->scale_.reshape({1})}),
                             /*wait_now=*/!on_device);
      // Bounded: a host running far ahead of its device waits for its oldest results.
      constexpr size_t kMaxQueued = 64;
      while (impl_->statuses_->size() > kMaxQueued) settle_one_locked(/*wait=*/true);
      if (!on_device) settle_locked(/*wait=*/true);
      result.floor_limit = std::exchange(impl_->floor_limit_, false);
    }
    if (on_device) {
      result.found_inf = found.reshape({});  // 0-dim, as torch.amp.GradScaler hands it over
    } else {
      result.skipped = impl_->last_step_skipped_;
    }
    result.loss_scale = impl_->loss_scale_;
    result.floor_skips = impl_->floor_skips_;
  }
  return result;
}

void LossScaler::settle_locked(bool wait) const {
  while (settle_one_locked(wait)) {
  }
}

bool LossScaler::settle_one_locked(bool wait) const {
  const std::optional<detail::StepStatus> status = impl_->statuses_->pop(wait);
  if (!status) return false;
  impl_->host_waits_ += wait;
  const double used = impl_->loss_scale_;
  const bool skipped = status->found_inf != 0.0f;
  impl_->loss_scale_ = status->scale;
  impl_->last_step_skipped_ = skipped;
  if (skipped) {
    ++impl_->skipped_steps_;
    // At the bottom already: a fixed scale, or a dynamic one that cannot back off further
    // (min_loss_scale or the floor). Skips there can only repeat: count them for the error.
    const bool at_bottom = !impl_->dynamic_ || used <= impl_->lowest_scale_;
    impl_->floor_skips_ = at_bottom ? impl_->floor_skips_ + 1 : 0;
    if (impl_->floor_skips_ > 0 && impl_->floor_skips_ % kFloorSkipLimit == 0)
      impl_->floor_limit_ = true;
  } else {
    impl_->floor_skips_ = 0;
  }
  if (skipped && impl_->verbosity_ >= 1) {
    if (impl_->dynamic_) {
      std::cerr << "Gradient overflow. Skipping step, loss scaler " << impl_->loss_id_
                << " reducing loss scale to " << number_name(impl_->loss_scale_) << std::endl;
    } else {
      std::cerr << "Gradient overflow. Skipping step, loss scaler " << impl_->loss_id_
                << " keeping its fixed loss scale " << number_name(impl_->loss_scale_) << std::endl;
    }
  }
  return true;
}

void LossScaler::reduce_found_inf(const FoundInfReducer& reducer, at::Tensor& found) const {
  const auto device = found.device();
  reducer(found);
  TORCH_CHECK_VALUE(found.defined() && found.numel() == 1 && found.scalar_type() == at::kFloat &&
                        found.device() == device,
                    "the found_inf reducer of loss scaler ", impl_->loss_id_,
                    " must leave a one-element float32 tensor on ", device.str(), ", got ",
                    found.defined() ? found.toString() + " with " + std::to_string(found.numel()) +
                                          " elements on " + found.device().str()
                                    : std::string("an undefined tensor"));
}

}  // namespace amp
