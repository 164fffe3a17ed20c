#pragma once
// amp's checkpointable state: an ordered name -> tensor map, saveable with torch::save.
//
//   torch::save(amp::state_dict(), "amp.pt");
//   amp::StateDict sd;
//   torch::load(sd, "amp.pt");
//   amp::load_state_dict(sd);
//
// Names: "loss_scaler<i>.scale" (float32), ".growth_tracker" (int32), ".hysteresis" (int32),
// ".skipped" (int64), ".floor_skips" (int64), ".dynamic" (bool; absent from checkpoints written
// before 2026-12-06, which still load). Round trips are bit-exact.

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "optamp/export.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace amp {

class OPTAMP_API StateDict {
 public:
  // Adds or replaces `name`. Lookups are hashed, so building or reading a dict is linear in its
  // size (a run with many losses has five entries per loss).
  void insert(const std::string& name, const at::Tensor& value);
  bool contains(const std::string& name) const;
  // Throws a ValueError naming the missing key.
  const at::Tensor& at(const std::string& name) const;
  std::vector<std::string> keys() const;
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  const std::vector<std::pair<std::string, at::Tensor>>& items() const { return items_; }

 private:
  std::vector<std::pair<std::string, at::Tensor>> items_;  // in insertion order
  std::unordered_map<std::string, size_t> index_;          // name -> position in items_
};

OPTAMP_API StateDict state_dict();
// Restores every loss scaler. Validates first (missing keys, num_losses mismatch, dtypes);
// on error nothing changes.
OPTAMP_API void load_state_dict(const StateDict& state);

OPTAMP_API torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                       const StateDict& state);
OPTAMP_API torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                                      StateDict& state);

}  // namespace amp
