// amp::LossScaler, the process-wide scaler registry and amp::StateDict.
#include "optamp/loss_scaler.h"

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>

#include "ops/multi_tensor.h"
#include "optamp/state_dict.h"
#include "scaler/registry.h"

namespace amp {
namespace {

// Python's float formatting for the log line ("32768.0", "0.5").
std::string format_scale(double v) {
  std::ostringstream out;
  out.precision(17);
  out << v;
  std::string s = out.str();
  if (std::isfinite(v) && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

LossScaler::LossScaler(const Properties& props, int loss_id)
    : loss_id_(loss_id),
      dynamic_(props.enabled && props.loss_scale.is_dynamic()),
      init_scale_(props.init_scale),
      growth_factor_(props.growth_factor),
      backoff_factor_(props.backoff_factor),
      growth_interval_(props.growth_interval),
      hysteresis_(props.hysteresis),
      min_loss_scale_(props.min_loss_scale.value_or(0.0)),
      max_loss_scale_(props.max_loss_scale),
      has_min_(props.min_loss_scale.has_value()),
      verbosity_(props.verbosity) {
  TORCH_CHECK_VALUE(loss_id >= 0, "loss_id must be >= 0, got ", loss_id);
  TORCH_CHECK_VALUE(growth_interval_ > 0, "growth_interval must be positive, got ",
                    growth_interval_);
  TORCH_CHECK_VALUE(hysteresis_ > 0, "hysteresis must be positive, got ", hysteresis_);
  const double value =
      !props.enabled ? 1.0 : (dynamic_ ? props.init_scale : props.loss_scale.value());
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0,
                    "loss scale must be positive and finite, got ", value);
  loss_scale_ = static_cast<float>(value);
  scale_ = at::full({}, value, at::kFloat);
  growth_tracker_ = at::zeros({}, at::kInt);
  hysteresis_tracker_ = at::full({}, hysteresis_, at::kInt);
}

void LossScaler::to(const c10::Device& device) {
  if (scale_.device() == device) return;
  scale_ = scale_.to(device);
  growth_tracker_ = growth_tracker_.to(device);
  hysteresis_tracker_ = hysteresis_tracker_.to(device);
  inv_scale_.clear();  // recomputed from the moved scale
}

at::Tensor LossScaler::scale(const at::Tensor& loss) {
  to(loss.device());
  return loss.to(at::kFloat) * scale_;
}

at::Tensor LossScaler::found_inf_for(const c10::Device& device) {
  for (auto& [d, t] : found_inf_)
    if (d == device) return t;
  found_inf_.emplace_back(device, at::zeros({1}, at::TensorOptions(at::kFloat).device(device)));
  return found_inf_.back().second;
}

at::Tensor LossScaler::inv_scale_for(const c10::Device& device) {
  for (auto& [d, t] : inv_scale_)
    if (d == device) return t;
  // As torch.amp.GradScaler: 1/scale in double, rounded to float.
  at::Tensor inv = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  if (inv.device() != device) inv = inv.to(device, /*non_blocking=*/true);
  inv_scale_.emplace_back(device, inv);
  return inv;
}

void LossScaler::unscale(const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& stashed) {
  TORCH_CHECK_VALUE(stashed.empty() || stashed.size() == grads.size(),
                    "stashed must be empty or as long as grads (", grads.size(), "), got ",
                    stashed.size());
  // Validate everything before touching anything: never leave grads half-unscaled.
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
    const at::Tensor found = found_inf_for(dg.device);
    const at::Tensor inv = inv_scale_for(dg.device);
    if (!dg.plain.empty()) ops::unscale_check_(dg.plain, found, inv);
    if (!dg.out.empty()) ops::axpby_check_(dg.out, dg.out, dg.stash, inv, 1.0, found);
  }
  pending_ = true;
}

bool LossScaler::update() {
  pending_ = false;
  auto found_list = std::move(found_inf_);
  found_inf_.clear();
  inv_scale_.clear();
  if (!dynamic_) {
    last_step_skipped_ = false;
    return false;
  }
  const auto device = scale_.device();
  at::Tensor found;
  if (found_list.size() == 1 && found_list[0].first == device) {
    found = found_list[0].second;
  } else {
    found = at::zeros({1}, at::TensorOptions(at::kFloat).device(device));
    for (auto& [d, f] : found_list) found.add_(f.to(device, /*non_blocking=*/true));
  }
  if (found_inf_reducer_) {
    try {
      reduce_found_inf(found);
    } catch (...) {
      // The guard skips the step (see scale_loss.cpp); the scale stays as it was.
      last_step_skipped_ = true;
      ++skipped_steps_;
      throw;
    }
  }
  ops::update_scale_(scale_, growth_tracker_, hysteresis_tracker_, found, growth_factor_,
                     backoff_factor_, growth_interval_, hysteresis_, min_loss_scale_,
                     max_loss_scale_);
  // The one device->host copy of the step: overflow flag and new scale together.
  const at::Tensor status = at::cat({found.reshape({1}), scale_.reshape({1})}).to(at::kCPU);
  const float* s = status.const_data_ptr<float>();
  const bool skip = s[0] != 0.0f;
  const double used = loss_scale_;
  loss_scale_ = s[1];
  last_step_skipped_ = skip;
  if (skip) {
    ++skipped_steps_;
    floor_skips_ = (has_min_ && used <= min_loss_scale_) ? floor_skips_ + 1 : 0;
    if (verbosity_ >= 1) {
      std::cerr << "Gradient overflow. Skipping step, loss scaler " << loss_id_
                << " reducing loss scale to " << format_scale(loss_scale_) << std::endl;
    }
  } else {
    floor_skips_ = 0;
  }
  return skip;
}

void LossScaler::reduce_found_inf(at::Tensor& found) const {
  const auto device = found.device();
  found_inf_reducer_(found);
  TORCH_CHECK_VALUE(found.defined() && found.numel() == 1 && found.scalar_type() == at::kFloat &&
                        found.device() == device,
                    "the found_inf reducer of loss scaler ", loss_id_,
                    " must leave a one-element float32 tensor on ", device.str(), ", got ",
                    found.defined() ? found.toString() + " with " + std::to_string(found.numel()) +
                                          " elements on " + found.device().str()
                                    : std::string("an undefined tensor"));
}

void LossScaler::check_state(const StateDict& from, const std::string& prefix) {
  auto check = [&](const char* name, at::ScalarType dtype) {
    const std::string key = prefix + name;
    const at::Tensor& t = from.at(key);
    TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == dtype && t.numel() == 1, "state entry '",
                      key, "' must be a one-element ", dtype_name(dtype), " tensor, got ",
                      t.defined() ? dtype_name(t.scalar_type()) : "undefined",
                      t.defined() ? " with " + std::to_string(t.numel()) + " elements" : "");
  };
  check("scale", at::kFloat);
  check("growth_tracker", at::kInt);
  check("hysteresis", at::kInt);
  check("skipped", at::kLong);
  check("floor_skips", at::kLong);
  const float scale = from.at(prefix + "scale").to(at::kCPU).item<float>();
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "state entry '", prefix,
                    "scale' must be positive and finite, got ", scale);
}

void LossScaler::save(StateDict& into, const std::string& prefix) const {
  auto cpu = [](const at::Tensor& t) { return t.detach().to(at::kCPU).clone(); };
  into.insert(prefix + "scale", cpu(scale_));
  into.insert(prefix + "growth_tracker", cpu(growth_tracker_));
  into.insert(prefix + "hysteresis", cpu(hysteresis_tracker_));
  into.insert(prefix + "skipped", at::scalar_tensor(skipped_steps_, at::kLong));
  into.insert(prefix + "floor_skips", at::scalar_tensor(floor_skips_, at::kLong));
}

void LossScaler::load(const StateDict& from, const std::string& prefix) {
  check_state(from, prefix);
  auto get = [&](const char* name) { return from.at(prefix + name).to(at::kCPU).reshape({}); };
  const at::Tensor scale = get("scale");
  scale_.copy_(scale);
  growth_tracker_.copy_(get("growth_tracker"));
  hysteresis_tracker_.copy_(get("hysteresis"));
  loss_scale_ = scale.item<float>();
  skipped_steps_ = get("skipped").item<int64_t>();
  floor_skips_ = get("floor_skips").item<int64_t>();
  last_step_skipped_ = false;
  pending_ = false;
  found_inf_.clear();
  inv_scale_.clear();
}

// ---- registry ------------------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mutex;
  bool configured = false;
  std::vector<std::shared_ptr<LossScaler>> scalers;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::string scaler_prefix(int i) { return "loss_scaler" + std::to_string(i) + "."; }

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
}

void reset_loss_scalers() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.scalers.clear();
  r.configured = false;
}

int num_loss_scalers() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int>(r.scalers.size());
}

}  // namespace detail

// ---- state dict ----------------------------------------------------------------------------

void StateDict::insert(const std::string& name, const at::Tensor& value) {
  for (auto& [k, v] : items_) {
    if (k == name) {
      v = value;
      return;
    }
  }
  items_.emplace_back(name, value);
}

bool StateDict::contains(const std::string& name) const {
  for (const auto& [k, v] : items_)
    if (k == name) return true;
  return false;
}

const at::Tensor& StateDict::at(const std::string& name) const {
  for (const auto& [k, v] : items_)
    if (k == name) return v;
  TORCH_CHECK_VALUE(false, "state dict must contain '", name, "', got keys [",
                    c10::Join(", ", keys()), "]");
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
  for (int i = 0; i < n; ++i) LossScaler::check_state(state, scaler_prefix(i));
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
