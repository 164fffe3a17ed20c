#pragma once
// What the two A/B trainers (train_fashion_mnist.cpp, train_char_gpt.cpp) share: the optamp
// integration (AmpSession), the device setup, the run's bookkeeping (step times, losses, skipped
// steps, the training's own time and peak memory), the progress line and main()'s exit statuses.
// Header-only: every examples/cpp/*.cpp is a program of its own (CMakeLists.txt). The Python
// trainers share the same in examples/python/trainer_common.py.
#include <optamp/amp.h>
#include <torch/cuda.h>
#include <torch/optim.h>
#include <torch/utils.h>
#include <unistd.h>

#ifdef OPTAMP_EXAMPLE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainer_common {

using Clock = std::chrono::steady_clock;

// ---- optamp integration: the only code in the trainers that touches the amp API, besides the ---
// amp::ab calls of the A/B protocol and amp::parse_opt_level checking --opt-level. Everything
// else is an ordinary LibTorch training loop.

// amp::initialize threw c10::NotImplementedError: the opt level is not supported by this build or
// device. run_main turns it into exit status 3.
class UnsupportedOptLevel : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct AmpSession {
  amp::Handle handle;
  template <typename Model>
  AmpSession(Model& model, torch::optim::Optimizer& optimizer, const std::string& level)
      // initialize prints one line (verbosity 1, the default); the scaler logs each skipped
      // step on stderr. The A/B logs keep Apex's full report, printed here once.
      : handle(initialize(model, optimizer, level)) {
    std::cout << handle.describe() << std::flush;
  }
  // backward through the scaled loss; on overflow the guard makes optimizer.step() a no-op.
  static void backward(const torch::Tensor& loss, torch::optim::Optimizer& optimizer) {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  static double loss_scale() { return amp::loss_scaler(0).loss_scale(); }
  static bool last_step_skipped() { return amp::loss_scaler(0).last_step_skipped(); }
  static void reset() { amp::reset(); }

 private:
  template <typename Model>
  static amp::Handle initialize(Model& model, torch::optim::Optimizer& optimizer,
                                const std::string& level) {
    try {
      return amp::initialize(model, optimizer, level, amp::Options{});
    } catch (const c10::NotImplementedError& e) {
      throw UnsupportedOptLevel("opt level " + level +
                                " unsupported: " + e.what_without_backtrace());
    }
  }
};
// ---- end of optamp integration --------------------------------------------------------------

// --threads and --device: the device to train on. A CUDA device LibTorch cannot see is an error
// rather than a silent CPU run, which an A/B comparison would mislabel.
inline torch::Device setup_device(const std::string& device, int threads) {
  if (threads > 0) torch::set_num_threads(threads);
  if (device == "cuda" && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda: no CUDA device is visible to LibTorch");
  return device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

// Peak memory during training: CPU RSS high-water mark (reset through /proc/self/clear_refs), or
// the CUDA caching allocator's peak allocated bytes.
inline void reset_peak_memory(const torch::Device& device) {
#ifdef OPTAMP_EXAMPLE_CUDA
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
  std::ofstream("/proc/self/clear_refs") << "5";
}

inline double peak_memory_mb(const torch::Device& device) {
#ifdef OPTAMP_EXAMPLE_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);
  }
#endif
  (void)device;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return std::nan("");
}

inline double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline std::string fmt_duration(double s) {
  char buf[32];
  const long t = std::lround(std::max(0.0, s));
  std::snprintf(buf, sizeof(buf), "%ld:%02ld", t / 60, t % 60);
  return buf;
}

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One optimizer step as the trainers report it.
struct StepResult {
  double ms;
  double loss;
  bool skipped;
};

// The run's bookkeeping. Mid-training evaluations (evaluation()) are left out of the training
// time and of the peak memory, so both describe training alone: the peak is that of each
// training stretch.
class RunStats {
 public:
  // Starts the clock and the first training stretch's peak.
  explicit RunStats(const torch::Device& device) : device_(device), start_(Clock::now()) {
    reset_peak_memory(device_);
  }
  Clock::time_point start() const { return start_; }

  void start_step() { t0_ = Clock::now(); }
  // Ends the step begun by start_step. It waits for the device, so the time is the step's own
  // and not the launch's.
  StepResult end_step(const torch::Tensor& loss) {
    if (device_.is_cuda()) torch::cuda::synchronize();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0_).count();
    const StepResult r{ms, loss.item<double>(), AmpSession::last_step_skipped()};
    skipped_steps_ += r.skipped;
    step_ms_.push_back(r.ms);
    losses_.push_back(r.loss);
    return r;
  }

  template <typename Evaluate>
  void evaluation(Evaluate&& evaluate) {
    const auto e0 = Clock::now();
    peak_mb_ = std::max(peak_mb_, peak_memory_mb(device_));
    evaluate();
    reset_peak_memory(device_);
    eval_s_ += seconds_since(e0);
  }
  // After the last step: the training time and the last stretch's peak.
  void finish() {
    train_s_ = seconds_since(start_) - eval_s_;
    peak_mb_ = std::max(peak_mb_, peak_memory_mb(device_));
  }

  double train_s() const { return train_s_; }
  double peak_mb() const { return peak_mb_; }
  std::int64_t skipped_steps() const { return skipped_steps_; }
  std::string memory_kind() const {
    return device_.is_cuda() ? "cuda_peak_allocated" : "cpu_peak_rss";
  }
  // Steady state: the first 5 steps (allocator and kernel warm-up) are left out when there are
  // more than 10.
  double median_step_ms() const {
    return median(
        std::vector<double>(step_ms_.begin() + (step_ms_.size() > 10 ? 5 : 0), step_ms_.end()));
  }
  // The mean of the last (up to) 20 finite losses: one step's loss is too noisy to compare.
  double mean_recent_loss() const {
    double sum = 0;
    int n = 0;
    for (auto it = losses_.rbegin(); it != losses_.rend() && n < 20; ++it)
      if (std::isfinite(*it)) sum += *it, ++n;
    return n ? sum / n : std::nan("");
  }

 private:
  torch::Device device_;
  Clock::time_point start_, t0_;
  std::vector<double> step_ms_, losses_;
  std::int64_t skipped_steps_ = 0;
  double eval_s_ = 0, peak_mb_ = 0, train_s_ = 0;
};

// The stderr progress line with rate and ETA, at most 5 times a second and at the last step. Only
// on a terminal, unless OPTAMP_PROGRESS=1/0 forces it (ab_test.sh: 1 when its stderr is a TTY).
class Progress {
 public:
  Progress(std::string opt_level, std::int64_t total, Clock::time_point start)
      : opt_level_(std::move(opt_level)), total_(total), start_(start), last_(start) {
    const char* force = std::getenv("OPTAMP_PROGRESS");
    tty_ = force && *force ? std::string(force) == "1" : isatty(STDERR_FILENO) != 0;
  }
  // After step `step` (0-based).
  void show(std::int64_t step, double loss, double scale) {
    const auto now = Clock::now();
    if (!tty_ || !(now - last_ > std::chrono::milliseconds(200) || step + 1 == total_)) return;
    last_ = now;
    const double rate = (step + 1) / std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "\r[%s] step %lld/%lld  loss %.4f  scale %g  %.1f it/s  ETA %s   ",
                 opt_level_.c_str(), static_cast<long long>(step + 1),
                 static_cast<long long>(total_), loss, scale, rate,
                 fmt_duration((total_ - step - 1) / rate).c_str());
    if (step + 1 == total_) std::fprintf(stderr, "\n");
  }

 private:
  std::string opt_level_;
  std::int64_t total_;
  Clock::time_point start_, last_;
  bool tty_ = false;
};

// The value of the flag at argv[i] on a `--flag value ...` command line. -h/--help there prints
// the usage and exits 0; a flag without a value is a bad argument.
inline std::string flag_value(int argc, char** argv, int i, const char* usage) {
  const std::string flag = argv[i];
  if (flag == "-h" || flag == "--help") {
    std::cout << usage;
    std::exit(0);
  }
  if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
  return argv[i + 1];
}

// A user-facing message: c10 errors carry a C++ backtrace that says nothing to a user.
inline const char* message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

// main() of a trainer. Exit status: 2 when `parse` throws (a bad argument: the message and the
// usage), 3 when `run` throws UnsupportedOptLevel, 1 when it throws anything else, else run's.
inline int run_main(const char* program, const char* usage, const std::function<void()>& parse,
                    const std::function<int()>& run) {
  try {
    parse();
  } catch (const std::exception& e) {
    std::cerr << program << ": " << message_of(e) << "\n" << usage;
    return 2;
  }
  try {
    return run();
  } catch (const UnsupportedOptLevel& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << program << ": " << message_of(e) << "\n";
  }
  return 1;
}

}  // namespace trainer_common
