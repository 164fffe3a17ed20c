// optamp/state_dict.h: amp::StateDict, its torch::serialize archive form, and the session's
// scalers saved and loaded as one state dict (amp::state_dict / amp::load_state_dict).
#include "optamp/state_dict.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "optamp/loss_scaler.h"
#include "session.h"

namespace amp {

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

namespace {

// The session's scalers, refusing when none is configured. `who` names the caller in the error.
const std::vector<std::shared_ptr<LossScaler>>& configured_scalers(const detail::Session& s,
                                                                   const char* who) {
  TORCH_CHECK(!s.loss_scalers.empty(), who, ": call amp::initialize first (no loss scaler exists)");
  return s.loss_scalers;
}

// "dynamic" is optional on load (checkpoints written before 2026-12-06 lack it).
constexpr const char* kEntryNames[] = {"scale",   "growth_tracker", "hysteresis",
                                       "skipped", "floor_skips",    "dynamic"};
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

StateDict state_dict() {
  const auto session = detail::current_session();
  const auto& scalers = configured_scalers(*session, "amp::state_dict");
  StateDict sd;
  for (size_t i = 0; i < scalers.size(); ++i)
    scalers[i]->save(sd, scaler_prefix(static_cast<int>(i)));
  return sd;
}

void load_state_dict(const StateDict& state) {
  const auto session = detail::current_session();
  const auto& scalers = configured_scalers(*session, "amp::load_state_dict");
  const int n = static_cast<int>(scalers.size());
  int saved = 0;
  while (state.contains(scaler_prefix(saved) + "scale")) ++saved;
  TORCH_CHECK_VALUE(saved == n, "state dict must hold num_losses=", n,
                    " loss scalers (keys loss_scaler0.* .. loss_scaler", n - 1, ".*), got ", saved);
  for (int i = 0; i < n; ++i) scalers[i]->check_state(state, scaler_prefix(i));
  // Every entry is one of those checked: nothing the caller meant to restore is dropped silently.
  if (state.size() != static_cast<size_t>(n) * kEntriesPerScaler) {
    for (const auto& [key, value] : state.items()) {
      TORCH_CHECK_VALUE(is_entry_name(key, n),
                        "state dict must hold only the entries of num_losses=", n,
                        " loss scalers (loss_scaler<i>.{scale, growth_tracker, hysteresis, "
                        "skipped, floor_skips, dynamic}), got an unknown entry '",
                        key, "'");
    }
  }
  for (int i = 0; i < n; ++i) scalers[i]->load(state, scaler_prefix(i));
}

}  // namespace amp
