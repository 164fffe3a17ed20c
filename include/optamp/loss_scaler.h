#pragma once
// Dynamic (or fixed) loss scaling: one LossScaler per loss (Properties::num_losses).
//
// The scale, growth tracker and hysteresis tracker live as tensors on the device of the losses
// they scale (moved there on first use). A step costs at most one device->host copy: after the
// fused unscale + non-finite check and the on-device scale update, the overflow flag and the
// new scale come back together. The host accessors below read the values of that copy and never
// synchronize on their own. See docs/loss_scaling.md.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "optamp/opt_level.h"

namespace amp {

class StateDict;

class LossScaler {
 public:
  // Consecutive overflowing steps at min_loss_scale after which scale_loss raises an error that
  // names the parameters with non-finite gradients (again after each further kFloorSkipLimit).
  static constexpr int64_t kFloorSkipLimit = 50;

  // Dynamic when props.loss_scale is "dynamic" (and props.enabled), else fixed at
  // props.loss_scale.value() (1.0 when disabled).
  LossScaler(const Properties& props, int loss_id);

  int loss_id() const { return loss_id_; }
  bool dynamic() const { return dynamic_; }
  // The scale after the last update (host copy; no sync).
  double loss_scale() const { return loss_scale_; }
  bool last_step_skipped() const { return last_step_skipped_; }
  // Total number of skipped (overflowing) steps.
  int64_t skipped_steps() const { return skipped_steps_; }
  // Consecutive skipped steps taken at min_loss_scale (see kFloorSkipLimit).
  int64_t floor_skips() const { return floor_skips_; }

  // The device tensors (0-dim): float32 scale, int32 growth and hysteresis trackers.
  const at::Tensor& scale_tensor() const { return scale_; }
  const at::Tensor& growth_tracker() const { return growth_tracker_; }
  const at::Tensor& hysteresis_tracker() const { return hysteresis_tracker_; }

  // Moves the state to `device` (a no-op when it is there already).
  void to(const c10::Device& device);
  // loss.float() * scale, on the loss's device (moves the state there first).
  at::Tensor scale(const at::Tensor& loss);

  // --- one step: unscale (any number of calls), then update() once -----------------------------
  // grads[i] *= 1/scale in place (fused, grouped by device and dtype) and records non-finite
  // values. Where stashed[i] is defined: grads[i] = grads[i]/scale + stashed[i] (the
  // gradient-accumulation path). `stashed` is empty or as long as `grads`.
  void unscale(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& stashed = {});
  // Updates the scale from the overflow flag gathered since the last update, with the single
  // device->host sync of the step (none at all for a fixed scale). Returns true when the step
  // must be skipped (an inf/NaN was found, dynamic scaling only).
  bool update();
  // Whether unscale() has recorded work since the last update().
  bool pending() const { return pending_; }

  // Combines this process's overflow flag with other processes' before the scale update, for
  // model parallelism, where ranks hold different gradients and nothing else spreads a
  // non-finite value (e.g. an all_reduce with MAX over a process group). update() calls it with
  // the step's flag: a one-element float32 tensor on the scale's device, > 0 when this process
  // overflowed; the reducer writes the combined flag into it in place. Every rank then skips
  // (or not) the same steps and keeps the same scale. Dynamic scaling only; an empty function
  // removes it. It runs before the step's one device->host copy and must not add another (an
  // asynchronous collective does not).
  using FoundInfReducer = std::function<void(at::Tensor& found_inf)>;
  void set_found_inf_reducer(FoundInfReducer reducer) { found_inf_reducer_ = std::move(reducer); }
  bool has_found_inf_reducer() const { return static_cast<bool>(found_inf_reducer_); }

  // State for amp::state_dict(): "<prefix>scale", "growth_tracker", "hysteresis", "skipped",
  // "floor_skips" (CPU copies, bit-exact).
  void save(StateDict& into, const std::string& prefix) const;
  // Validates every entry first; on error nothing changes.
  void load(const StateDict& from, const std::string& prefix);
  // The validation of load() alone (throws a ValueError naming the bad or missing entry).
  static void check_state(const StateDict& from, const std::string& prefix);

 private:
  at::Tensor found_inf_for(const c10::Device& device);
  at::Tensor inv_scale_for(const c10::Device& device);
  void reduce_found_inf(at::Tensor& found) const;

  int loss_id_;
  bool dynamic_;
  double init_scale_, growth_factor_, backoff_factor_;
  int64_t growth_interval_, hysteresis_;
  double min_loss_scale_, max_loss_scale_;  // min: 0 when no floor
  bool has_min_;
  int verbosity_;

  at::Tensor scale_, growth_tracker_, hysteresis_tracker_;
  // Per step: one found_inf flag and one 1/scale per device touched.
  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_, inv_scale_;
  bool pending_ = false;
  FoundInfReducer found_inf_reducer_;

  double loss_scale_;
  bool last_step_skipped_ = false;
  int64_t skipped_steps_ = 0;
  int64_t floor_skips_ = 0;
};

// The scaler of `loss_id`. Throws when loss scaling is not configured (amp::initialize has not
// run) or the id is out of range.
LossScaler& loss_scaler(int loss_id = 0);

}  // namespace amp
