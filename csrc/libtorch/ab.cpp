// The program side of the A/B protocol (optamp/ab.h): the level and seed from the environment,
// metrics as JSON lines for the runner (python -m optamp.ab).
#include "optamp/ab.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "common/format.h"
#include "diagnostics/precision_format.h"
#include "libtorch/ab_precision.h"
#include "optamp/opt_level.h"
#include "optamp/precision_probe.h"

namespace amp {
namespace ab {

void finish_precision_request(std::int64_t step, Reporter& reporter);

namespace {

using detail::json_string;

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

// JSON as Python's json module reads and writes it: non-finite numbers as NaN / Infinity.
std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return detail::number_name(v);
}

// An environment variable holding an integer >= 0, or nullopt when it is unset; anything else is
// an error naming the variable and what it holds (`what`: "an integer", "a step count").
std::optional<std::int64_t> env_count(const char* name, const char* what) {
  const char* v = env_or_null(name);
  if (v == nullptr) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != v && *end == '\0' && parsed >= 0, name, " must be ", what,
                    " >= 0, got \"", v, "\"");
  return parsed;
}

// The runner's --precision-steps request (kPrecisionStepsEnv): armed by opt_level(), started by
// amp::initialize, ended by the report of step N.
struct PrecisionRequest {
  std::mutex mutex;
  std::int64_t steps = 0;
  std::unique_ptr<PrecisionProbe> probe;
  bool done = false;  // one report per process, even if the program initializes again
};

PrecisionRequest& precision_request() {
  static auto* request = new PrecisionRequest();  // never destroyed: used at exit
  return *request;
}

void arm_precision_request() {
  const std::int64_t steps = env_count(kPrecisionStepsEnv, "a step count").value_or(0);
  auto& request = precision_request();
  std::lock_guard<std::mutex> lock(request.mutex);
  request.steps = reports_here() ? steps : 0;  // the other ranks would record for nothing
}

}  // namespace

bool reports_here() {
  for (const char* name : kRankEnvs) {
    const char* v = env_or_null(name);
    if (v == nullptr) continue;
    // As Python's reports_here reads it: " 0" from a launcher's template is rank 0, a blank is
    // not set (else C++ and Python ranks of one run disagreed on who writes).
    const std::string value(v);
    const auto first = value.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) continue;
    const auto last = value.find_last_not_of(" \t\r\n");
    return value.substr(first, last - first + 1) == "0";
  }
  return true;
}

std::string opt_level(const std::string& default_level) {
  const char* v = env_or_null(kOptLevelEnv);
  std::string level = v != nullptr ? v : default_level;
  // Validated here, so a bad value names the variable rather than failing later in initialize.
  try {
    (void)parse_opt_level(level);
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(v == nullptr, kOptLevelEnv, " must be an opt level O0..O5, got \"", level,
                      "\"");
    throw;
  }
  arm_precision_request();
  return level;
}

std::int64_t seed(std::int64_t default_seed) {
  return env_count(kSeedEnv, "an integer").value_or(default_seed);
}

std::string Value::json() const {
  if (const auto* d = std::get_if<double>(&value_)) return json_number(*d);
  if (const auto* i = std::get_if<std::int64_t>(&value_)) return std::to_string(*i);
  if (const auto* b = std::get_if<bool>(&value_)) return *b ? "true" : "false";
  return json_string(std::get<std::string>(value_));
}

std::optional<double> Value::number() const {
  if (const auto* d = std::get_if<double>(&value_)) return *d;
  if (const auto* i = std::get_if<std::int64_t>(&value_)) return static_cast<double>(*i);
  return std::nullopt;
}

struct Reporter::File {
  std::ofstream out;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

Reporter::Reporter(const std::string& path) {
  if (path.empty()) return;
  file_ = std::make_unique<File>();
  file_->out.open(path, std::ios::app);
  TORCH_CHECK(file_->out.good(), "amp::ab: cannot write the metrics file \"", path, "\"");
}

Reporter::~Reporter() = default;

bool Reporter::active() const { return file_ != nullptr; }

void Reporter::report(const Metrics& metrics) {
  if (!file_ || !reports_here()) return;
  std::string fields;
  std::optional<double> step;
  for (const auto& [key, value] : metrics) {
    TORCH_CHECK_VALUE(key != "t", "amp::ab::report: \"t\" is the reporter's own time stamp; ",
                      "name the metric differently");
    fields += json_string(key) + ": " + value.json() + ", ";
    if (key == "step") step = value.number();
  }
  write_fields(fields);
  if (step) finish_precision_request(static_cast<std::int64_t>(*step), *this);
}

void Reporter::write_fields(const std::string& fields) {
  const double t =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - file_->start).count();
  const std::string line = "{" + fields + "\"t\": " + json_number(t) + "}\n";
  std::lock_guard<std::mutex> lock(mutex_);
  file_->out << line << std::flush;
}

Reporter& reporter() {
  static Reporter the_reporter([] {
    const char* path = env_or_null(kMetricsEnv);
    return std::string(path != nullptr ? path : "");
  }());
  return the_reporter;
}

// The report of step N ends the runner's probe: its table and the whole report as one line.
void finish_precision_request(std::int64_t step, Reporter& reporter) {
  auto& request = precision_request();
  std::unique_ptr<PrecisionProbe> probe;
  {
    std::lock_guard<std::mutex> lock(request.mutex);
    if (!request.probe || step < request.steps) return;
    probe = std::move(request.probe);
    request.done = true;
  }
  probe->stop();
  const PrecisionProbe::Report report = probe->report();
  // The same line optamp.ab.report writes in Python.
  reporter.write_fields("\"type\": \"precision\", \"steps\": " + std::to_string(request.steps) +
                        ", \"table\": " + json_string(probe->table()) +
                        ", \"calls\": " + std::to_string(report.calls) + ", \"first_nonfinite\": " +
                        detail::precision_nonfinite_json(report.first_nonfinite) + ", ");
}

}  // namespace ab

void detail::start_ab_precision_probe() {
  auto& request = ab::precision_request();
  std::lock_guard<std::mutex> lock(request.mutex);
  if (request.steps > 0 && !request.probe && !request.done)
    request.probe = std::make_unique<PrecisionProbe>("python -m optamp.ab --precision-steps");
}

}  // namespace amp
