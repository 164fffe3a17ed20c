#pragma once
// The A/B protocol between a training program and `python -m optamp.ab` (docs/ab_test.md).
//
// The runner starts the program once per opt level and seed and tells it which through the
// environment; the program asks for them (nothing reads the environment unless it does) and
// reports what it measured, one JSON line per call:
//
//   auto handle = amp::initialize(model, optimizer, amp::ab::opt_level("O1"));
//   torch::manual_seed(amp::ab::seed(0));
//   ...
//   amp::ab::report({{"step", step}, {"loss", loss.item<double>()}});
//   amp::ab::report({{"test_accuracy", accuracy}});          // a final metric
//
// Outside the runner (no OPTAMP_AB_METRICS in the environment) report() does nothing, so the
// calls can stay in the program.

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "optamp/export.h"

namespace amp {
namespace ab {

// The environment variables of the protocol.
inline constexpr const char* kOptLevelEnv = "OPTAMP_OPT_LEVEL";
inline constexpr const char* kSeedEnv = "OPTAMP_SEED";
inline constexpr const char* kMetricsEnv = "OPTAMP_AB_METRICS";
// Set by the runner's --precision-steps N: a program that asks for its level with opt_level()
// records the per-op precision report (optamp/precision_probe.h) from amp::initialize until it
// reports step N, and reports the report as one line.
inline constexpr const char* kPrecisionStepsEnv = "OPTAMP_AB_PRECISION_STEPS";

// Where launchers put a process's global rank: torchrun / torch.distributed.launch, Open MPI,
// MPICH and Intel MPI.
inline constexpr const char* kRankEnvs[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"};

// Whether this process writes the run's metrics: global rank 0 of a distributed program (the first
// of kRankEnvs that is set), any process that is not one. report() writes nothing elsewhere: every
// rank writing into the one metrics file interleaved their losses and made step times of the gaps
// between the ranks' lines.
OPTAMP_API bool reports_here();

// OPTAMP_OPT_LEVEL when it is set (validated: "O0".."O5"), else `default_level`.
OPTAMP_API std::string opt_level(const std::string& default_level = "O1");
// OPTAMP_SEED when it is set (an integer >= 0), else `default_seed`.
OPTAMP_API std::int64_t seed(std::int64_t default_seed = 0);

// One reported value: a number, a flag or a short text.
class OPTAMP_API Value {
 public:
  Value(double v) : value_(v) {}                           // NOLINT(google-explicit-constructor)
  Value(float v) : value_(static_cast<double>(v)) {}       // NOLINT(google-explicit-constructor)
  Value(int v) : value_(static_cast<std::int64_t>(v)) {}   // NOLINT(google-explicit-constructor)
  Value(long v) : value_(static_cast<std::int64_t>(v)) {}  // NOLINT(google-explicit-constructor)
  Value(long long v)                                       // NOLINT(google-explicit-constructor)
      : value_(static_cast<std::int64_t>(v)) {}
  Value(bool v) : value_(v) {}                      // NOLINT(google-explicit-constructor)
  Value(const char* v) : value_(std::string(v)) {}  // NOLINT(google-explicit-constructor)
  Value(std::string v) : value_(std::move(v)) {}    // NOLINT(google-explicit-constructor)
  // The value as JSON (non-finite numbers as NaN / Infinity / -Infinity, as Python's json does).
  std::string json() const;
  // The value as a number, for numbers (a step, a loss); empty for flags and texts.
  std::optional<double> number() const;

 private:
  std::variant<double, std::int64_t, bool, std::string> value_;
};

using Metrics = std::vector<std::pair<std::string, Value>>;

// Writes one JSON object a line to a file, with "t": seconds since the reporter was made, so the
// runner can time steps a program does not time itself. Thread-safe; each line is flushed.
class OPTAMP_API Reporter {
 public:
  // An empty path makes a reporter that writes nothing.
  explicit Reporter(const std::string& path);
  ~Reporter();
  Reporter(const Reporter&) = delete;
  Reporter& operator=(const Reporter&) = delete;

  bool active() const;
  // Keys are metric names ("step", "loss", "step_ms", "test_accuracy", ...); see docs/ab_test.md.
  void report(const Metrics& metrics);

 private:
  // Writes `{<fields>, "t": ...}`: fields is the inside of a JSON object, already formatted.
  void write_fields(const std::string& fields);
  // Writes the runner's precision report (--precision-steps) after the step that ends it.
  friend void finish_precision_request(std::int64_t step, Reporter& reporter);

  struct File;
  std::unique_ptr<File> file_;
  std::mutex mutex_;
};

// The process's reporter: OPTAMP_AB_METRICS's file, opened at the first call (none: inactive).
OPTAMP_API Reporter& reporter();
inline void report(std::initializer_list<std::pair<std::string, Value>> metrics) {
  reporter().report(Metrics(metrics));
}
inline void report(const Metrics& metrics) { reporter().report(metrics); }

}  // namespace ab
}  // namespace amp
