// Trains a small CNN (conv + batch-norm + linear) on Fashion-MNIST at one optamp opt level and
// writes JSON-lines metrics. scripts/ab_test.sh runs it at several levels and compares them.
//
//   train_fashion_mnist --opt-level O2 --steps 200 --metrics o2.jsonl [--device cuda]
//
// It is a program of python -m optamp.ab's protocol (optamp/ab.h, docs/ab_test.md): without
// --opt-level / --seed it takes OPTAMP_OPT_LEVEL / OPTAMP_SEED (else O0 / 0), and it reports
// through amp::ab::report, to --metrics FILE or else to the runner's OPTAMP_AB_METRICS file.
// What it does for the A/B harness alone (the metrics file, --eval-at, --save-weights) is in
// ab_harness.h.
// stdout gets Apex's properties report (printed once, by amp::initialize at its default
// verbosity 1) and a one-line summary; stderr Apex's "Gradient overflow" lines and a progress
// line with rate and ETA when it is a terminal (OPTAMP_PROGRESS=1/0 forces it on/off).
// Exit status: 0 ok, 2 bad arguments, 3 the opt level is not supported by this build/device
// (amp::initialize threw c10::NotImplementedError), 1 otherwise.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <malloc.h>
#include <optamp/amp.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ab_harness.h"
#include "fashion_mnist.h"
#include "fashion_mnist_net.h"
#include "trainer_common.h"

namespace {

// The optamp integration is trainer_common::AmpSession (trainer_common.h).
using fashion_mnist::Net;
using trainer_common::AmpSession;

struct Args {
  std::string opt_level;   // empty: OPTAMP_OPT_LEVEL (python -m optamp.ab), else O0
  std::int64_t steps = 0;  // 0: use epochs
  std::int64_t epochs = 1;
  std::int64_t batch_size = 64;
  double lr = 0.02;
  std::string lr_schedule = "constant";  // or "cosine": lr * (1 + cos(pi * step / steps)) / 2
  std::uint64_t seed = 0;
  bool seed_given = false;  // else OPTAMP_SEED (python -m optamp.ab), else 0
  std::string device = "cpu";
  std::string data = fashion_mnist::kDefaultDir;
  std::int64_t subset = 0;       // first N training images (0: all)
  std::int64_t test_subset = 0;  // first N test images (0: all 10000)
  int threads = 0;               // 0: LibTorch's default
  std::string metrics;
  std::vector<std::int64_t> eval_at;  // extra test-set evaluations after these steps
  std::string save_weights;
};

const char* kUsage =
    "usage: train_fashion_mnist [--opt-level O0..O5] [--steps N | --epochs N] [--batch-size N]\n"
    "         [--lr X] [--lr-schedule constant|cosine] [--seed N] [--device cpu|cuda]\n"
    "         [--data DIR] [--subset N] [--test-subset N] [--threads N] [--metrics FILE]\n"
    "         [--eval-at S1,S2,..] [--save-weights FILE]\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i], v = trainer_common::flag_value(argc, argv, i, kUsage);
    if (flag == "--opt-level")
      a.opt_level = v;
    else if (flag == "--steps")
      a.steps = std::stoll(v);
    else if (flag == "--epochs")
      a.epochs = std::stoll(v);
    else if (flag == "--batch-size")
      a.batch_size = std::stoll(v);
    else if (flag == "--lr")
      a.lr = std::stod(v);
    else if (flag == "--lr-schedule")
      a.lr_schedule = v;
    else if (flag == "--seed")
      a.seed = std::stoull(v), a.seed_given = true;
    else if (flag == "--device")
      a.device = v;
    else if (flag == "--data")
      a.data = v;
    else if (flag == "--subset")
      a.subset = std::stoll(v);
    else if (flag == "--test-subset")
      a.test_subset = std::stoll(v);
    else if (flag == "--threads")
      a.threads = std::stoi(v);
    else if (flag == "--metrics")
      a.metrics = v;
    else if (flag == "--eval-at")
      a.eval_at = ab_harness::parse_steps(flag, v);
    else if (flag == "--save-weights")
      a.save_weights = v;
    else
      throw std::invalid_argument("unknown flag " + flag);
  }
  // Under python -m optamp.ab the level and seed come from the environment, unless given here.
  if (a.opt_level.empty()) a.opt_level = amp::ab::opt_level("O0");
  if (!a.seed_given) a.seed = static_cast<std::uint64_t>(amp::ab::seed(0));
  amp::parse_opt_level(a.opt_level);  // throws, listing the valid levels
  if (a.lr_schedule != "constant" && a.lr_schedule != "cosine")
    throw std::invalid_argument("--lr-schedule must be constant or cosine, got \"" + a.lr_schedule +
                                "\"");
  if (a.device != "cpu" && a.device != "cuda")
    throw std::invalid_argument("--device must be cpu or cuda, got " + a.device);
  if (a.steps < 0 || a.epochs < 1 || a.batch_size < 1 || a.subset < 0 || a.test_subset < 0 ||
      !(a.lr > 0))
    throw std::invalid_argument("--steps >= 0, --epochs >= 1, --batch-size >= 1, --lr > 0");
  return a;
}

// The learning rate of step `step` (0-based) of `total`: constant, or cosine decay to 0 (for
// --epochs runs to convergence; a constant rate keeps a short run the prefix of a longer one).
double lr_at(const Args& args, std::int64_t step, std::int64_t total) {
  if (args.lr_schedule == "constant") return args.lr;
  const double pi = std::acos(-1.0);
  return args.lr * 0.5 *
         (1.0 + std::cos(pi * static_cast<double>(step) / static_cast<double>(total)));
}

void set_lr(torch::optim::SGD& optimizer, double lr) {
  for (auto& group : optimizer.param_groups())
    static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
}

// Test batches: 250 images take half the time of 1000 on a CPU (2.7 -> 1.2 s for the 10,000 on
// 2 cores: the activations of 1000 images overflow the caches and fault in fresh pages).
constexpr std::int64_t kEvalBatch = 250;

struct EvalResult {
  double accuracy;  // percent of the test images classified right
  double loss;      // mean cross-entropy over the test images
};

// Test-set pass: eval mode, no autograd (optamp's no_grad gate: the model's own fp32 weights,
// no casts), batches of kEvalBatch. Leaves the model in train mode again, so it can run
// mid-training.
EvalResult evaluate(Net& model, const fashion_mnist::Split& test, const torch::Device& device) {
  model->eval();
  std::int64_t correct = 0;
  double loss_sum = 0;
  {
    torch::NoGradGuard no_grad;
    const std::int64_t n_test = test.images.size(0);
    for (std::int64_t i = 0; i < n_test; i += kEvalBatch) {
      const std::int64_t j = std::min(n_test, i + kEvalBatch);
      const torch::Tensor x = fashion_mnist::to_input(test.images.slice(0, i, j), device);
      const torch::Tensor logits = amp::forward(model, x).to(torch::kFloat).cpu();
      const torch::Tensor y = test.labels.slice(0, i, j);
      correct += logits.argmax(1).eq(y).sum().item<std::int64_t>();
      loss_sum +=
          torch::nn::functional::cross_entropy(
              logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
              .item<double>();
    }
  }
  model->train();
  const double n = static_cast<double>(test.images.size(0));
  return {100.0 * static_cast<double>(correct) / n, loss_sum / n};
}

int run(const Args& args) {
  const torch::Device device = trainer_common::setup_device(args.device, args.threads);
  at::globalContext().setBenchmarkCuDNN(false);
  at::globalContext().setDeterministicCuDNN(true);

  const fashion_mnist::Split train = fashion_mnist::load(args.data, true, args.subset);
  const fashion_mnist::Split test = fashion_mnist::load(args.data, false, args.test_subset);
  const std::int64_t n_train = train.images.size(0);
  const std::int64_t batch = std::min(args.batch_size, n_train);
  const std::int64_t per_epoch = n_train / batch;  // the last partial batch is dropped
  const std::int64_t total = args.steps > 0 ? args.steps : args.epochs * per_epoch;
  const ab_harness::EvalSteps eval_at(args.eval_at, total);  // throws past the last step

  torch::manual_seed(args.seed);
  Net model;
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9));

  const AmpSession amp_session(model, optimizer, args.opt_level);  // throws UnsupportedOptLevel

  ab_harness::MetricsOut metrics(args.metrics);
  metrics.report({{"type", "config"},
                  {"program", "train_fashion_mnist"},
                  {"language", "c++"},
                  {"opt_level", args.opt_level},
                  {"device", args.device},
                  {"steps", total},
                  {"batch_size", batch},
                  {"lr", args.lr},
                  {"lr_schedule", args.lr_schedule},
                  {"seed", static_cast<std::int64_t>(args.seed)},
                  {"train_images", n_train},
                  {"test_images", test.images.size(0)},
                  {"threads", torch::get_num_threads()},
                  {"torch", TORCH_VERSION}});
  const auto report_eval = [&](std::int64_t step, const EvalResult& e) {
    metrics.report(
        {{"type", "eval"}, {"step", step}, {"test_accuracy", e.accuracy}, {"test_loss", e.loss}});
  };

  // Fixed shuffling: a CPU generator seeded with --seed draws one permutation per epoch
  // (torch.randperm with torch.Generator().manual_seed(seed) gives the same in Python).
  at::Generator shuffle = at::detail::createCPUGenerator(args.seed);
  torch::Tensor order;
  model->train();
  trainer_common::RunStats stats(device);
  trainer_common::Progress progress(args.opt_level, total, stats.start());
  for (std::int64_t step = 0; step < total; ++step) {
    const std::int64_t pos = step % per_epoch;
    if (pos == 0) order = torch::randperm(n_train, shuffle, torch::kLong);
    const torch::Tensor idx = order.slice(0, pos * batch, (pos + 1) * batch);
    const torch::Tensor x = fashion_mnist::to_input(train.images.index_select(0, idx), device);
    const torch::Tensor y = train.labels.index_select(0, idx).to(device);
    const double scale = AmpSession::loss_scale();

    if (args.lr_schedule != "constant") set_lr(optimizer, lr_at(args, step, total));
    stats.start_step();
    optimizer.zero_grad();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(amp::forward(model, x), y);
    AmpSession::backward(loss, optimizer);
    optimizer.step();
    const trainer_common::StepResult r = stats.end_step(loss);

    metrics.report({{"type", "step"},
                    {"step", step + 1},
                    {"loss", r.loss},
                    {"loss_scale", scale},
                    {"skipped", r.skipped},
                    {"step_ms", r.ms}});
    progress.show(step, r.loss, scale);
    if (eval_at.mid_run(step + 1))
      stats.evaluation([&] { report_eval(step + 1, evaluate(model, test, device)); });
  }
  stats.finish();
  const double final_scale = AmpSession::loss_scale();

  const EvalResult final_eval = evaluate(model, test, device);
  if (eval_at.at_end()) report_eval(total, final_eval);
  const double accuracy = final_eval.accuracy;
  if (!args.save_weights.empty()) ab_harness::save_weights(*model, args.save_weights);
  AmpSession::reset();

  const double median_ms = stats.median_step_ms();
  const double final_loss = stats.mean_recent_loss();
  const double samples_per_s = batch / (median_ms / 1000.0);
  const double train_s = stats.train_s(), peak_mb = stats.peak_mb();
  const std::int64_t skipped_steps = stats.skipped_steps();
  const std::string mem_kind = stats.memory_kind();

  metrics.report({{"type", "summary"},
                  {"opt_level", args.opt_level},
                  {"device", args.device},
                  {"steps", total},
                  {"batch_size", batch},
                  {"test_accuracy", accuracy},
                  {"test_loss", final_eval.loss},
                  {"peak_memory_mb", peak_mb},
                  {"peak_memory_kind", mem_kind},
                  {"median_step_ms", median_ms},
                  {"samples_per_s", samples_per_s},
                  {"final_train_loss", final_loss},
                  {"skipped_steps", skipped_steps},
                  {"final_loss_scale", final_scale},
                  {"train_time_s", train_s}});
  std::printf(
      "summary: %s %s | test accuracy %.2f%% (loss %.4f) | median step %.2f ms | %.0f samples/s | "
      "peak "
      "memory %.1f MB (%s) | final train loss %.4f | skipped %lld | loss scale %g | %.1f s\n",
      args.opt_level.c_str(), args.device.c_str(), accuracy, final_eval.loss, median_ms,
      samples_per_s, peak_mb, mem_kind.c_str(), final_loss, static_cast<long long>(skipped_steps),
      final_scale, train_s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  return trainer_common::run_main(
      "train_fashion_mnist", kUsage, [&] { args = parse_args(argc, argv); },
      [&] { return run(args); });
}
