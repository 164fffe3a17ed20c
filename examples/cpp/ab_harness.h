#pragma once
// What train_fashion_mnist.cpp does for the A/B harness alone (scripts/ab_test.sh through
// python -m optamp.ab, tests/python/test_ab.py), kept out of the example: where its metrics lines
// go (--metrics), the extra test-set evaluations (--eval-at) and the trained weights for an
// independent check (--save-weights). Header-only, like trainer_common.h. The Python twin
// (examples/python/train_fashion_mnist.py) does the same inline.
//
// Metrics file (one JSON object a line, each with "t": seconds since the first line):
//   {"type":"config", ...}                      the run's settings
//   {"type":"step","step":1,"loss":..,"loss_scale":..,"skipped":false,"step_ms":..}
//   {"type":"eval","step":150,"test_accuracy":..,"test_loss":..}   for each --eval-at step
//   {"type":"summary","test_accuracy":..,"test_loss":..,"median_step_ms":..,...}
// --eval-at 100,400 evaluates the test set after those steps too (eval mode, no grad: training is
// not changed, so a 100-step run's result equals the eval at step 100 of a longer run with the
// same seed; ab_test.sh pairs levels run for fewer steps with the baseline this way).
// --save-weights FILE writes the trained parameters and buffers (a name -> tensor dict, readable
// with torch.load) so the test set's result can be checked against the weights independently.
#include <optamp/amp.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ab_harness {

// Where the metrics lines go: --metrics FILE (emptied here), else the runner's file
// (OPTAMP_AB_METRICS); with neither, nowhere.
class MetricsOut {
 public:
  explicit MetricsOut(const std::string& path)
      : own_(open(path)), reporter_(own_ ? *own_ : amp::ab::reporter()) {}
  void report(const amp::ab::Metrics& line) { reporter_.report(line); }

 private:
  static std::unique_ptr<amp::ab::Reporter> open(const std::string& path) {
    if (path.empty()) return nullptr;
    if (!std::ofstream(path)) throw std::runtime_error("cannot write --metrics " + path);
    return std::make_unique<amp::ab::Reporter>(path);
  }
  std::unique_ptr<amp::ab::Reporter> own_;
  amp::ab::Reporter& reporter_;
};

// --eval-at "100,400" -> {100, 400}: sorted and distinct, every entry a step number >= 1.
inline std::vector<std::int64_t> parse_steps(const std::string& flag, const std::string& v) {
  std::vector<std::int64_t> out;
  std::stringstream in(v);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    std::int64_t step = 0;
    try {
      step = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;  // not a number: reported below
    }
    if (used == 0 || used != item.size() || step < 1)
      throw std::invalid_argument(flag + " takes step numbers >= 1 separated by commas, got \"" +
                                  v + "\"");
    out.push_back(step);
  }
  if (out.empty())
    throw std::invalid_argument(flag + " takes step numbers >= 1 separated by commas, got \"\"");
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// The --eval-at steps (parse_steps) of a run of `total` steps.
class EvalSteps {
 public:
  // Throws when a step is after the run's last.
  EvalSteps(std::vector<std::int64_t> steps, std::int64_t total)
      : steps_(std::move(steps)), total_(total) {
    if (!steps_.empty() && steps_.back() > total_)
      throw std::invalid_argument("--eval-at " + std::to_string(steps_.back()) +
                                  " is after the run's last step " + std::to_string(total_));
  }
  // Whether to evaluate after step `step` (1-based) before the last: the last step's evaluation
  // is the run's final one (at_end).
  bool mid_run(std::int64_t step) const {
    return step < total_ && std::binary_search(steps_.begin(), steps_.end(), step);
  }
  // Whether --eval-at named the last step: the final evaluation is reported as its eval line.
  bool at_end() const { return !steps_.empty() && steps_.back() == total_; }

 private:
  std::vector<std::int64_t> steps_;
  std::int64_t total_;
};

// --save-weights: the model's parameters and buffers as a name -> tensor dict in torch.save's
// format.
inline void save_weights(const torch::nn::Module& model, const std::string& path) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& p : model.named_parameters()) dict.insert(p.key(), p.value().detach().cpu());
  for (const auto& b : model.named_buffers()) dict.insert(b.key(), b.value().detach().cpu());
  const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write --save-weights " + path);
}

}  // namespace ab_harness
