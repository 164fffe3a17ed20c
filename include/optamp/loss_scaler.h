#pragma once
// Dynamic (or fixed) loss scaling: one LossScaler per loss (Properties::num_losses).
//
// The scale, growth tracker and hysteresis tracker live as tensors on the device of the losses
// they scale (moved there on first use). After the fused unscale + non-finite check and the
// on-device scale update, the overflow flag and the new scale travel back to the host together,
// without waiting. A step waits for them (the step's one device->host sync) only when the host
// must skip the step itself; with an optimizer that skips on the device (finish_step with
// on_device) nothing waits, and the host accessors below wait for the values when they are
// read. See docs/loss_scaling.md.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "optamp/export.h"
#include "optamp/opt_level.h"

namespace amp {

class StateDict;
namespace detail {
struct LossScalerImpl;
}  // namespace detail

class OPTAMP_API LossScaler {
 public:
  // Consecutive overflowing steps at the minimum scale (min_loss_scale, or kScaleFloor) after
  // which scale_loss raises an error that names the parameters with non-finite gradients (again
  // after each further kFloorSkipLimit).
  static constexpr int64_t kFloorSkipLimit = 50;
  // The smallest scale a scaler ever holds: 2^-126, float32's smallest normal number. 1/scale is
  // then finite (2^126), so unscaling never multiplies by inf (torch.amp.GradScaler backs off
  // into the subnormals, where 1/scale rounds to inf and the next clean step writes 0 * inf =
  // NaN into every gradient). Backoff stops here whatever min_loss_scale says; resolve() and
  // load_state_dict() refuse smaller scales.
  static constexpr double kScaleFloor = 0x1p-126;

  // Dynamic when props.loss_scale is "dynamic" (and props.enabled), else fixed at
  // props.loss_scale.value() (1.0 when disabled).
  LossScaler(const Properties& props, int loss_id);
  LossScaler(const LossScaler&) = delete;
  LossScaler& operator=(const LossScaler&) = delete;
  ~LossScaler();

  int loss_id() const;
  bool dynamic() const;
  // Whether steps are checked for inf/NaN: always with a dynamic scale; with a fixed one unless
  // Properties::overflow_check is false (Apex's behaviour) or amp is disabled.
  bool checks_overflow() const;
  // The host accessors: each first waits for the results of steps that skipped on the device
  // and have not reached the host yet (a device->host sync, only then).
  // The scale after the last update.
  double loss_scale() const;
  bool last_step_skipped() const;
  // Total number of skipped (overflowing) steps.
  int64_t skipped_steps() const;
  // Consecutive skipped steps taken at the minimum scale (see kFloorSkipLimit).
  int64_t floor_skips() const;
  // How many step results the host has asked for before they were known to be there: one per
  // step that skips on the host, none for steps an optimizer skips on the device (until an
  // accessor above is read). On a GPU each is a device->host sync; a sync-free loop keeps it
  // constant.
  int64_t host_waits() const;
  // The lowest scale this scaler can reach: max(min_loss_scale, kScaleFloor).
  double lowest_scale() const;
  // The hysteresis setting: overflowing steps tolerated before a backoff (the tracker's start).
  int64_t hysteresis() const;

  // The device tensors (0-dim): float32 scale, int32 growth and hysteresis trackers.
  at::Tensor scale_tensor() const;
  at::Tensor growth_tracker() const;
  at::Tensor hysteresis_tracker() const;

  // Moves the state to `device` (a no-op when it is there already).
  void to(const c10::Device& device);
  // loss.float() * scale, on the loss's device (moves the state there first).
  at::Tensor scale(const at::Tensor& loss);

  // --- one step, the way amp::scale_loss takes it -----------------------------------------------
  // Several threads may run steps on one scaler at once (e.g. two models trained by two threads
  // with the same loss_id): each step unscales with the 1/scale its own loss was multiplied by
  // and has its own overflow flag, and the scale updates are applied one at a time.
  struct ScaledLossValue {
    at::Tensor scaled;     // loss.float() * scale
    at::Tensor inv_scale;  // 1/scale of that multiplication (one-element float32, same device)
  };
  ScaledLossValue scale_for_step(const at::Tensor& loss);
  struct StepResult {
    // inf/NaN found: the caller must not step. Always false for a step finished on_device.
    bool skipped = false;
    double loss_scale = 1;  // the scale after the last update the host knows of
    int64_t floor_skips = 0;
    // The skips at the minimum scale reached a multiple of kFloorSkipLimit with this step (or,
    // on_device, with an earlier step whose result arrived now).
    bool floor_limit = false;
    // on_device: the step's overflow flag (0-dim float32 on the scale's device, exactly 0 or 1:
    // the found_inf torch's fused optimizers take); undefined when the scaler checks nothing.
    at::Tensor found_inf;
  };
  // Unscales grads with `inv_scale` (see unscale() for `stashed`), checks for inf/NaN and updates
  // the scale. Without `on_device`, waits for the overflow flag (the step's one device->host sync;
  // none when the scaler checks nothing). With it, nothing waits: the caller's optimizer skips on
  // the device with result.found_inf, and the host learns the outcome later.
  // `carried`: rescale()'s flags for gradients the step accumulates onto. An overflow they
  // carried was counted by the step that made it (which made the optimizers skip), so a device
  // whose carried flag is set counts no overflow here (on_device; its gradients hold it still).
  // Ends the step for the cast cache, as update() does.
  StepResult finish_step(const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& stashed, const at::Tensor& inv_scale,
                         bool on_device = false, const std::vector<at::Tensor>& carried = {});

  // Gradient accumulation without delay_unscale: gradients an earlier step left unscaled in .grad
  // are multiplied by the scale `inv_scale` inverts (exact for a power of two), so the next
  // backward accumulates onto them at its own loss's scale and finish_step unscales the sum.
  // Whatever reads .grad during that backward (DDP's all-reduce after no_sync, a post-accumulate
  // hook) sees the whole sum, as under torch's GradScaler (a stash kept beside .grad until the
  // unscale, as Apex kept, hides the earlier part). With `flags`, also returns, per device, whether
  // they held a non-finite value before the multiplication (for finish_step's `carried`). Nothing
  // to do with a fixed scale of 1.
  std::vector<at::Tensor> rescale(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                                  bool flags) const;

  // --- the same step in two calls (one thread at a time): unscale any number of times, then
  // update() once. -------------------------------------------------------------------------------
  // grads[i] *= 1/scale in place (fused, grouped by device and dtype) and records non-finite
  // values. Where stashed[i] is defined: grads[i] = grads[i]/scale + stashed[i] (the
  // gradient-accumulation path). `stashed` is empty or as long as `grads`.
  void unscale(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& stashed = {});
  // Updates the scale from the overflow flag gathered since the last update, with the single
  // device->host sync of the step (none when the scaler checks nothing). Returns true when the
  // step must be skipped (an inf/NaN was found). Like a guard's exit, it ends the step for the
  // cast cache: the parameters' cached fp16/bf16 copies are made again by the next forward.
  bool update();
  // The validation of unscale() alone (ValueError naming the first bad gradient).
  static void check_gradients(const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& stashed);
  // Whether unscale() has recorded work since the last update().
  bool pending() const;

  // Combines this process's overflow flag with other processes' before the scale update, for
  // model parallelism, where ranks hold different gradients and nothing else spreads a
  // non-finite value (e.g. an all_reduce with MAX over a process group). update() calls it with
  // the step's flag: a one-element float32 tensor on the scale's device, > 0 when this process
  // overflowed; the reducer writes the combined flag into it in place. Every rank then skips
  // (or not) the same steps and keeps the same scale. Only while the scaler checks for overflow;
  // an empty function removes it. It runs before the step's one device->host copy and must not
  // add another (an asynchronous collective does not). It is called without the scaler's lock.
  using FoundInfReducer = std::function<void(at::Tensor& found_inf)>;
  void set_found_inf_reducer(FoundInfReducer reducer);
  bool has_found_inf_reducer() const;

  // State for amp::state_dict(): "<prefix>scale", "growth_tracker", "hysteresis", "skipped",
  // "floor_skips" (0-dim CPU copies, bit-exact), and "dynamic" (bool: whether the scale was
  // dynamic; optional on load, for checkpoints written before 2026-12-06).
  void save(StateDict& into, const std::string& prefix) const;
  // Validates every entry first; on error nothing changes.
  void load(const StateDict& from, const std::string& prefix);
  // The validation of load() alone: every entry present, a 0-dim tensor of its dtype, and a
  // value this scaler could have produced (scale within [lowest_scale(), max_loss_scale], or the
  // fixed scale; trackers within their ranges; counters >= 0); a fixed scale's state resumed by a
  // dynamic scaler only where init_scale equals that scale. Throws a ValueError naming the entry,
  // the expected range and the value.
  void check_state(const StateDict& from, const std::string& prefix) const;

 private:
  using DeviceFlags = std::vector<std::pair<c10::Device, at::Tensor>>;
  at::Tensor inverse_scale() const;
  void unscale_into(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& stashed,
                    const at::Tensor& inv_scale, DeviceFlags& found, bool check_stash) const;
  StepResult update_from(DeviceFlags found, bool on_device);
  void reduce_found_inf(const FoundInfReducer& reducer, at::Tensor& found) const;
  // Applies the queued step results to the host counters, in step order: those that have arrived,
  // or (wait) all of them. Callers hold mutex_.
  void settle_locked(bool wait) const;
  bool settle_one_locked(bool wait) const;
  // `field` (a host counter below) after settling every queued result.
  template <typename T>
  T settled(const T& field) const;

  // The configuration, the device tensors, the lock and the host counters (internal: the
  // installed header shows no synchronization, as ScaledLoss shows none).
  std::unique_ptr<detail::LossScalerImpl> impl_;
};

// The scaler of `loss_id`. Throws when loss scaling is not configured (amp::initialize has not
// run) or the id is out of range.
OPTAMP_API LossScaler& loss_scaler(int loss_id = 0);

}  // namespace amp
