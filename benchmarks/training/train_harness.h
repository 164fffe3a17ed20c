#pragma once
// Training-step throughput harness shared by bench_train_resnet50 and bench_train_gpt2: plain
// executables (no Google Benchmark), so they build on the GPU machine.
//
// For each round, every configuration (in an order rotated by one each round) builds a fresh
// model from the same seed, runs --warmup steps, then --steps timed steps (each step ends with a
// device synchronize), records the median step time and the peak memory, and tears down. The
// report gives per configuration the median over rounds, and the ratios to native AMP computed
// round by round (same process, adjacent in time) and then the median of those ratios.
//
// Configurations:
//   O0, O0_tf32       amp::initialize(..., "O0"), TF32 off / on (cuBLAS + cuDNN)
//   O1 .. O5          amp::initialize(..., "On") + amp::scale_loss
//   O1_torch .. O5_torch  the same with op_lists torch (torch.autocast's op lists)
//   O0_nocheck, O3_nocheck .. O5_nocheck  a fixed-scale level with overflow_check=false (Apex's
//                     behaviour and native bf16's: no inf/NaN check, so no sync per step)
//   O2_graph, O5_graph    the O2/O5 step captured once in a CUDA graph (at::cuda::CUDAGraph,
//                     docs/loss_scaling.md's recipe) and replayed: CUDA and --fused only
//   native            at::autocast (fp16) around forward+loss + a hand-written dynamic loss scaler
//                     doing what torch.amp.GradScaler does (fused unscale/check,
//                     _amp_update_scale_, one found_inf.item() per step, step skipped on overflow;
//                     with --fused, GradScaler's protocol for fused optimizers: the flag goes to
//                     the optimizer, no item())
// --fused: the workload's optimizer skips on the device (amp::FusedAdamW for GPT-2, amp::FusedSGD
// for ResNet-50), so optamp's steps and native's make no sync.
//   native_bf16       at::autocast (bf16), no scaler
//   native_again      native once more: the ratio native_again / native measured in the same
//                     run is the benchmark's own noise, against which the other ratios are read
// Peak memory: peak allocated bytes during the timed steps, the CUDA caching allocator's count on
// CUDA, the same count by a wrapper over torch's CPU allocator on the CPU (CountingCpuAllocator).
// Device->host syncs per step (CUDA only): counted over 3 extra steps with
// c10::cuda sync-debug mode "warn" and a counting warning handler on the calling thread.

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>
#include <optamp/amp.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/version.h>

#ifdef OPTAMP_BENCH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace bench {

// A model + optimizer + synthetic batch. Subclasses parse their own flags.
class Workload {
 public:
  virtual ~Workload() = default;
  virtual std::string name() const = 0;
  virtual std::string describe() const = 0;
  // Returns true when the flag was one of the workload's.
  virtual bool parse_flag(const std::string& flag, const std::string& value) = 0;
  virtual void small() = 0;  // the CPU smoke-test sizes
  virtual std::string usage() const = 0;
  virtual std::int64_t samples_per_step() const = 0;
  // Builds the model (seeded by the caller) on `device`, its optimizer and a fixed batch.
  virtual void build(const torch::Device& device) = 0;
  virtual std::shared_ptr<torch::nn::Module> module() = 0;
  // --fused: build an optimizer that skips on the device where the workload has one.
  void set_fused(bool fused) { fused_ = fused; }
  bool fused() const { return fused_; }
  virtual torch::optim::Optimizer& optimizer() = 0;
  virtual torch::Tensor loss() = 0;  // forward + loss on the fixed batch
  virtual void destroy() = 0;

 protected:
  bool fused_ = false;
};

struct HarnessArgs {
  std::string device;  // default: cuda when available
  std::vector<std::string> configs{"native", "O0", "O0_tf32", "O1",         "O2",
                                   "O3",     "O4", "O5",      "native_bf16"};
  int warmup = 5, steps = 20, rounds = 3, threads = 0;
  bool fused = false;
  bool kernel_time = false;  // after the rounds, profile_steps more steps of each under Kineto
  int profile_steps = 5;
  std::string json;
};

inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// RAII: native autocast for one device type and dtype (what torch.autocast does in Python).
class NativeAutocast {
 public:
  NativeAutocast(c10::DeviceType type, c10::ScalarType dtype)
      : type_(type),
        prev_enabled_(at::autocast::is_autocast_enabled(type)),
        prev_dtype_(at::autocast::get_autocast_dtype(type)) {
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::increment_nesting();
  }
  ~NativeAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, prev_enabled_);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
  }
  NativeAutocast(const NativeAutocast&) = delete;
  NativeAutocast& operator=(const NativeAutocast&) = delete;

 private:
  c10::DeviceType type_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
};

// The hand-written equivalent of torch.amp.GradScaler (init 2^16, growth 2 every 2000 steps,
// backoff 0.5): device-side scale, fused unscale + check, one found_inf.item() per step.
class HandScaler {
 public:
  explicit HandScaler(const torch::Device& device)
      : scale_(torch::full({}, 65536.0, torch::dtype(torch::kFloat).device(device))),
        growth_(torch::zeros({}, torch::dtype(torch::kInt).device(device))),
        found_inf_(torch::zeros({}, torch::dtype(torch::kFloat).device(device))) {}
  torch::Tensor scale(const torch::Tensor& loss) { return loss.to(torch::kFloat) * scale_; }
  // Unscales the grads, steps the optimizer unless they overflowed, updates the scale.
  bool unscale_and_step(torch::optim::Optimizer& opt) {
    std::vector<torch::Tensor> grads;
    for (const auto& group : opt.param_groups())
      for (const auto& p : group.params())
        if (p.grad().defined()) grads.push_back(p.grad());
    found_inf_.zero_();
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
    bool skip = false;
    if (auto* device_skipping = dynamic_cast<amp::DeviceSkippingOptimizer*>(&opt)) {
      // GradScaler with a fused optimizer: the flag goes to the kernel, nothing is read back.
      device_skipping->add_found_inf(found_inf_.clone());
      opt.step();
    } else {
      skip = found_inf_.item<float>() != 0.0f;  // the step's one device->host sync
      if (!skip) opt.step();
    }
    at::_amp_update_scale_(scale_, growth_, found_inf_, 2.0, 0.5, 2000);
    return skip;
  }

 private:
  torch::Tensor scale_, growth_, found_inf_;
};

inline bool is_optamp_config(const std::string& c) {
  return c.size() >= 2 && c[0] == 'O' && c[1] >= '0' && c[1] <= '5';
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

inline void set_tf32(bool on) {
  at::globalContext().setAllowTF32CuBLAS(on);
  at::globalContext().setAllowTF32CuDNN(on);
}

inline void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// CPU peak memory counted as the CUDA caching allocator counts it: bytes of live tensor storage,
// highest since the last reset. The process's RSS high-water mark, used before, also held what
// malloc kept after frees and could not be reset per configuration. Installed over torch's CPU
// allocator at the first CPU configuration; storage made before that is not counted.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& installed() {
    static CountingCpuAllocator* const self = [] {
      auto* counting = new CountingCpuAllocator(c10::GetCPUAllocator());
      c10::SetAllocator(c10::DeviceType::CPU, counting, /*priority=*/1);
      return counting;
    }();
    return *self;
  }

  // The data pointer is its own context, as torch's CPU allocator makes it, so that raw_allocate
  // (oneDNN's bf16 kernels) works: the size and the base deleter are looked up by the pointer.
  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    const c10::Device device = inner.device();
    const c10::DeleterFnPtr base_deleter = inner.get_deleter();
    TORCH_CHECK(
        base_->is_simple_data_ptr(inner),
        "CountingCpuAllocator: the CPU allocator it wraps returned a data pointer that is not "
        "its own context");
    void* data = inner.release_context();
    const std::lock_guard<std::mutex> lock(mutex_);
    held_[data] = {bytes, base_deleter};
    live_ += static_cast<std::int64_t>(bytes);
    peak_ = std::max(peak_, live_);
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  void reset_peak() {
    const std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }
  double peak_mb() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<double>(peak_) / (1 << 20);
  }

 private:
  struct Held {
    std::size_t bytes;
    c10::DeleterFnPtr base_deleter;
  };
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}
  static void release(void* data) {
    if (data == nullptr) return;
    CountingCpuAllocator& self = installed();
    c10::DeleterFnPtr base_deleter = nullptr;
    {
      const std::lock_guard<std::mutex> lock(self.mutex_);
      const auto it = self.held_.find(data);
      base_deleter = it->second.base_deleter;
      self.live_ -= static_cast<std::int64_t>(it->second.bytes);
      self.held_.erase(it);
    }
    if (base_deleter != nullptr) base_deleter(data);
  }

  c10::Allocator* const base_;
  std::mutex mutex_;
  std::unordered_map<void*, Held> held_;
  std::int64_t live_ = 0, peak_ = 0;
};

inline void reset_peak(const torch::Device& d) {
#ifdef OPTAMP_BENCH_CUDA
  if (d.is_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
  CountingCpuAllocator::installed().reset_peak();
}

inline double peak_mb(const torch::Device& d) {
#ifdef OPTAMP_BENCH_CUDA
  if (d.is_cuda())
    return static_cast<double>(
               c10::cuda::CUDACachingAllocator::getDeviceStats(d.index()).allocated_bytes[0].peak) /
           (1 << 20);
#endif
  return CountingCpuAllocator::installed().peak_mb();
}

#ifdef OPTAMP_BENCH_CUDA
// Counts "synchronizing CUDA operation" warnings raised on this thread.
class SyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos)
      ++count;
    else
      c10::WarningHandler::process(w);
  }
  int count = 0;
};
#endif

inline std::string fmt(const char* f, double v) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

// A JSON array of step times (finite, as steady_clock durations are), three decimals each.
inline std::string json_array(const std::vector<double>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i)
    out += (i == 0 ? "" : ",") + fmt("%.3f", values[i]);
  return out + "]";
}

struct RunResult {
  double median_ms = std::nan(""), peak_mb = std::nan(""), syncs_per_step = std::nan("");
  std::vector<double> step_ms;  // every timed step, for the JSON line
  std::int64_t skipped = 0;
  std::string error;
  // --kernel-time: device time per step of the profiled steps' kernels (CUDA), their number per
  // step (operators per step on the CPU), and the time per step of each kernel name (CUDA) or
  // operator name (CPU: inclusive, nested operators counted in each).
  double kernel_ms = std::nan(""), events_per_step = std::nan("");
  std::map<std::string, double> ms_by_name;
  // And the host: each operator's self time per step (its time less its nested operators'; the
  // profiler's own cost included, so read differences), as Python's kernel_profile reports it.
  std::map<std::string, double> host_ms_by_name;
};

// Self time per name of nested host events: on each thread an event's duration less that of the
// events directly inside it (intervals that nest, as RecordFunction scopes do).
struct HostEvent {
  std::uint64_t thread, start, end;
  std::string name;
};

inline std::map<std::string, double> self_ms_by_name(std::vector<HostEvent> events, int steps) {
  std::sort(events.begin(), events.end(), [](const HostEvent& a, const HostEvent& b) {
    return std::tie(a.thread, a.start, b.end) < std::tie(b.thread, b.start, a.end);
  });
  std::map<std::string, double> self;
  std::vector<const HostEvent*> open;  // the enclosing events of the current one, innermost last
  for (const auto& e : events) {
    while (!open.empty() && (open.back()->thread != e.thread || open.back()->end <= e.start)) {
      open.pop_back();
    }
    const double ms = static_cast<double>(e.end - e.start) / 1e6 / steps;
    self[e.name] += ms;
    if (!open.empty()) self[open.back()->name] -= ms;
    open.push_back(&e);
  }
  return self;
}

// `n` steps under the Kineto profiler (what torch.profiler records): on CUDA every device event
// (kernels, copies, memsets, also those a CUDA graph replays), on the CPU every operator.
inline void profile_steps(const std::function<void()>& step, const torch::Device& device, int n,
                          RunResult& r) {
  namespace impl = torch::profiler::impl;
  namespace profiler = torch::autograd::profiler;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(impl::ActivityType::CUDA);
  sync(device);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  for (int i = 0; i < n; ++i) step();
  sync(device);
  const auto result = profiler::disableProfiler();
  const c10::DeviceType wanted = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  double total_ms = 0;
  std::size_t events = 0;
  std::vector<HostEvent> host;
  for (const auto& e : result->events()) {
    // Operators only (libkineto::ActivityType::CPU_OP, 0): the CUDA runtime's calls are recorded
    // with other thread ids, so they would not nest inside the operators that made them.
    if (e.deviceType() == c10::DeviceType::CPU && e.activityType() == 0 &&
        e.endNs() >= e.startNs()) {
      host.push_back({e.startThreadId(), e.startNs(), e.endNs(), e.name()});
    }
    if (e.deviceType() != wanted) continue;
    const double ms = static_cast<double>(e.durationNs()) / 1e6 / n;
    r.ms_by_name[e.name()] += ms;
    total_ms += ms;
    ++events;
  }
  if (device.is_cuda()) r.kernel_ms = total_ms;  // CPU operators nest: their sum means nothing
  r.events_per_step = static_cast<double>(events) / n;
  r.host_ms_by_name = self_ms_by_name(std::move(host), n);
}

// A kernel's or operator's name without the qualifiers every kernel name repeats, so that a line's
// 110 characters reach the template arguments that say which op a generic kernel ran.
inline std::string short_name(std::string name) {
  for (const char* noise :
       {"void ", "at::native::", "(anonymous namespace)::", "amp::ops::detail::", "c10::"}) {
    const std::string n(noise);
    for (auto at = name.find(n); at != std::string::npos; at = name.find(n, at))
      name.erase(at, n.size());
  }
  return name.substr(0, 110);
}

// One line per optamp configuration in `profiled`: the six names of `by_name` whose time per step
// differs most from its native reference's (native_bf16 for O4/O5), after the sum of all of them.
inline void print_profile_differences(const std::map<std::string, RunResult>& profiled,
                                      const std::string& what,
                                      std::map<std::string, double> RunResult::*by_name,
                                      bool with_total) {
  for (const auto& [c, mine] : profiled) {
    if (!is_optamp_config(c)) continue;
    const std::string ref =
        (c.rfind("O4", 0) == 0 || c.rfind("O5", 0) == 0) ? "native_bf16" : "native";
    const auto theirs = profiled.find(ref);
    if (theirs == profiled.end()) continue;
    std::map<std::string, double> diff;
    double total = 0;
    for (const auto& [name, ms] : mine.*by_name) diff[name] += ms, total += ms;
    for (const auto& [name, ms] : theirs->second.*by_name) diff[name] -= ms, total -= ms;
    std::vector<std::pair<std::string, double>> worst(diff.begin(), diff.end());
    std::sort(worst.begin(), worst.end(),
              [](const auto& x, const auto& y) { return std::abs(x.second) > std::abs(y.second); });
    std::string line = what + " " + c + " vs " + ref + ":";
    if (with_total) line += fmt(" %+.2f ms in all;", total);
    for (std::size_t i = 0; i < worst.size() && i < 6; ++i)
      line += fmt(" %+.2f ms ", worst[i].second) + short_name(worst[i].first) + ";";
    line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

// O3 steps fp16 parameters directly: Adam/AdamW's default eps=1e-8 underflows in fp16 and the
// steps turn NaN (then skipped, which once made O3 look "1.82x native"). Raise eps to 1e-4, the
// smallest amp::initialize's O3 warning accepts.
inline void use_an_fp16_eps(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&group.options())) {
      o->eps(std::max(o->eps(), 1e-4));
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&group.options())) {
      o->eps(std::max(o->eps(), 1e-4));
    }
  }
}

// O2_graph / O5_graph: `eager` warmed up on a side stream, captured once (its zero_grad runs
// inside the capture, so backward makes the grads in the graph's memory and every replay writes
// them again), and the returned step replays the graph.
inline std::function<void()> captured(const std::function<void()>& eager,
                                      const torch::Device& device, const HarnessArgs& a) {
#ifdef OPTAMP_BENCH_CUDA
  if (device.is_cuda() && a.fused) {
    auto graph = std::make_shared<at::cuda::CUDAGraph>();
    sync(device);
    {
      const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device.index()));
      for (int i = 0; i < 3; ++i) eager();
      graph->capture_begin();
      eager();
      graph->capture_end();
    }
    sync(device);
    return [graph] { graph->replay(); };
  }
#endif
  (void)eager;
  throw std::invalid_argument("a _graph configuration needs a CUDA device and --fused (got " +
                              device.str() + (a.fused ? ", --fused)" : ", no --fused)"));
}

inline RunResult run_config(Workload& wl, const std::string& config, const torch::Device& device,
                            const HarnessArgs& a, bool profile = false) {
  RunResult r;
  if (!device.is_cuda()) CountingCpuAllocator::installed();  // before the model: count it too
  torch::manual_seed(0);
  set_tf32(config == "O0_tf32");
  wl.set_fused(a.fused);
  wl.build(device);
  auto& opt = wl.optimizer();
  const bool optamp = is_optamp_config(config);
  std::unique_ptr<HandScaler> scaler;
  std::function<void()> step;
  try {
    if (optamp) {
      const std::string level = config.substr(0, 2);
      if (level == "O3") use_an_fp16_eps(opt);
      amp::Options options;
      options.verbosity = 0;  // no properties report or overflow messages inside the timing
      // "O4_torch": the level with torch.autocast's op lists (op_lists="torch").
      if (ends_with(config, "_torch")) options.op_lists = amp::OpLists::kTorch;
      if (ends_with(config, "_nocheck")) options.overflow_check = false;
      amp::initialize(std::vector<amp::ModulePtr>{wl.module()},
                      std::vector<torch::optim::Optimizer*>{&opt}, std::string_view(level),
                      options);
      step = [&] {
        opt.zero_grad();
        const auto loss = wl.loss();
        {
          auto scaled = amp::scale_loss(loss, opt);
          scaled.backward();
        }
        opt.step();  // a no-op after an overflow (the guard or the fused kernel skips it)
      };
      if (ends_with(config, "_graph")) step = captured(step, device, a);
    } else if (config == "native" || config == "native_again") {
      scaler = std::make_unique<HandScaler>(device);
      step = [&] {
        opt.zero_grad();
        torch::Tensor loss;
        {
          NativeAutocast ac(device.type(), torch::kHalf);
          loss = wl.loss();
        }
        scaler->scale(loss).backward();
        r.skipped += scaler->unscale_and_step(opt);
      };
    } else if (config == "native_bf16") {
      step = [&] {
        opt.zero_grad();
        torch::Tensor loss;
        {
          NativeAutocast ac(device.type(), torch::kBFloat16);
          loss = wl.loss();
        }
        loss.backward();
        opt.step();
      };
    } else {
      throw std::invalid_argument("unknown configuration " + config);
    }
    for (int i = 0; i < a.warmup; ++i) step();
    sync(device);
    reset_peak(device);
    std::vector<double> ms;
    for (int i = 0; i < a.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      sync(device);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    r.peak_mb = peak_mb(device);
    r.median_ms = median(ms);
    r.step_ms = ms;
    // Read once, after the timed steps: reading it every step would wait for every step.
    if (optamp) r.skipped = amp::loss_scaler(0).skipped_steps();
#ifdef OPTAMP_BENCH_CUDA
    if (device.is_cuda()) {
      SyncCounter counter;
      {
        c10::WarningUtils::WarningHandlerGuard guard(&counter);
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
        for (int i = 0; i < 3; ++i) step();
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      }
      sync(device);
      r.syncs_per_step = counter.count / 3.0;
    }
#endif
    if (profile) profile_steps(step, device, a.profile_steps, r);
  } catch (const c10::NotImplementedError& e) {
    r.error = std::string("unsupported: ") + e.what_without_backtrace();
  } catch (const c10::Error& e) {
    r.error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  step = nullptr;  // a captured graph goes before the session and the model
  if (optamp) amp::reset();
  set_tf32(false);
  wl.destroy();
#ifdef OPTAMP_BENCH_CUDA
  // torch keeps a cuBLAS workspace per stream for the life of the process (64 MiB a stream on the
  // H200, judging by the growth), and each _graph configuration warms up on a pool stream of its
  // own: without this every later configuration's peak carried them (+128 MB per round in the
  // fourth GPU run).
  if (device.is_cuda()) at::cuda::clearCublasWorkspaces();
#endif
  return r;
}

// Set by SIGINT (gpu_check's time budget, a Ctrl-C): the run stops after the configuration it is
// in and reports its complete rounds (and what it profiled), then exits with 130. Without it the
// interrupt lost the whole run's report: the rounds' table is printed only at the end.
inline volatile std::sig_atomic_t g_interrupted = 0;
inline void note_interrupt(int) { g_interrupted = 1; }

// --kernel-time: after the rounds, each configuration once more with its steps profiled, as the
// Python benchmark's --kernel-time does: GPU kernel time per step beside the wall time, and per
// optamp configuration the kernels (on the CPU: operators) whose time differs most from its native
// reference's (native for fp16 levels, native_bf16 for O4/O5). Read differences, not absolutes:
// the profiler's own cost is in the wall time of these steps.
inline void profile_configs(Workload& wl, const torch::Device& device, const HarnessArgs& a,
                            std::map<std::string, std::vector<RunResult>>& results) {
  std::map<std::string, RunResult> profiled;
  for (const auto& c : a.configs) {
    if (g_interrupted) break;
    RunResult r = run_config(wl, c, device, a, /*profile=*/true);
    if (!r.error.empty()) continue;
    if (device.is_cuda()) {
      std::printf("profiled %-12s wall %.2f ms/step  GPU kernels %.2f ms/step  %.0f kernels/step\n",
                  c.c_str(), r.median_ms, r.kernel_ms, r.events_per_step);
    } else {
      std::printf("profiled %-12s wall %.2f ms/step  %.0f operators/step\n", c.c_str(), r.median_ms,
                  r.events_per_step);
    }
    for (auto& earlier : results[c]) earlier.kernel_ms = r.kernel_ms;
    profiled.emplace(c, std::move(r));
  }
  // Per optamp configuration, the names whose time per step differs most from its native
  // reference's: the kernels (CUDA; inclusive operators on the CPU), then the host operators' self
  // time ("host": where a host-bound step's time goes).
  const char* what = device.is_cuda() ? "kernels" : "operators";
  print_profile_differences(profiled, what, &RunResult::ms_by_name, device.is_cuda());
  print_profile_differences(profiled, "host", &RunResult::host_ms_by_name, /*with_total=*/true);
  std::fflush(stdout);
}

inline int harness_main(Workload& wl, int argc, char** argv) {
  HarnessArgs a;
  const std::string usage =
      "usage: " + wl.name() +
      " [--device cpu|cuda] [--configs native,O0,O0_tf32,O1,...,O5,native_bf16]\n"
      "         [--warmup N] [--steps N] [--rounds N] [--threads N] [--json FILE] [--small]\n"
      "         [--fused]   (an optimizer that skips on the device: no sync per step)\n"
      "         [--kernel-time [--profile-steps N]]   (after the rounds, N more steps of each\n"
      "                      configuration under the profiler: GPU kernel time per step and the\n"
      "                      kernels that differ most from native's; operators on the CPU)\n" +
      wl.usage();
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string f = argv[i];
      if (f == "-h" || f == "--help") {
        std::cout << usage;
        return 0;
      }
      if (f == "--small") {
        wl.small();
        continue;
      }
      if (f == "--fused") {
        a.fused = true;
        continue;
      }
      if (f == "--kernel-time") {
        a.kernel_time = true;
        continue;
      }
      if (i + 1 >= argc) throw std::invalid_argument(f + " needs a value");
      const std::string v = argv[++i];
      if (f == "--device")
        a.device = v;
      else if (f == "--configs")
        a.configs = split(v);
      else if (f == "--warmup")
        a.warmup = std::stoi(v);
      else if (f == "--steps")
        a.steps = std::stoi(v);
      else if (f == "--rounds")
        a.rounds = std::stoi(v);
      else if (f == "--threads")
        a.threads = std::stoi(v);
      else if (f == "--json")
        a.json = v;
      else if (f == "--profile-steps")
        a.profile_steps = std::stoi(v);
      else if (!wl.parse_flag(f, v))
        throw std::invalid_argument("unknown flag " + f);
    }
    if (a.steps < 1 || a.rounds < 1 || a.warmup < 0 || a.profile_steps < 1 || a.configs.empty())
      throw std::invalid_argument(
          "--steps >= 1, --rounds >= 1, --warmup >= 0, --profile-steps >= 1, --configs non-empty");
  } catch (const std::exception& e) {
    std::cerr << wl.name() << ": " << e.what() << "\n" << usage;
    return 2;
  }
  if (a.threads > 0) torch::set_num_threads(a.threads);
  wl.set_fused(a.fused);
  if (a.device.empty()) a.device = torch::cuda::is_available() ? "cuda" : "cpu";
  const torch::Device device = a.device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::kCPU;
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << wl.name() << ": --device cuda but no CUDA device is visible\n";
    return 1;
  }
#ifndef OPTAMP_BENCH_CUDA
  if (device.is_cuda())
    std::cerr << "warning: built without c10_cuda: no CUDA peak memory or sync counts\n";
#endif
  at::globalContext().setBenchmarkCuDNN(true);
  std::printf("%s: %s | device %s | torch %s | threads %d | warmup %d, steps %d, rounds %d\n",
              wl.name().c_str(), wl.describe().c_str(), a.device.c_str(), TORCH_VERSION,
              torch::get_num_threads(), a.warmup, a.steps, a.rounds);
  std::ofstream json;
  if (!a.json.empty()) json.open(a.json);

  const std::size_t n = a.configs.size();
  std::map<std::string, std::vector<RunResult>> results;
  std::signal(SIGINT, note_interrupt);
  int rounds_done = 0;
  for (int round = 0; round < a.rounds && !g_interrupted; ++round) {
    std::size_t ran = 0;
    for (std::size_t k = 0; k < n && !g_interrupted; ++k, ++ran) {
      const std::string& c = a.configs[(k + round) % n];
      RunResult r = run_config(wl, c, device, a);
      std::printf(
          "round %d %-12s %s\n", round + 1, c.c_str(),
          r.error.empty()
              ? (fmt("%.2f ms/step", r.median_ms) + "  peak " + fmt("%.0f MB", r.peak_mb)).c_str()
              : ("error: " + r.error).c_str());
      std::fflush(stdout);
      if (json.is_open())
        json << "{\"program\":\"" << wl.name() << "\",\"round\":" << round + 1 << ",\"config\":\""
             << c
             << "\",\"median_ms\":"
             // as step_ms writes each step (%.3f): the stream's 6 digits cut a median above a
             // second to 2 decimals, and it no longer equalled its step's own value
             << (std::isfinite(r.median_ms) ? fmt("%.3f", r.median_ms) : "-1")
             << ",\"peak_mb\":" << (std::isfinite(r.peak_mb) ? r.peak_mb : -1)
             << ",\"syncs_per_step\":" << (std::isfinite(r.syncs_per_step) ? r.syncs_per_step : -1)
             << ",\"skipped\":" << r.skipped << ",\"ok\":" << (r.error.empty() ? "true" : "false")
             << ",\"step_ms\":" << json_array(r.step_ms) << "}\n";
      results[c].push_back(std::move(r));
    }
    if (ran == n) ++rounds_done;  // every configuration ran (an interrupt may come after the last)
  }
  if (g_interrupted) {  // a round cut short compares configurations that did not all run
    for (auto& [c, runs] : results) runs.resize(std::min<std::size_t>(runs.size(), rounds_done));
    std::printf("interrupted: the report covers the %d complete rounds of %d\n", rounds_done,
                a.rounds);
  }

  if (a.kernel_time) profile_configs(wl, device, a, results);

  // Per round ratios (throughput = inverse time) against a reference, then their median and
  // range: configurations run adjacent in time, so a ratio is steadier than either time.
  auto ratios_to = [&](const std::string& c, const std::string& ref) {
    std::vector<double> v;
    // Either configuration may not have run (a target names configurations --configs left out).
    if (!results.count(c) || !results.count(ref)) return v;
    for (int i = 0; i < rounds_done; ++i) {
      const double x = results[c][i].median_ms, y = results[ref][i].median_ms;
      if (std::isfinite(x) && std::isfinite(y)) v.push_back(y / x);
    }
    return v;
  };
  auto ratio_to = [&](const std::string& c, const std::string& ref) {
    return median(ratios_to(c, ref));
  };
  auto ratio_cell = [&](const std::string& c, const std::string& ref) {
    const auto v = ratios_to(c, ref);
    if (v.empty()) return std::string("-");
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return fmt("%.3f", median(v)) + fmt(" (%.3f", *lo) + fmt("-%.3f)", *hi);
  };
  auto med = [&](const std::string& c, double RunResult::*field) {
    std::vector<double> v;
    for (const auto& r : results[c])
      if (std::isfinite(r.*field)) v.push_back(r.*field);
    return median(v);
  };
  std::printf(
      "\n| config | median ms/step | samples/s | peak MB | syncs/step | throughput vs native "
      "(range over rounds) | vs native_bf16 |\n|---|---|---|---|---|---|---|\n");
  for (const auto& c : a.configs) {
    const double ms = med(c, &RunResult::median_ms);
    std::printf("| %s | %s | %s | %s | %s | %s | %s |\n", c.c_str(), fmt("%.2f", ms).c_str(),
                fmt("%.1f", wl.samples_per_step() * 1000.0 / ms).c_str(),
                fmt("%.0f", med(c, &RunResult::peak_mb)).c_str(),
                fmt("%.2f", med(c, &RunResult::syncs_per_step)).c_str(),
                ratio_cell(c, "native").c_str(), ratio_cell(c, "native_bf16").c_str());
  }
  auto check = [&](const char* what, double v, double target, bool ge = true) {
    if (!std::isfinite(v)) return;
    std::printf("target %-40s %.3f (%s %.2f) %s\n", what, v, ge ? ">=" : "<=", target,
                (ge ? v >= target : v <= target) ? "MET" : "NOT MET");
  };
  std::printf("\n");
  if (results.count("native_again"))
    std::printf("noise  native_again / native                    %s\n",
                ratio_cell("native_again", "native").c_str());
  // The speed targets (docs/benchmarks.md): faster than native AMP at every level.
  check("O1 throughput / native", ratio_to("O1", "native"), 1.0);
  check("O2 throughput / native", ratio_to("O2", "native"), 1.05);
  check("O4 throughput / native_bf16", ratio_to("O4", "native_bf16"), 1.0);
  check("O5 throughput / native_bf16", ratio_to("O5", "native_bf16"), 1.0);
  check("O2 throughput / O3", ratio_to("O2", "O3"), 0.95);
  // op_lists "torch": native autocast's casts, so its step time should be native's (<= 1.02x).
  check("O1_torch throughput / native", ratio_to("O1_torch", "native"), 1.0 / 1.02);
  check("O4_torch throughput / native_bf16", ratio_to("O4_torch", "native_bf16"), 1.0 / 1.02);
  for (const char* c : {"O2_graph", "O5_graph"}) {
    // A captured step is as fast as the GPU allows when its wall time is its kernel time.
    const std::string what = std::string(c) + " wall / GPU kernel time";
    check(what.c_str(), med(c, &RunResult::median_ms) / med(c, &RunResult::kernel_ms), 1.05, false);
  }
  if (device.is_cuda()) {
    check("O2 peak memory / native",
          med("O2", &RunResult::peak_mb) / med("native", &RunResult::peak_mb), 1.0, false);
    // An optimizer that skips on the device leaves nothing to read back: no sync at all.
    const double most_syncs = a.fused ? 0.0 : 1.0;
    for (const auto& c : a.configs) {
      const std::string what = c + " syncs per step";
      check(what.c_str(), med(c, &RunResult::syncs_per_step), most_syncs, false);
    }
  }
  std::fflush(stdout);
  return g_interrupted ? 130 : 0;  // 128 + SIGINT, as a shell reports a process it stopped
}

}  // namespace bench
