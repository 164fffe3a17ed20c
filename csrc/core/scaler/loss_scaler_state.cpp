// Saving and loading a loss scaler: LossScaler::check_state/save/load (every entry validated
// before anything changes).
#include "optamp/loss_scaler.h"

#include "scaler/loss_scaler_impl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "common/format.h"
#include "optamp/state_dict.h"

namespace amp {
namespace {

using detail::number_name;

// The 0-dim tensor `key` of `dtype`, as a CPU tensor.
at::Tensor state_entry(const StateDict& from, const std::string& key, at::ScalarType dtype) {
  const at::Tensor& t = from.at(key);
  TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == dtype && t.dim() == 0, "state entry '", key,
                    "' must be a 0-dim ", dtype_name(dtype), " tensor, got ",
                    t.defined() ? dtype_name(t.scalar_type()) + " of shape " + c10::str(t.sizes())
                                : std::string("an undefined tensor"));
  return t.to(at::kCPU);
}

template <typename T>
void check_range(const std::string& key, T value, T lo, T hi, const char* why) {
  TORCH_CHECK_VALUE(value >= lo && value <= hi, "state entry '", key, "' must lie within [", lo,
                    ", ", hi, "] (", why, "), got ", value);
}

// A checkpoint of a fixed scale (1 at O0/O3/O4/O5: no loss scaling) resumed by a dynamic scaler
// would go on from that scale, which fp16 gradients underflow at, and climb back to init_scale
// only one growth_interval per doubling: refused unless init_scale asks for that scale. Written
// since 2026-12-06 as "<prefix>dynamic"; older checkpoints lack it and load as before.
void check_fixed_to_dynamic(const StateDict& from, const std::string& prefix, float scale,
                            double init_scale) {
  if (!from.contains(prefix + "dynamic")) return;
  const bool saved_dynamic = state_entry(from, prefix + "dynamic", at::kBool).item<bool>();
  if (saved_dynamic || scale == static_cast<float>(init_scale)) return;
  const std::string saved = number_name(scale);
  TORCH_CHECK_VALUE(false, "state entry '", prefix, "dynamic' is False: the checkpoint's loss ",
                    "scaler kept a fixed scale of ", saved, " (O0/O3/O4/O5 or loss_scale=<number>)",
                    ", and this run's scales dynamically from init_scale ", number_name(init_scale),
                    "; leave the loss scalers' state out to start from ",
                    "init_scale, or initialize with init_scale=", saved,
                    " to go on from the checkpoint's scale");
}

}  // namespace

void LossScaler::check_state(const StateDict& from, const std::string& prefix) const {
  const float scale = state_entry(from, prefix + "scale", at::kFloat).item<float>();
  const int32_t growth = state_entry(from, prefix + "growth_tracker", at::kInt).item<int32_t>();
  const int32_t hyst = state_entry(from, prefix + "hysteresis", at::kInt).item<int32_t>();
  const int64_t skipped = state_entry(from, prefix + "skipped", at::kLong).item<int64_t>();
  const int64_t floor = state_entry(from, prefix + "floor_skips", at::kLong).item<int64_t>();
  const std::string key = prefix + "scale";
  if (impl_->dynamic_) {
    const double lo =
        impl_->has_min_
            ? std::max(kScaleFloor, std::min(impl_->min_loss_scale_, impl_->init_scale_))
            : kScaleFloor;
    const double hi = std::max(impl_->max_loss_scale_, impl_->init_scale_);
    TORCH_CHECK_VALUE(std::isfinite(scale) && scale >= static_cast<float>(lo) && scale <= hi,
                      "state entry '", key, "' must lie within [", number_name(lo), ", ",
                      number_name(hi),
                      "] (the configured scaler's [min_loss_scale or 2^-126, max_loss_scale]), "
                      "got ",
                      number_name(scale));
    check_fixed_to_dynamic(from, prefix, scale, impl_->init_scale_);
  } else {
    TORCH_CHECK_VALUE(scale == static_cast<float>(impl_->fixed_scale_), "state entry '", key,
                      "' must equal the configured fixed loss scale ",
                      number_name(impl_->fixed_scale_), " (a fixed scale never changes), got ",
                      number_name(scale),
                      "; initialize with loss_scale=\"dynamic\" (or with this scale) to resume it, "
                      "or leave the loss scalers' state out to keep the fixed scale (a change of "
                      "level, fp16's dynamic scaling to bf16's O4/O5)");
  }
  check_range<int64_t>(prefix + "growth_tracker", growth, 0, impl_->growth_interval_ - 1,
                       "0 to growth_interval - 1");
  check_range<int64_t>(prefix + "hysteresis", hyst, 0, impl_->hysteresis_,
                       "0 to the hysteresis setting");
  check_range<int64_t>(prefix + "skipped", skipped, 0, std::numeric_limits<int64_t>::max(),
                       "a count of skipped steps");
  check_range<int64_t>(prefix + "floor_skips", floor, 0, skipped,
                       "a count of consecutive skips, at most 'skipped'");
}

void LossScaler::save(StateDict& into, const std::string& prefix) const {
  auto cpu = [](const at::Tensor& t) { return t.detach().to(at::kCPU).clone().reshape({}); };
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  settle_locked(/*wait=*/true);
  into.insert(prefix + "scale", cpu(impl_->scale_));
  into.insert(prefix + "growth_tracker", cpu(impl_->growth_tracker_));
  into.insert(prefix + "hysteresis", cpu(impl_->hysteresis_tracker_));
  into.insert(prefix + "skipped", at::scalar_tensor(impl_->skipped_steps_, at::kLong));
  into.insert(prefix + "floor_skips", at::scalar_tensor(impl_->floor_skips_, at::kLong));
  into.insert(prefix + "dynamic", at::scalar_tensor(impl_->dynamic_, at::kBool));
}

void LossScaler::load(const StateDict& from, const std::string& prefix) {
  check_state(from, prefix);
  auto get = [&](const char* name) { return from.at(prefix + name).to(at::kCPU).reshape({}); };
  const at::Tensor scale = get("scale");
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  settle_locked(/*wait=*/true);  // results of earlier steps must not land on the loaded state
  impl_->floor_limit_ = false;
  impl_->scale_.copy_(scale);
  impl_->growth_tracker_.copy_(get("growth_tracker"));
  impl_->hysteresis_tracker_.copy_(get("hysteresis"));
  impl_->loss_scale_ = scale.item<float>();
  impl_->skipped_steps_ = get("skipped").item<int64_t>();
  impl_->floor_skips_ = get("floor_skips").item<int64_t>();
  impl_->last_step_skipped_ = false;
  impl_->pending_ = false;
  impl_->found_inf_.clear();
}

}  // namespace amp
