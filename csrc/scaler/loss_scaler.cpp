// amp::LossScaler, the process-wide scaler registry and amp::StateDict.
#include "optamp/loss_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/format.h"
#include "ops/multi_tensor.h"
#include "optamp/state_dict.h"
#include "scaler/registry.h"

namespace amp {
namespace {

using detail::number_name;

constexpr double kFloatMax = 3.4028234663852886e38;

}  // namespace

LossScaler::LossScaler(const Properties& props, int loss_id)
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
      lowest_scale_(std::max(props.min_loss_scale.value_or(0.0), kScaleFloor)),
      has_min_(props.min_loss_scale.has_value()),
      verbosity_(props.verbosity) {
  TORCH_CHECK_VALUE(loss_id >= 0, "loss_id must be >= 0, got ", loss_id);
  TORCH_CHECK_VALUE(growth_interval_ > 0, "growth_interval must be positive, got ",
                    growth_interval_);
  TORCH_CHECK_VALUE(hysteresis_ > 0, "hysteresis must be positive, got ", hysteresis_);
  const double value = dynamic_ ? props.init_scale : fixed_scale_;
  TORCH_CHECK_VALUE(std::isfinite(value) && value >= kScaleFloor && value <= kFloatMax,
                    "loss scale must lie within [2^-126, 3.4e38] (float32's normal range), got ",
                    value);
  loss_scale_ = static_cast<float>(value);
  scale_ = at::full({}, value, at::kFloat);
  growth_tracker_ = at::zeros({}, at::kInt);
  hysteresis_tracker_ = at::full({}, hysteresis_, at::kInt);
}

at::Tensor LossScaler::scale_tensor() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return scale_;
}
at::Tensor LossScaler::growth_tracker() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return growth_tracker_;
}
at::Tensor LossScaler::hysteresis_tracker() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hysteresis_tracker_;
}
bool LossScaler::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_;
}
void LossScaler::set_found_inf_reducer(FoundInfReducer reducer) {
  FoundInfReducer old;  // destroyed after the lock is released (it may take the GIL)
  std::lock_guard<std::mutex> lock(mutex_);
  old = std::move(found_inf_reducer_);
  found_inf_reducer_ = std::move(reducer);
}
bool LossScaler::has_found_inf_reducer() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(found_inf_reducer_);
}

void LossScaler::to(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (scale_.device() == device) return;
  scale_ = scale_.to(device);
  growth_tracker_ = growth_tracker_.to(device);
  hysteresis_tracker_ = hysteresis_tracker_.to(device);
}

// As torch.amp.GradScaler: 1/scale in double, rounded to float (one element, the scale's
// device). Callers hold mutex_.
at::Tensor LossScaler::inverse_scale() const {
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat).reshape({1});
}

at::Tensor LossScaler::scale(const at::Tensor& loss) { return scale_for_step(loss).scaled; }

LossScaler::ScaledLossValue LossScaler::scale_for_step(const at::Tensor& loss) {
  to(loss.device());
  std::lock_guard<std::mutex> lock(mutex_);
  // 1/scale is taken together with the
  // multiplication, so a concurrent update of the scale cannot come between them.
  return {loss.to(at::kFloat) * scale_, inverse_scale()};
}

namespace {

at::Tensor flag_for(std::vector<std::pair<c10::Device, at::Tensor>>& flags,
                    const c10::Device& device) {
  for (auto& [d, t] : flags)
    if (d == device) return t;
  flags.emplace_back(device, at::zeros({1}, at::TensorOptions(at::kFloat).device(device)));
  return flags.back().second;
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
    TORCH_CHECK_VALUE(g.layout() == at::kStrided, "grads[", i,
                      "] must be a dense (strided) tensor, got ", g.layout(),
                      "; sparse gradients are not supported by loss scaling");
    const auto t = g.scalar_type();
    TORCH_CHECK_VALUE(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, "grads[", i,
                      "] must be float32, float16 or bfloat16, got ", t);
    if (!stashed.empty() && stashed[i].defined()) {
      const auto& s = stashed[i];
      TORCH_CHECK_VALUE(s.scalar_type() == t && s.sizes() == g.sizes() && s.device() == g.device(),
                        "stashed[", i, "] must match grads[", i, "] in dtype, shape and device");
    }
  }
}

void LossScaler::unscale_into(const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& stashed, const at::Tensor& inv_scale,
                              DeviceFlags& found) const {
  // Validate everything before touching anything: never leave grads half-unscaled.
  check_gradients(grads, stashed);
  struct DeviceGroup {
    c10::Device device;
    std::vector<at::Tensor> plain, out, stash;
  };
  std::vector<DeviceGroup> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    DeviceGroup* group = nullptr;
    for (auto& dg : groups)
      if (dg.device == g.device()) group = &dg;
    if (!group) group = &groups.emplace_back(DeviceGroup{g.device(), {}, {}, {}});
    if (!stashed.empty() && stashed[i].defined()) {
      group->out.push_back(g);
      group->stash.push_back(stashed[i]);
    } else {
      group->plain.push_back(g);
    }
  }
  for (auto& dg : groups) {
    const at::Tensor flag = flag_for(found, dg.device);
    const at::Tensor inv = inv_scale.device() == dg.device
                               ? inv_scale
                               : inv_scale.to(dg.device, /*non_blocking=*/true);
    if (!dg.plain.empty()) ops::unscale_check_(dg.plain, flag, inv);
    if (!dg.out.empty()) ops::axpby_check_(dg.out, dg.out, dg.stash, inv, 1.0, flag);
  }
}

void LossScaler::unscale(const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& stashed) {
  std::lock_guard<std::mutex> lock(mutex_);
  unscale_into(grads, stashed, inverse_scale(), found_inf_);
  pending_ = true;
}

bool LossScaler::update() {
  DeviceFlags found;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = false;
    found = std::move(found_inf_);
    found_inf_.clear();
  }
  return update_from(std::move(found)).skipped;
}

LossScaler::StepResult LossScaler::finish_step(const std::vector<at::Tensor>& grads,
                                               const std::vector<at::Tensor>& stashed,
                                               const at::Tensor& inv_scale) {
  TORCH_CHECK_VALUE(
      inv_scale.defined() && inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat,
      "inv_scale must be a one-element float32 tensor");
  bool any_stash = false;
  for (const auto& t : stashed) any_stash |= t.defined();
  DeviceFlags found;
  // A fixed scale of 1.0 that checks nothing needs no pass at all (Apex's shortcut).
  const bool identity = !checks_ && fixed_scale_ == 1.0 && !any_stash;
  if (!identity && !grads.empty()) {
    unscale_into(grads, any_stash ? stashed : std::vector<at::Tensor>{}, inv_scale, found);
  }
  return update_from(std::move(found));
}

LossScaler::StepResult LossScaler::update_from(DeviceFlags found_list) {
  if (!checks_) {
    last_step_skipped_ = false;
    return {false, loss_scale_.load(), floor_skips_.load()};
  }
  c10::Device device(c10::kCPU);
  FoundInfReducer reducer;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // scale_ may be moved by to() on another thread
    device = scale_.device();
    reducer = found_inf_reducer_;
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
      last_step_skipped_ = true;
      ++skipped_steps_;
      throw;
    }
  }
  StepResult result;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (found.device() != scale_.device()) found = found.to(scale_.device());
    const double used = loss_scale_.load();
    if (dynamic_) {
      ops::update_scale_(scale_, growth_tracker_, hysteresis_tracker_, found, growth_factor_,
                         backoff_factor_, growth_interval_, hysteresis_, lowest_scale_,
                         max_loss_scale_);
    }
    // The one device->host copy of the step: overflow flag and new scale together.
    const at::Tensor status = at::cat({found.reshape({1}), scale_.reshape({1})}).to(at::kCPU);
    const float* s = status.const_data_ptr<float>();
    result.skipped = s[0] != 0.0f;
    result.loss_scale = s[1];
    loss_scale_ = s[1];
    last_step_skipped_ = result.skipped;
    if (result.skipped) {
      ++skipped_steps_;
      // At the bottom already: a fixed scale, or a dynamic one that cannot back off further
      // (min_loss_scale or the floor). Skips there can only repeat: count them for the error.
      const bool at_bottom = !dynamic_ || used <= lowest_scale_;
      floor_skips_ = at_bottom ? floor_skips_ + 1 : 0;
    } else {
      floor_skips_ = 0;
    }
    result.floor_skips = floor_skips_;
  }
  if (result.skipped && verbosity_ >= 1) {
    if (dynamic_) {
      std::cerr << "Gradient overflow. Skipping step, loss scaler " << loss_id_
                << " reducing loss scale to " << number_name(result.loss_scale) << std::endl;
    } else {
      std::cerr << "Gradient overflow. Skipping step, loss scaler " << loss_id_
                << " keeping its fixed loss scale " << number_name(result.loss_scale) << std::endl;
    }
  }
  return result;
}

void LossScaler::reduce_found_inf(const FoundInfReducer& reducer, at::Tensor& found) const {
  const auto device = found.device();
  reducer(found);
  TORCH_CHECK_VALUE(found.defined() && found.numel() == 1 && found.scalar_type() == at::kFloat &&
                        found.device() == device,
                    "the found_inf reducer of loss scaler ", loss_id_,
                    " must leave a one-element float32 tensor on ", device.str(), ", got ",
                    found.defined() ? found.toString() + " with " + std::to_string(found.numel()) +
                                          " elements on " + found.device().str()
                                    : std::string("an undefined tensor"));
}

namespace {

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

}  // namespace

void LossScaler::check_state(const StateDict& from, const std::string& prefix) const {
  const float scale = state_entry(from, prefix + "scale", at::kFloat).item<float>();
  const int32_t growth = state_entry(from, prefix + "growth_tracker", at::kInt).item<int32_t>();
  const int32_t hyst = state_entry(from, prefix + "hysteresis", at::kInt).item<int32_t>();
  const int64_t skipped = state_entry(from, prefix + "skipped", at::kLong).item<int64_t>();
  const int64_t floor = state_entry(from, prefix + "floor_skips", at::kLong).item<int64_t>();
  const std::string key = prefix + "scale";
  if (dynamic_) {
    const double lo =
        has_min_ ? std::max(kScaleFloor, std::min(min_loss_scale_, init_scale_)) : kScaleFloor;
    const double hi = std::max(max_loss_scale_, init_scale_);
    TORCH_CHECK_VALUE(std::isfinite(scale) && scale >= static_cast<float>(lo) && scale <= hi,
                      "state entry '", key, "' must lie within [", number_name(lo), ", ",
                      number_name(hi),
                      "] (the configured scaler's [min_loss_scale or 2^-126, max_loss_scale]), "
                      "got ",
                      number_name(scale));
  } else {
    TORCH_CHECK_VALUE(scale == static_cast<float>(fixed_scale_), "state entry '", key,
                      "' must equal the configured fixed loss scale ", number_name(fixed_scale_),
                      " (a fixed scale never changes), got ", number_name(scale),
                      "; initialize with loss_scale=\"dynamic\" (or with this scale) to resume it");
  }
  check_range<int64_t>(prefix + "growth_tracker", growth, 0, growth_interval_ - 1,
                       "0 to growth_interval - 1");
  check_range<int64_t>(prefix + "hysteresis", hyst, 0, hysteresis_, "0 to the hysteresis setting");
  check_range<int64_t>(prefix + "skipped", skipped, 0, std::numeric_limits<int64_t>::max(),
                       "a count of skipped steps");
  check_range<int64_t>(prefix + "floor_skips", floor, 0, skipped,
                       "a count of consecutive skips, at most 'skipped'");
}

void LossScaler::save(StateDict& into, const std::string& prefix) const {
  auto cpu = [](const at::Tensor& t) { return t.detach().to(at::kCPU).clone().reshape({}); };
  std::lock_guard<std::mutex> lock(mutex_);
  into.insert(prefix + "scale", cpu(scale_));
  into.insert(prefix + "growth_tracker", cpu(growth_tracker_));
  into.insert(prefix + "hysteresis", cpu(hysteresis_tracker_));
  into.insert(prefix + "skipped", at::scalar_tensor(skipped_steps_.load(), at::kLong));
  into.insert(prefix + "floor_skips", at::scalar_tensor(floor_skips_.load(), at::kLong));
}

void LossScaler::load(const StateDict& from, const std::string& prefix) {
  check_state(from, prefix);
  auto get = [&](const char* name) { return from.at(prefix + name).to(at::kCPU).reshape({}); };
  const at::Tensor scale = get("scale");
  std::lock_guard<std::mutex> lock(mutex_);
  scale_.copy_(scale);
  growth_tracker_.copy_(get("growth_tracker"));
  hysteresis_tracker_.copy_(get("hysteresis"));
  loss_scale_ = scale.item<float>();
  skipped_steps_ = get("skipped").item<int64_t>();
  floor_skips_ = get("floor_skips").item<int64_t>();
  last_step_skipped_ = false;
  pending_ = false;
  found_inf_.clear();
}

// ---- registry ------------------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mutex;
  bool configured = false;
  std::vector<std::shared_ptr<LossScaler>> scalers;
  // The optimizers scale_loss accepts (nullopt: any; see restrict_loss_scaling_to).
  std::optional<std::unordered_set<const void*>> optimizers;
  // Parameter dtypes at initialize (record_parameter_dtypes), keyed by TensorImpl with a weak
  // reference so a reused address is not mistaken for the parameter.
  std::unordered_map<const c10::TensorImpl*,
                     std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, at::ScalarType>>
      dtypes;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

constexpr const char* kEntryNames[] = {"scale", "growth_tracker", "hysteresis", "skipped",
                                       "floor_skips"};
constexpr size_t kEntriesPerScaler = std::size(kEntryNames);

std::string scaler_prefix(int i) { return "loss_scaler" + std::to_string(i) + "."; }

// Whether `key` is "loss_scaler<i>.<entry>" with i in [0, n) (as scaler_prefix writes i).
bool is_entry_name(const std::string& key, int n) {
  const std::string head = "loss_scaler";
  const auto dot = key.find('.');
  if (key.compare(0, head.size(), head) != 0 || dot == std::string::npos) return false;
  const std::string index = key.substr(head.size(), dot - head.size());
  if (index.empty() || index.size() > 9 || (index.size() > 1 && index[0] == '0') ||
      index.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  const std::string name = key.substr(dot + 1);
  return std::stoi(index) < n &&
         std::find(std::begin(kEntryNames), std::end(kEntryNames), name) != std::end(kEntryNames);
}

}  // namespace

LossScaler& loss_scaler(int loss_id) { return *detail::loss_scaler_ptr(loss_id); }

namespace detail {

std::shared_ptr<LossScaler> loss_scaler_ptr(int loss_id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(r.configured,
              "amp: loss scaling is not configured; call amp::initialize first (no loss scaler "
              "exists yet)");
  const int n = static_cast<int>(r.scalers.size());
  TORCH_CHECK_VALUE(loss_id >= 0 && loss_id < n, "loss_id must be in [0, ", n, ") (num_losses=", n,
                    "), got ", loss_id);
  return r.scalers[loss_id];
}

void configure_loss_scalers(const Properties& props) {
  TORCH_CHECK_VALUE(props.num_losses >= 1, "num_losses must be >= 1, got ", props.num_losses);
  std::vector<std::shared_ptr<LossScaler>> scalers;
  for (int i = 0; i < props.num_losses; ++i)
    scalers.push_back(std::make_shared<LossScaler>(props, i));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.scalers = std::move(scalers);
  r.configured = true;
  r.optimizers.reset();
  r.dtypes.clear();
}

void record_parameter_dtypes(const std::vector<at::Tensor>& parameters) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.dtypes.clear();
  for (const auto& p : parameters) {
    r.dtypes.insert_or_assign(
        p.unsafeGetTensorImpl(),
        std::make_pair(c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()),
                       p.scalar_type()));
  }
}

void check_parameter_dtypes(const std::vector<at::Tensor>& params,
                            const std::vector<std::string>& labels) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = r.dtypes.find(params[i].unsafeGetTensorImpl());
    if (it == r.dtypes.end() || it->second.first.lock().get() != params[i].unsafeGetTensorImpl())
      continue;
    TORCH_CHECK_VALUE(params[i].scalar_type() == it->second.second,
                      i < labels.size() ? labels[i] : std::string("a parameter"), " must still be ",
                      dtype_name(it->second.second), " as when amp::initialize ran, got ",
                      dtype_name(params[i].scalar_type()),
                      ": the model was cast after initialize (e.g. model->to(torch::kDouble)), "
                      "which optamp does not follow. Call amp::reset(), cast the model, and "
                      "initialize again (or cast before initialize); moving it to another device "
                      "is fine.");
  }
}

void restrict_loss_scaling_to(const std::vector<const void*>& optimizers) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.optimizers.emplace(optimizers.begin(), optimizers.end());
}

void check_optimizers_allowed(const std::vector<const void*>& identities,
                              const std::vector<std::string>& descriptions) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.optimizers) return;
  for (size_t i = 0; i < identities.size(); ++i) {
    TORCH_CHECK_VALUE(r.optimizers->count(identities[i]),
                      i < descriptions.size() ? descriptions[i] : std::string("optimizer"),
                      " must be an optimizer passed to amp::initialize, got one that was not "
                      "(its parameters would be unscaled with the loss scaler of another "
                      "optimizer's training); pass every optimizer to amp::initialize (a list), "
                      "or call amp::reset() and initialize again with this one");
  }
}

void reset_loss_scalers() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.scalers.clear();
  r.configured = false;
  r.optimizers.reset();
  r.dtypes.clear();
}

int num_loss_scalers() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int>(r.scalers.size());
}

}  // namespace detail

// ---- state dict ----------------------------------------------------------------------------

void StateDict::insert(const std::string& name, const at::Tensor& value) {
  auto [it, added] = index_.try_emplace(name, items_.size());
  if (added) {
    items_.emplace_back(name, value);
  } else {
    items_[it->second].second = value;
  }
}

bool StateDict::contains(const std::string& name) const { return index_.count(name) != 0; }

const at::Tensor& StateDict::at(const std::string& name) const {
  auto it = index_.find(name);
  TORCH_CHECK_VALUE(it != index_.end(), "state dict must contain '", name, "', got keys [",
                    c10::Join(", ", keys()), "]");
  return items_[it->second].second;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : items_) out.push_back(k);
  return out;
}

StateDict state_dict() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(r.configured, "amp::state_dict: call amp::initialize first (no loss scaler exists)");
  StateDict sd;
  for (size_t i = 0; i < r.scalers.size(); ++i) r.scalers[i]->save(sd, scaler_prefix(i));
  return sd;
}

void load_state_dict(const StateDict& state) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(r.configured,
              "amp::load_state_dict: call amp::initialize first (no loss scaler exists)");
  const int n = static_cast<int>(r.scalers.size());
  int saved = 0;
  while (state.contains(scaler_prefix(saved) + "scale")) ++saved;
  TORCH_CHECK_VALUE(saved == n, "state dict must hold num_losses=", n,
                    " loss scalers (keys loss_scaler0.* .. loss_scaler", n - 1, ".*), got ", saved);
  for (int i = 0; i < n; ++i) r.scalers[i]->check_state(state, scaler_prefix(i));
  // Every entry is one of those checked: nothing the caller meant to restore is dropped silently.
  if (state.size() != static_cast<size_t>(n) * kEntriesPerScaler) {
    for (const auto& [key, value] : state.items()) {
      TORCH_CHECK_VALUE(is_entry_name(key, n),
                        "state dict must hold only the entries of num_losses=", n,
                        " loss scalers (loss_scaler<i>.{scale, growth_tracker, hysteresis, "
                        "skipped, floor_skips}), got an unknown entry '",
                        key, "'");
    }
  }
  for (int i = 0; i < n; ++i) r.scalers[i]->load(state, scaler_prefix(i));
}

// Saved as a names string plus tensors "t0", "t1", ... (dotted names are not valid archive keys).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const StateDict& state) {
  std::string names;
  for (size_t i = 0; i < state.items().size(); ++i) {
    if (i) names += '\n';
    names += state.items()[i].first;
    archive.write("t" + std::to_string(i), state.items()[i].second, /*is_buffer=*/true);
  }
  archive.write("optamp_state_names", c10::IValue(names));
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           StateDict& state) {
  c10::IValue names_value;
  TORCH_CHECK_VALUE(archive.try_read("optamp_state_names", names_value),
                    "archive must hold an amp::StateDict (key 'optamp_state_names' missing)");
  const std::string names = names_value.toStringRef();
  StateDict loaded;
  if (!names.empty()) {
    std::istringstream in(names);
    std::string name;
    for (size_t i = 0; std::getline(in, name); ++i) {
      at::Tensor t;
      archive.read("t" + std::to_string(i), t, /*is_buffer=*/true);
      loaded.insert(name, t);
    }
  }
  state = std::move(loaded);
  return archive;
}

}  // namespace amp
