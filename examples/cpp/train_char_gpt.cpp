// Trains a small byte-level GPT on the Python standard library's sources at one optamp opt level
// and reports bits per character on held-out stdlib files: the compute-bound A/B workload
// (docs/char_gpt.md). The Python twin is examples/python/train_char_gpt.py (same model, data,
// batches, schedule and flags; the same losses for the same seed).
//
//   train_char_gpt --opt-level O2 --steps 300 [--preset tiny|gpu|test] [--device cuda]
//
// It speaks the A/B protocol (optamp/ab.h): the opt level and seed come from --opt-level/--seed,
// else OPTAMP_OPT_LEVEL/OPTAMP_SEED, else O0 and 0; with OPTAMP_AB_METRICS set it writes one JSON
// line per optimizer step (step, loss, step_ms, loss_scale, skipped, lr), one per evaluation
// (step, val_bpc) and a final one without step (val_bpc, train_bpc, tokens_per_s, sizes, ...).
// stdout gets Apex's properties report (printed once) and a one-line summary; stderr Apex's
// "Gradient overflow" lines and, on a terminal, a progress line (OPTAMP_PROGRESS=1/0 forces it).
// Exit status: 0 ok, 2 bad arguments, 3 the opt level is not supported by this build/device
// (amp::initialize threw c10::NotImplementedError), 1 otherwise.

#include <ATen/CPUGeneratorImpl.h>
#include <optamp/amp.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/version.h>
#include <unistd.h>

#ifdef OPTAMP_EXAMPLE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "char_gpt.h"

namespace {

// ---- optamp integration: the only code in this program that touches the amp API -------------
struct AmpSession {
  amp::Handle handle;
  template <typename Model>
  AmpSession(Model& model, torch::optim::Optimizer& optimizer, const std::string& level)
      : handle(amp::initialize(model, optimizer, level, amp::Options{})) {
    std::cout << handle.describe() << std::flush;  // Apex's properties report, once
  }
  // backward through the scaled loss; on overflow the guard makes optimizer.step() a no-op.
  static void backward(const torch::Tensor& loss, torch::optim::Optimizer& optimizer) {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  static double loss_scale() { return amp::loss_scaler(0).loss_scale(); }
  static bool last_step_skipped() { return amp::loss_scaler(0).last_step_skipped(); }
  static void reset() { amp::reset(); }
};
// ---- end of optamp integration --------------------------------------------------------------

struct Args {
  std::string opt_level;   // empty: amp::ab::opt_level("O0")
  std::int64_t seed = -1;  // -1: amp::ab::seed(0)
  std::string preset;      // empty: tiny on cpu, gpu on cuda
  std::int64_t steps = 0;  // 0: the preset's
  std::int64_t batch_size = 0, seq_len = 0, d_model = 0, layers = 0, heads = 0;  // 0: preset's
  double lr = 0;                                                                 // 0: the preset's
  std::int64_t warmup = -1;   // -1: min(100, steps / 10)
  double min_lr_ratio = 0.1;  // the cosine decays to lr * this
  double weight_decay = 0.1;  // on matrices and embeddings (dim >= 2), not biases or norms
  double clip = 1.0;          // max global gradient norm; 0: no clipping
  double eps = 1e-8;          // AdamW's epsilon (O3 steps fp16 weights: needs >= 1e-4)
  std::string device = "cpu";
  int threads = 0;               // 0: LibTorch's default
  std::string data;              // empty: the newest /usr/lib/python3.N with the files
  std::int64_t eval_every = -1;  // -1: steps / 4; 0: only at the end
  std::int64_t eval_bytes = -1;  // -1: the preset's; 0: the whole held-out text
};

const char* kUsage =
    "usage: train_char_gpt [--opt-level O0..O5] [--seed N] [--preset tiny|gpu|test] [--steps N]\n"
    "         [--batch-size N] [--seq-len N] [--d-model N] [--layers N] [--heads N] [--lr X]\n"
    "         [--warmup N] [--weight-decay X] [--eps X] [--clip X] [--device cpu|cuda]\n"
    "         [--threads N] [--data DIR] [--eval-every N] [--eval-bytes N]\n";

std::int64_t parse_int(const std::string& flag, const std::string& v, std::int64_t min) {
  std::size_t used = 0;
  std::int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || x < min)
    throw std::invalid_argument(flag + " takes an integer >= " + std::to_string(min) + ", got \"" +
                                v + "\"");
  return x;
}

double parse_double(const std::string& flag, const std::string& v, double min, bool strict) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || !std::isfinite(x) || (strict ? x <= min : x < min))
    throw std::invalid_argument(flag + " takes a number " + (strict ? "> " : ">= ") +
                                std::to_string(static_cast<long long>(min)) + ", got \"" + v +
                                "\"");
  return x;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--opt-level") {
      amp::parse_opt_level(v);  // throws, listing the valid levels
      a.opt_level = v;
    } else if (flag == "--seed") {
      a.seed = parse_int(flag, v, 0);
    } else if (flag == "--preset") {
      char_gpt::Config unused{};
      if (!char_gpt::preset_config(v, &unused))
        throw std::invalid_argument("--preset must be tiny, gpu or test, got \"" + v + "\"");
      a.preset = v;
    } else if (flag == "--steps") {
      a.steps = parse_int(flag, v, 1);
    } else if (flag == "--batch-size") {
      a.batch_size = parse_int(flag, v, 1);
    } else if (flag == "--seq-len") {
      a.seq_len = parse_int(flag, v, 1);
    } else if (flag == "--d-model") {
      a.d_model = parse_int(flag, v, 1);
    } else if (flag == "--layers") {
      a.layers = parse_int(flag, v, 1);
    } else if (flag == "--heads") {
      a.heads = parse_int(flag, v, 1);
    } else if (flag == "--lr") {
      a.lr = parse_double(flag, v, 0, true);
    } else if (flag == "--warmup") {
      a.warmup = parse_int(flag, v, 0);
    } else if (flag == "--weight-decay") {
      a.weight_decay = parse_double(flag, v, 0, false);
    } else if (flag == "--eps") {
      a.eps = parse_double(flag, v, 0, true);
    } else if (flag == "--clip") {
      a.clip = parse_double(flag, v, 0, false);
    } else if (flag == "--device") {
      if (v != "cpu" && v != "cuda")
        throw std::invalid_argument("--device must be cpu or cuda, got \"" + v + "\"");
      a.device = v;
    } else if (flag == "--threads") {
      a.threads = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--data") {
      a.data = v;
    } else if (flag == "--eval-every") {
      a.eval_every = parse_int(flag, v, 0);
    } else if (flag == "--eval-bytes") {
      a.eval_bytes = parse_int(flag, v, 0);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  // The environment is read only where no flag was given; a bad value is a bad argument too.
  if (a.opt_level.empty()) a.opt_level = amp::ab::opt_level("O0");
  if (a.seed < 0) a.seed = amp::ab::seed(0);
  return a;
}

// The run's sizes and schedule: the preset's, overridden by single flags.
struct Plan {
  std::string preset;
  char_gpt::Config c;
  std::int64_t steps, warmup, eval_every, eval_bytes;
};

Plan make_plan(const Args& a) {
  Plan p;
  p.preset = !a.preset.empty() ? a.preset : (a.device == "cuda" ? "gpu" : "tiny");
  char_gpt::preset_config(p.preset, &p.c);
  if (a.batch_size) p.c.batch_size = a.batch_size;
  if (a.seq_len) p.c.seq_len = a.seq_len;
  if (a.d_model) p.c.d_model = a.d_model;
  if (a.layers) p.c.n_layer = a.layers;
  if (a.heads) p.c.n_head = a.heads;
  if (a.lr > 0) p.c.lr = a.lr;
  if (p.c.d_model % p.c.n_head != 0)
    throw std::invalid_argument("--d-model (" + std::to_string(p.c.d_model) +
                                ") must be a multiple of --heads (" + std::to_string(p.c.n_head) +
                                ")");
  p.steps = a.steps ? a.steps : char_gpt::preset_steps(p.preset);
  p.warmup =
      a.warmup >= 0 ? std::min(a.warmup, p.steps) : std::min<std::int64_t>(100, p.steps / 10);
  p.eval_every = a.eval_every >= 0 ? a.eval_every : std::max<std::int64_t>(1, p.steps / 4);
  p.eval_bytes = a.eval_bytes >= 0 ? a.eval_bytes : char_gpt::preset_eval_bytes(p.preset);
  return p;
}

// Linear warmup over `warmup` steps, then cosine decay to lr * min_lr_ratio at the last step.
// `step` is 0-based. The Python twin computes the same doubles.
double lr_at(const Args& a, const Plan& p, std::int64_t step) {
  const double lr = p.c.lr, min_lr = lr * a.min_lr_ratio;
  if (step < p.warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(p.warmup);
  const double progress = static_cast<double>(step - p.warmup) /
                          static_cast<double>(std::max<std::int64_t>(1, p.steps - p.warmup));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::acos(-1.0) * progress));
}

void reset_peak_memory(const torch::Device& device) {
#ifdef OPTAMP_EXAMPLE_CUDA
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
  std::ofstream("/proc/self/clear_refs") << "5";
}

// CPU: peak RSS; CUDA: the caching allocator's peak allocated bytes.
double peak_memory_mb(const torch::Device& device) {
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

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmt_duration(double s) {
  char buf[32];
  const long t = std::lround(std::max(0.0, s));
  std::snprintf(buf, sizeof(buf), "%ld:%02ld", t / 60, t % 60);
  return buf;
}

constexpr std::int64_t kEvalBatch = 64;  // held-out windows per forward pass

// Bits per character on the held-out windows: the mean cross-entropy (nats) of every predicted
// byte / ln 2. Eval mode under no_grad, where optamp does not cast (the fp32 weights), so every
// level is measured the same way. Leaves the model in train mode.
double evaluate(char_gpt::GPT& model, const torch::Tensor& val,
                const std::vector<std::int64_t>& starts, std::int64_t seq_len,
                const torch::Device& device) {
  model->eval();
  double nats = 0;
  {
    torch::NoGradGuard no_grad;
    const auto all = torch::tensor(starts, torch::kLong);
    const auto offsets = torch::arange(seq_len + 1, torch::kLong);
    const std::int64_t n = all.size(0);
    for (std::int64_t i = 0; i < n; i += kEvalBatch) {
      const auto s = all.slice(0, i, std::min(n, i + kEvalBatch));
      const auto idx = s.unsqueeze(1) + offsets;
      const auto w =
          val.index_select(0, idx.flatten()).view({s.size(0), seq_len + 1}).to(torch::kLong);
      const auto x = w.slice(1, 0, seq_len).contiguous().to(device);
      const auto y = w.slice(1, 1, seq_len + 1).contiguous().to(device);
      const auto logits = model->forward(x).to(torch::kFloat);
      nats += torch::nn::functional::cross_entropy(
                  logits.view({-1, char_gpt::kVocab}), y.view({-1}),
                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
    }
  }
  model->train();
  return nats / static_cast<double>(starts.size() * seq_len) / std::log(2.0);
}

int run(const Args& args) {
  const Plan plan = make_plan(args);
  const char_gpt::Config& c = plan.c;
  if (args.threads > 0) torch::set_num_threads(args.threads);
  if (args.device == "cuda" && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda: no CUDA device is visible to LibTorch");
  const torch::Device device(args.device == "cuda" ? torch::Device(torch::kCUDA, 0)
                                                   : torch::Device(torch::kCPU));

  const std::string data_dir = !args.data.empty() ? args.data : char_gpt::default_data_dir();
  if (data_dir.empty())
    throw std::runtime_error(
        "no /usr/lib/python3.N holds the stdlib files of the training text; pass --data DIR "
        "(a CPython 3.9-3.13 standard library directory, e.g. python3 -c 'import sysconfig; "
        "print(sysconfig.get_paths()[\"stdlib\"])')");
  const torch::Tensor train = char_gpt::load_text(data_dir, char_gpt::train_files());
  const torch::Tensor val = char_gpt::load_text(data_dir, char_gpt::val_files());
  if (train.size(0) <= c.seq_len + 1)
    throw std::invalid_argument("--seq-len " + std::to_string(c.seq_len) +
                                " is longer than the training text");
  const std::vector<std::int64_t> starts =
      char_gpt::eval_starts(val.size(0), c.seq_len, plan.eval_bytes);

  torch::manual_seed(static_cast<std::uint64_t>(args.seed));
  char_gpt::GPT model(c);
  model->to(device);
  std::int64_t n_params = 0;
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->parameters()) {
    n_params += p.numel();
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  const auto options = torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).eps(args.eps);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay,
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(options).weight_decay(args.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0.0)));
  torch::optim::AdamW optimizer(std::move(groups), options);

  std::unique_ptr<AmpSession> amp_session;
  try {
    amp_session = std::make_unique<AmpSession>(model, optimizer, args.opt_level);
  } catch (const c10::NotImplementedError& e) {
    std::cerr << "train_char_gpt: opt level " << args.opt_level
              << " unsupported: " << e.what_without_backtrace() << "\n";
    return 3;
  }

  at::Generator gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(args.seed));
  const char* force = std::getenv("OPTAMP_PROGRESS");
  const bool tty = force && *force ? std::string(force) == "1" : isatty(STDERR_FILENO) != 0;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto last_progress = start;
  std::vector<double> step_ms, losses;
  std::int64_t skipped_steps = 0;
  double eval_s = 0, peak_mb = 0, val_bpc = std::nan("");

  model->train();
  reset_peak_memory(device);
  for (std::int64_t step = 0; step < plan.steps; ++step) {
    const auto [x, y] = char_gpt::get_batch(train, c.batch_size, c.seq_len, gen, device);
    const double scale = AmpSession::loss_scale();
    const double lr = lr_at(args, plan, step);
    for (auto& group : optimizer.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);

    const auto t0 = Clock::now();
    optimizer.zero_grad();
    const torch::Tensor logits = model->forward(x);
    const torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.view({-1, char_gpt::kVocab}), y.view({-1}));
    AmpSession::backward(loss, optimizer);
    if (args.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), args.clip);
    optimizer.step();
    if (device.is_cuda()) torch::cuda::synchronize();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

    const double loss_value = loss.item<double>();
    const bool skipped = AmpSession::last_step_skipped();
    skipped_steps += skipped;
    step_ms.push_back(ms);
    losses.push_back(loss_value);
    amp::ab::report({{"step", step + 1},
                     {"loss", loss_value},
                     {"step_ms", ms},
                     {"loss_scale", scale},
                     {"skipped", skipped},
                     {"lr", lr}});
    const auto now = Clock::now();
    if (tty && (now - last_progress > std::chrono::milliseconds(200) || step + 1 == plan.steps)) {
      last_progress = now;
      const double rate = (step + 1) / std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "\r[%s] step %lld/%lld  loss %.4f  scale %g  %.1f it/s  ETA %s   ",
                   args.opt_level.c_str(), static_cast<long long>(step + 1),
                   static_cast<long long>(plan.steps), loss_value, scale, rate,
                   fmt_duration((plan.steps - step - 1) / rate).c_str());
      if (step + 1 == plan.steps) std::fprintf(stderr, "\n");
    }
    const bool last = step + 1 == plan.steps;
    if (last || (plan.eval_every > 0 && (step + 1) % plan.eval_every == 0)) {
      const auto e0 = Clock::now();
      peak_mb = std::max(peak_mb, peak_memory_mb(device));
      val_bpc = evaluate(model, val, starts, c.seq_len, device);
      amp::ab::report({{"step", step + 1}, {"val_bpc", val_bpc}});
      reset_peak_memory(device);
      eval_s += std::chrono::duration<double>(Clock::now() - e0).count();
    }
  }
  const double train_s = std::chrono::duration<double>(Clock::now() - start).count() - eval_s;
  peak_mb = std::max(peak_mb, peak_memory_mb(device));
  const double final_scale = AmpSession::loss_scale();
  AmpSession::reset();

  // Steady state: the first 5 steps (allocator and kernel warm-up) are left out when there are
  // more than 10. train_bpc: the mean of the last (up to) 20 finite losses / ln 2.
  const std::vector<double> steady(step_ms.begin() + (step_ms.size() > 10 ? 5 : 0), step_ms.end());
  const double median_ms = median(steady);
  double tail_sum = 0;
  int tail_n = 0;
  for (auto it = losses.rbegin(); it != losses.rend() && tail_n < 20; ++it)
    if (std::isfinite(*it)) tail_sum += *it, ++tail_n;
  const double train_bpc = tail_n ? tail_sum / tail_n / std::log(2.0) : std::nan("");
  const double tokens_per_s = static_cast<double>(c.batch_size * c.seq_len) / (median_ms / 1000.0);
  const std::string mem_kind = device.is_cuda() ? "cuda_peak_allocated" : "cpu_peak_rss";

  amp::ab::report({{"val_bpc", val_bpc},
                   {"train_bpc", train_bpc},
                   {"tokens_per_s", tokens_per_s},
                   {"median_step_ms", median_ms},
                   {"skipped_steps", skipped_steps},
                   {"final_loss_scale", final_scale},
                   {"train_time_s", train_s},
                   {"peak_memory_mb", peak_mb},
                   {"peak_memory_kind", mem_kind},
                   {"opt_level", args.opt_level},
                   {"seed", args.seed},
                   {"steps", plan.steps},
                   {"device", args.device},
                   {"preset", plan.preset},
                   {"batch_size", c.batch_size},
                   {"seq_len", c.seq_len},
                   {"d_model", c.d_model},
                   {"layers", c.n_layer},
                   {"heads", c.n_head},
                   {"params", n_params},
                   {"train_bytes", train.size(0)},
                   {"val_bytes", val.size(0)},
                   {"eval_windows", static_cast<std::int64_t>(starts.size())},
                   {"threads", torch::get_num_threads()},
                   {"language", "c++"},
                   {"torch", TORCH_VERSION}});
  std::printf(
      "summary: %s %s %s seed %lld | val bpc %.4f | train bpc %.4f | median step %.2f ms | "
      "%.0f tokens/s | peak memory %.1f MB (%s) | skipped %lld | loss scale %g | %.1f s\n",
      args.opt_level.c_str(), args.device.c_str(), plan.preset.c_str(),
      static_cast<long long>(args.seed), val_bpc, train_bpc, median_ms, tokens_per_s, peak_mb,
      mem_kind.c_str(), static_cast<long long>(skipped_steps), final_scale, train_s);
  return 0;
}

// A user-facing message: c10 errors carry a C++ backtrace that says nothing to a user.
const char* message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
    make_plan(args);  // size checks (--d-model / --heads) are argument errors too
  } catch (const std::exception& e) {
    std::cerr << "train_char_gpt: " << message_of(e) << "\n" << kUsage;
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::cerr << "train_char_gpt: " << message_of(e) << "\n";
  }
  return 1;
}
