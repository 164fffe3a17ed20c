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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "char_gpt.h"
#include "trainer_common.h"

namespace {

// The optamp integration is trainer_common::AmpSession (trainer_common.h).
using trainer_common::AmpSession;

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

// The flags that take an integer of at least `min`, and where each goes.
struct IntFlag {
  const char* name;
  std::int64_t Args::*field;
  std::int64_t min;
};
const IntFlag kIntFlags[] = {
    {"--seed", &Args::seed, 0},
    {"--steps", &Args::steps, 1},
    {"--batch-size", &Args::batch_size, 1},
    {"--seq-len", &Args::seq_len, 1},
    {"--d-model", &Args::d_model, 1},
    {"--layers", &Args::layers, 1},
    {"--heads", &Args::heads, 1},
    {"--warmup", &Args::warmup, 0},
    {"--eval-every", &Args::eval_every, 0},
    {"--eval-bytes", &Args::eval_bytes, 0},
};

// The flags that take a finite number > 0 (strict) or >= 0.
struct NumberFlag {
  const char* name;
  double Args::*field;
  bool strict;
};
const NumberFlag kNumberFlags[] = {
    {"--lr", &Args::lr, true},
    {"--weight-decay", &Args::weight_decay, false},
    {"--eps", &Args::eps, true},
    {"--clip", &Args::clip, false},
};

// A numeric flag of the tables above: parsed into `a`; false when `flag` is none of them.
bool parse_number_flag(Args& a, const std::string& flag, const std::string& v) {
  for (const IntFlag& f : kIntFlags) {
    if (flag != f.name) continue;
    a.*f.field = parse_int(flag, v, f.min);
    return true;
  }
  for (const NumberFlag& f : kNumberFlags) {
    if (flag != f.name) continue;
    a.*f.field = parse_double(flag, v, 0, f.strict);
    return true;
  }
  return false;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i], v = trainer_common::flag_value(argc, argv, i, kUsage);
    if (parse_number_flag(a, flag, v)) continue;
    if (flag == "--opt-level") {
      amp::parse_opt_level(v);  // throws, listing the valid levels
      a.opt_level = v;
    } else if (flag == "--preset") {
      char_gpt::Config unused{};
      if (!char_gpt::preset_config(v, &unused))
        throw std::invalid_argument("--preset must be tiny, gpu or test, got \"" + v + "\"");
      a.preset = v;
    } else if (flag == "--device") {
      if (v != "cpu" && v != "cuda")
        throw std::invalid_argument("--device must be cpu or cuda, got \"" + v + "\"");
      a.device = v;
    } else if (flag == "--threads") {
      a.threads = static_cast<int>(parse_int(flag, v, 0));
    } else if (flag == "--data") {
      a.data = v;
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
      const auto logits = amp::forward(model, x).to(torch::kFloat);
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
  const torch::Device device = trainer_common::setup_device(args.device, args.threads);

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

  const AmpSession amp_session(model, optimizer, args.opt_level);  // throws UnsupportedOptLevel

  at::Generator gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(args.seed));
  double val_bpc = std::nan("");
  model->train();
  trainer_common::RunStats stats(device);
  trainer_common::Progress progress(args.opt_level, plan.steps, stats.start());
  for (std::int64_t step = 0; step < plan.steps; ++step) {
    const auto [x, y] = char_gpt::get_batch(train, c.batch_size, c.seq_len, gen, device);
    const double scale = AmpSession::loss_scale();
    const double lr = lr_at(args, plan, step);
    for (auto& group : optimizer.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);

    stats.start_step();
    optimizer.zero_grad();
    const torch::Tensor logits = amp::forward(model, x);
    const torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.view({-1, char_gpt::kVocab}), y.view({-1}));
    AmpSession::backward(loss, optimizer);
    if (args.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), args.clip);
    optimizer.step();
    const trainer_common::StepResult r = stats.end_step(loss);

    amp::ab::report({{"step", step + 1},
                     {"loss", r.loss},
                     {"step_ms", r.ms},
                     {"loss_scale", scale},
                     {"skipped", r.skipped},
                     {"lr", lr}});
    progress.show(step, r.loss, scale);
    const bool last = step + 1 == plan.steps;
    if (last || (plan.eval_every > 0 && (step + 1) % plan.eval_every == 0)) {
      stats.evaluation([&] {
        val_bpc = evaluate(model, val, starts, c.seq_len, device);
        amp::ab::report({{"step", step + 1}, {"val_bpc", val_bpc}});
      });
    }
  }
  stats.finish();
  const double final_scale = AmpSession::loss_scale();
  AmpSession::reset();

  // train_bpc: the recent training loss (nats) / ln 2.
  const double median_ms = stats.median_step_ms();
  const double train_bpc = stats.mean_recent_loss() / std::log(2.0);
  const double tokens_per_s = static_cast<double>(c.batch_size * c.seq_len) / (median_ms / 1000.0);
  const double train_s = stats.train_s(), peak_mb = stats.peak_mb();
  const std::int64_t skipped_steps = stats.skipped_steps();
  const std::string mem_kind = stats.memory_kind();

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

}  // namespace

int main(int argc, char** argv) {
  Args args;
  return trainer_common::run_main(
      "train_char_gpt", kUsage,
      [&] {
        args = parse_args(argc, argv);
        make_plan(args);  // size checks (--d-model / --heads) are argument errors too
      },
      [&] { return run(args); });
}
