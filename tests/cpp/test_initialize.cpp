// amp::initialize for O0-O5: training vs O0, forward dtypes, O2 working copies, O3, the
// overloads, LR schedulers and clipping, checkpoints, errors, reset; the device-parametrized
// tests run on CUDA too where a GPU is visible.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>

#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using at::ScalarType;

// conv + batch-norm + linear + layer-norm + embedding, with dtype probes inside forward.
struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(1, 4, 3)};
  torch::nn::BatchNorm2d bn{4};
  torch::nn::Linear fc1{4 * 6 * 6, 16};
  torch::nn::LayerNorm ln{torch::nn::LayerNormOptions({16})};
  torch::nn::Embedding emb{3, 16};
  torch::nn::Linear fc2{16, 4};
  ScalarType conv_out{}, bn_out{}, fc_out{}, ln_out{};

  NetImpl() {
    register_module("conv", conv);
    register_module("bn", bn);
    register_module("fc1", fc1);
    register_module("ln", ln);
    register_module("emb", emb);
    register_module("fc2", fc2);
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& tag) {
    auto h = conv(x);
    conv_out = h.scalar_type();
    h = bn(h);
    bn_out = h.scalar_type();
    h = fc1(at::relu(h).flatten(1));
    fc_out = h.scalar_type();
    h = ln(h);
    ln_out = h.scalar_type();
    h = h + emb(tag);
    return fc2(at::relu(h));
  }
};
TORCH_MODULE(Net);

struct Batch {
  at::Tensor x, tag, y;
};

std::vector<Batch> make_batches(int n) {
  at::manual_seed(123);
  std::vector<Batch> batches;
  for (int i = 0; i < n; ++i) {
    batches.push_back({at::randn({8, 1, 8, 8}), at::randint(0, 3, {8}), at::randint(0, 4, {8})});
  }
  return batches;
}

Net make_net() {
  at::manual_seed(7);
  return Net();
}

// The same initial weights on `device` (moved before any optimizer sees them).
Net make_net_on(at::Device device) {
  Net net = make_net();
  net->to(device);
  return net;
}

using testing::quiet;

enum class Opt { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Net& net, Opt kind,
                                                        double adam_eps = 1e-8) {
  if (kind == Opt::kSgd) {
    return std::make_unique<torch::optim::SGD>(net->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(net->parameters(),
                                              torch::optim::AdamOptions(1e-3).eps(adam_eps));
}

// One training step through the public API; returns the loss.
double train_step(Net& net, torch::optim::Optimizer& opt, const Batch& b) {
  opt.zero_grad();
  auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  {
    auto scaled = scale_loss(loss, opt);
    scaled.backward();
  }
  opt.step();
  return loss.item<double>();
}

class Initialize : public ::testing::Test {
 protected:
  void TearDown() override { reset(); }
};

// Single tests on the CPU and on CUDA (skipped where no GPU is visible).
class InitializeOnDevice : public Initialize, public ::testing::WithParamInterface<at::DeviceType> {
 protected:
  void SetUp() override { OPTAMP_SKIP_UNLESS_VISIBLE(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(Devices, InitializeOnDevice, testing::kDevices, testing::on_device);

// ---- per level: trains, matches O0 -----------------------------------------------------------

struct LevelCase {
  const char* level;
  Opt opt;
};

// gtest prints the case in test names and failures ("O2 Adam", not the bytes of the struct).
void PrintTo(const LevelCase& c, std::ostream* os) {
  *os << c.level << (c.opt == Opt::kSgd ? " SGD" : " Adam");
}

// Every level trains on the CPU and, where a GPU is visible, through the CUDA kernels (casts,
// multi-tensor unscale, scale update), and stays close to O0 there.
class InitializeLevels : public testing::OnDevices<Initialize, LevelCase> {};

std::vector<Batch> batches_on(at::Device device, int n = 4) {
  auto batches = make_batches(n);
  for (auto& b : batches) b = {b.x.to(device), b.tag.to(device), b.y.to(device)};
  return batches;
}

// The parameters as fp32 CPU tensors (comparable across levels and devices).
std::vector<at::Tensor> fp32_cpu_params(Net& net) {
  std::vector<at::Tensor> params;
  for (const auto& p : net->parameters()) {
    params.push_back(p.detach().to(at::kCPU, at::kFloat).clone());
  }
  return params;
}

std::vector<at::Tensor> train_run(const char* level, Opt kind, int steps, double* first,
                                  double* last, double adam_eps, at::Device device) {
  auto batches = batches_on(device);
  Net net = make_net();
  net->to(device);
  auto opt = make_optimizer(net, kind, adam_eps);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < steps; ++s) {
    const double loss = train_step(net, *opt, batches[s % batches.size()]);
    if (s == 0) *first = loss;
    *last = loss;
  }
  auto params = fp32_cpu_params(net);
  reset();
  return params;
}

// Apex's O3 by hand: the model and inputs in fp16, no optamp at all (O3's reference).
std::vector<at::Tensor> pure_half_run(Opt kind, int steps, double adam_eps, at::Device device) {
  auto batches = batches_on(device);
  Net net = make_net();
  net->to(device, at::kHalf);
  auto opt = make_optimizer(net, kind, adam_eps);
  for (int s = 0; s < steps; ++s) {
    const auto& b = batches[s % batches.size()];
    opt->zero_grad();
    at::cross_entropy_loss(net->forward(b.x.to(at::kHalf), b.tag), b.y).backward();
    opt->step();
  }
  return fp32_cpu_params(net);
}

// The direction of the whole update (params - init) relative to O0's.
double update_cosine(const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& reference) {
  Net init = make_net();
  std::vector<at::Tensor> ours, theirs;
  for (std::size_t i = 0; i < params.size(); ++i) {
    ours.push_back((params[i] - init->parameters()[i].detach()).flatten());
    theirs.push_back((reference[i] - init->parameters()[i].detach()).flatten());
  }
  return at::cosine_similarity(at::cat(ours), at::cat(theirs), 0).item<double>();
}

// Trains 12 steps at c.level and at O0 on `device` and compares: loss, every parameter
// updated, and the parameters (or, for Adam, the update direction) against O0.
void expect_trains_close_to_o0(const LevelCase& c, at::Device device) {
  const std::string level = c.level;
  // O3 steps fp16 weights: Adam's eps must be representable there (see docs/opt_levels.md).
  const double eps = level == "O3" ? 1e-4 : 1e-8;
  double first0 = 0, last0 = 0, first = 0, last = 0;
  const auto reference = train_run("O0", c.opt, 12, &first0, &last0, eps, device);
  const auto params = train_run(c.level, c.opt, 12, &first, &last, eps, device);
  EXPECT_LT(last, first) << "loss did not decrease at " << level;
  EXPECT_NEAR(last, last0, 0.05 * last0) << "final loss at " << level << " vs O0";
  ASSERT_EQ(params.size(), reference.size());
  Net init = make_net();
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_FALSE(at::equal(params[i], init->parameters()[i].detach()))
        << "parameter " << i << " was never updated at " << level;
  }
  if (level == "O3") {
    // Pure fp16 rounds every update (no master weights), so O0 is no reference: fp16 training
    // by hand is. Same ops, same order: bitwise on the CPU; on CUDA within fp16 training
    // tolerance (cuDNN/cuBLAS may pick other algorithms between the two runs).
    const auto half = pure_half_run(c.opt, 12, eps, device);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(device.is_cpu()
                      ? at::equal(params[i], half[i])
                      : testing::all_close(params[i], half[i], testing::tolerance("train_float16")))
          << "parameter " << i << " vs hand-made fp16";
    }
    return;
  }
  if (c.opt == Opt::kAdam) {
    // Adam normalizes every step, so near-zero gradients turn small precision differences into
    // full-size steps elementwise; compare the direction of the whole update instead.
    EXPECT_GT(update_cosine(params, reference), 0.95) << "update direction at " << level;
    return;
  }
  const auto tol =
      testing::tolerance(level == "O4" || level == "O5" ? "train_bfloat16" : "train_float16");
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], tol)) << "parameter " << i;
  }
}

TEST_P(InitializeLevels, TrainsAndStaysCloseToO0) { expect_trains_close_to_o0(param(), device()); }

const auto kLevelCases = ::testing::Values(LevelCase{"O1", Opt::kSgd}, LevelCase{"O1", Opt::kAdam},
                                           LevelCase{"O2", Opt::kSgd}, LevelCase{"O2", Opt::kAdam},
                                           LevelCase{"O3", Opt::kSgd}, LevelCase{"O3", Opt::kAdam},
                                           LevelCase{"O4", Opt::kSgd}, LevelCase{"O4", Opt::kAdam},
                                           LevelCase{"O5", Opt::kSgd}, LevelCase{"O5", Opt::kAdam});

std::string level_case_name(
    const ::testing::TestParamInfo<std::tuple<LevelCase, at::DeviceType>>& info) {
  const LevelCase& c = std::get<0>(info.param);
  return std::string(c.level) + (c.opt == Opt::kSgd ? "_SGD" : "_Adam") +
         testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeLevels,
                         ::testing::Combine(kLevelCases, testing::kDevices), level_case_name);

TEST_F(Initialize, O0IsBitwisePlainFp32Training) {
  auto batches = make_batches(3);
  Net plain = make_net();
  auto plain_opt = make_optimizer(plain, Opt::kSgd);
  for (const auto& b : batches) {
    plain_opt->zero_grad();
    at::cross_entropy_loss(plain->forward(b.x, b.tag), b.y).backward();
    plain_opt->step();
  }
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O0", quiet());
  for (const auto& b : batches) train_step(net, *opt, b);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(net->parameters()[i], plain->parameters()[i])) << i;
  }
}

// ---- dtypes inside forward, per level ---------------------------------------------------------

// What one training forward/backward produces at a level, as docs/opt_levels.md and
// docs/casting.md say: `lower` ops (conv, linear) in the low dtype at O1-O5; layer_norm in the
// fp32 list at O1/O4 only; batch-norm (listed nowhere) runs on what it gets, i.e. the low-dtype
// conv output with its fp32 parameters at O1/O2/O4/O5, so its output is low (fp32 statistics
// inside, as cuDNN in Apex); losses fp32 at O1/O2/O4/O5 and plain fp16 at O3 (no fp32 list).
struct ForwardCase {
  const char* name;
  const char* level;
  std::optional<bool> keep_batchnorm_fp32;
  ScalarType conv, bn, fc, ln, out, loss;             // activations, the model output, the loss
  ScalarType param, bn_param;                         // the model's own tensors (masters at O2/O5)
  std::optional<bool> master_weights = std::nullopt;  // Apex's overrides of what happens to
  std::optional<ScalarType> cast_model_type = std::nullopt;  // the model (ModelCast)
};

void PrintTo(const ForwardCase& c, std::ostream* os) { *os << c.name; }

constexpr auto F = at::kFloat;
constexpr auto H = at::kHalf;
constexpr auto B = at::kBFloat16;

const ForwardCase kForwardCases[] = {
    //      conv bn  fc  ln  out loss param bn_param
    {"O0", "O0", std::nullopt, F, F, F, F, F, F, F, F},
    {"O1", "O1", std::nullopt, H, H, H, F, H, F, F, F},
    {"O2", "O2", std::nullopt, H, H, H, H, H, F, F, F},
    {"O3", "O3", std::nullopt, H, H, H, H, H, H, H, H},
    {"O3_KeepBatchnormFp32", "O3", true, H, H, H, H, H, H, H, F},
    {"O4", "O4", std::nullopt, B, B, B, F, B, F, F, F},
    {"O5", "O5", std::nullopt, B, B, B, B, B, F, F, F},
    {"O2_NoKeepBatchnormFp32", "O2", false, H, H, H, H, H, F, F, F},
    // Apex's overrides: O2 without masters casts the model in place (batch-norm kept fp32) and
    // keeps O2's fp32 losses; O3 with masters keeps the fp32 model and runs O3's working
    // copies; cast_model_type None/fp32 at a model level casts nothing; O0 with fp16 casts
    // the model (batch-norm too: keep_batchnorm_fp32 is None at O0) and its lower ops.
    {"O2_NoMasterWeights", "O2", std::nullopt, H, H, H, H, H, F, H, F, false},
    {"O3_MasterWeights", "O3", std::nullopt, H, H, H, H, H, H, F, F, true},
    {"O2_CastModelTypeNone", "O2", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt,
     ScalarType::Undefined},
    {"O3_CastModelTypeFp32", "O3", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt, F},
    {"O5_CastModelTypeNone", "O5", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt,
     ScalarType::Undefined},
    {"O0_CastModelTypeFp16", "O0", std::nullopt, H, H, H, H, H, H, H, H, std::nullopt, H},
};

void expect_forward_dtypes(const ForwardCase& c, at::Device device) {
  const auto b = batches_on(device, 1).front();
  Net net = make_net_on(device);
  auto opt = make_optimizer(net, Opt::kSgd);
  Options o = quiet();
  o.keep_batchnorm_fp32 = c.keep_batchnorm_fp32;
  o.master_weights = c.master_weights;
  o.cast_model_type = c.cast_model_type;
  initialize(net, *opt, c.level, o);
  opt->zero_grad();
  const auto out = net->forward(b.x, b.tag);
  const auto loss = at::cross_entropy_loss(out, b.y);
  EXPECT_EQ(net->conv_out, c.conv) << "conv output";
  EXPECT_EQ(net->bn_out, c.bn) << "batch-norm output";
  EXPECT_EQ(net->fc_out, c.fc) << "linear output";
  EXPECT_EQ(net->ln_out, c.ln) << "layer-norm output";
  EXPECT_EQ(out.scalar_type(), c.out) << "model output";
  EXPECT_EQ(loss.scalar_type(), c.loss) << "loss";
  EXPECT_EQ(out.device().type(), device.type());
  {
    auto scaled = scale_loss(loss, *opt);
    scaled.backward();
  }
  // The model's own tensors (what the optimizer steps and checkpoints hold) and their grads.
  for (const auto& p : net->named_parameters()) {
    const bool is_bn = p.key().rfind("bn.", 0) == 0;
    EXPECT_EQ(p.value().scalar_type(), is_bn ? c.bn_param : c.param) << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), p.value().scalar_type()) << p.key() << " grad";
    EXPECT_TRUE(p.value().grad().isfinite().all().item<bool>()) << p.key() << " grad";
  }
  EXPECT_EQ(net->bn->running_mean.scalar_type(), c.bn_param);
  EXPECT_EQ(net->bn->running_var.scalar_type(), c.bn_param);
  // ... and the step goes through.
  const auto before = fp32_cpu_params(net);
  opt->step();
  EXPECT_FALSE(at::equal(fp32_cpu_params(net)[0], before[0])) << "conv.weight was not stepped";
}

class InitializeForward : public testing::OnDevices<Initialize, ForwardCase> {};

TEST_P(InitializeForward, DtypesAsTheTableSays) { expect_forward_dtypes(param(), device()); }

std::string forward_case_name(
    const ::testing::TestParamInfo<std::tuple<ForwardCase, at::DeviceType>>& info) {
  return std::get<0>(info.param).name + testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeForward,
                         ::testing::Combine(::testing::ValuesIn(kForwardCases), testing::kDevices),
                         forward_case_name);

TEST_F(Initialize, O3CastsTheModelAndKeepsItOverridable) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O3", quiet());
  EXPECT_EQ(net->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(net->bn->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(net->bn->running_var.scalar_type(), at::kHalf);
  // The optimizer still holds the very same tensors.
  EXPECT_TRUE(opt->param_groups()[0].params()[0].is_same(net->conv->weight));
  reset();
  Net kept = make_net();
  auto kept_opt = make_optimizer(kept, Opt::kSgd);
  Options o = quiet();
  o.keep_batchnorm_fp32 = true;
  initialize(kept, *kept_opt, "O3", o);
  EXPECT_EQ(kept->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(kept->bn->weight.scalar_type(), at::kFloat);
}

TEST_F(Initialize, UserMarkedModulesKeepFp32AtO2) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  keep_in_fp32(*net->fc1);
  initialize(net, *opt, "O2", quiet());
  // A plain (non-`lower`) op shows whether a tensor is substituted by its working copy.
  EXPECT_EQ(at::add(net->fc1->weight, 1.0).scalar_type(), at::kFloat);  // kept
  EXPECT_EQ(at::add(net->bn->weight, 1.0).scalar_type(), at::kFloat);   // batch-norm
  EXPECT_EQ(at::add(net->fc2->weight, 1.0).scalar_type(), at::kHalf);   // working copy
}

TEST_F(Initialize, ThreadStateCarriesO2SubstitutionToWorkerThreads) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto state = ThreadState::capture();
  EXPECT_TRUE(state.key_on && state.substitution_on);
  at::ScalarType plain = at::kByte, carried = at::kByte, after = at::kByte;
  std::thread([&] {
    plain = at::add(net->fc2->weight, 1.0).scalar_type();
    {
      ThreadStateGuard guard(state);
      carried = at::add(net->fc2->weight, 1.0).scalar_type();
    }
    after = at::add(net->fc2->weight, 1.0).scalar_type();
  }).join();
  EXPECT_EQ(plain, at::kFloat) << "threads start with optamp off";
  EXPECT_EQ(carried, at::kHalf) << "the worker must see the O2 working copy";
  EXPECT_EQ(after, at::kFloat) << "the guard must restore the worker's state";
}

// ---- O2 working copies: one per param, reused, refreshed per step, never stale ---------------

bool is_batchnorm_param(const std::string& name) { return name.rfind("bn.", 0) == 0; }

// The working copy each op sees for every parameter, read through a view (a substituted op: a
// cache hit once the forward has cast it), next to its fp32 master rounded to fp16 with an
// exempt `to`. Returns the copies of the substituted parameters by name.
std::vector<std::pair<std::string, at::Tensor>> expect_copies_are_rounded_masters(
    Net& net, const std::string& when) {
  std::vector<std::pair<std::string, at::Tensor>> copies;
  for (const auto& p : net->named_parameters()) {
    const at::Tensor& master = p.value();
    EXPECT_EQ(master.scalar_type(), at::kFloat) << p.key() << " master " << when;
    const at::Tensor seen = master.view(master.sizes());
    if (is_batchnorm_param(p.key())) {  // keep_batchnorm_fp32: the fp32 tensor itself
      EXPECT_EQ(seen.scalar_type(), at::kFloat) << p.key() << " " << when;
      EXPECT_TRUE(at::equal(seen, master)) << p.key() << " " << when;
      continue;
    }
    EXPECT_EQ(seen.scalar_type(), at::kHalf) << p.key() << " " << when;
    EXPECT_TRUE(at::equal(seen, master.detach().to(at::kHalf)))
        << p.key() << ": stale working copy " << when;
    copies.emplace_back(p.key(), seen.detach().clone());
  }
  return copies;
}

void expect_o2_working_copies_never_stale(at::Device device) {
  Net net = make_net_on(device);
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  auto batches = batches_on(device, 3);
  std::size_t reduced_params = 0;
  for (const auto& p : net->named_parameters()) {
    if (!is_batchnorm_param(p.key())) ++reduced_params;
  }
  opt->zero_grad();
  // Micro-batch 1 (delayed unscale): every non-BN param is cast once (+ the input).
  auto before = cast_count();
  auto out = net->forward(batches[0].x, batches[0].tag);
  const auto forward_casts = cast_count() - before;
  EXPECT_EQ(forward_casts, static_cast<std::int64_t>(reduced_params) + 1);
  EXPECT_EQ(cache_size(), reduced_params);
  {
    auto scaled =
        scale_loss(at::cross_entropy_loss(out, batches[0].y), *opt, {0, /*delay_unscale=*/true});
    scaled.backward();
  }
  EXPECT_EQ(cache_size(), reduced_params);  // delayed: copies stay valid
  // Micro-batch 2: the working copies are reused; only the input is cast.
  before = cast_count();
  {
    auto scaled = scale_loss(
        at::cross_entropy_loss(net->forward(batches[1].x, batches[1].tag), batches[1].y), *opt);
    scaled.backward();
  }
  EXPECT_EQ(cast_count() - before, 2);  // the input and the loss's fp16->fp32 cast
  EXPECT_EQ(cache_size(), 0u);          // the non-delayed unscale dropped them: a step may follow
  opt->step();
  // Steps 1-4, each followed by the next training forward: it re-casts every copy exactly once,
  // and the copies it used are the stepped fp32 masters rounded to fp16 — never stale.
  std::vector<std::pair<std::string, at::Tensor>> previous;
  for (int step = 1; step <= 4; ++step) {
    const std::string when = "after step " + std::to_string(step);
    const auto& b = batches[step % batches.size()];
    opt->zero_grad();
    before = cast_count();
    out = net->forward(b.x, b.tag);
    EXPECT_EQ(cast_count() - before, forward_casts) << when;
    EXPECT_EQ(cache_size(), reduced_params) << when;
    const auto copies = expect_copies_are_rounded_masters(net, when);
    EXPECT_EQ(cast_count() - before, forward_casts) << "the check must read the forward's copies";
    for (std::size_t i = 0; i < previous.size(); ++i) {
      // The step moved every copy (a stale one would have been caught), except conv.bias: the
      // batch-norm after it cancels any shift, so its gradient is zero.
      const auto& [name, copy] = copies[i];
      EXPECT_EQ(at::equal(copy, previous[i].second), name == "conv.bias") << name << " " << when;
    }
    previous = copies;
    {
      auto scaled = scale_loss(at::cross_entropy_loss(out, b.y), *opt);
      scaled.backward();
    }
    EXPECT_EQ(cache_size(), 0u) << when;
    opt->step();
  }
  // After the last step, through a module: its output is the linear of the rounded masters.
  at::manual_seed(3);
  auto x = at::randn({2, 16}, device);
  const auto seen = net->fc2->forward(x);
  const auto expected = at::linear(x.to(at::kHalf), net->fc2->weight.detach().to(at::kHalf),
                                   net->fc2->bias.detach().to(at::kHalf));
  EXPECT_EQ(seen.scalar_type(), at::kHalf);
  // Same op, same fp16 inputs: bitwise on the CPU; within fp16 rounding on CUDA (cuBLAS).
  EXPECT_TRUE(device.is_cpu() ? at::equal(seen, expected)
                              : testing::all_close(seen, expected, testing::tolerance(at::kHalf)));
  expect_copies_are_rounded_masters(net, "after step 5");
}

TEST_P(InitializeOnDevice, O2OneWorkingCopyPerParamReusedAndRefreshedPerStep) {
  expect_o2_working_copies_never_stale(GetParam());
}

TEST_F(Initialize, O2OwnDataOpsStayFp32AndViewsReuseTheCopy) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto& w = net->fc2->weight;
  EXPECT_EQ(w.detach().clone().scalar_type(), at::kFloat);
  EXPECT_EQ(w.clone().scalar_type(), at::kFloat);
  EXPECT_EQ(w.to(at::kDouble).scalar_type(), at::kDouble);
  EXPECT_EQ(w.t().scalar_type(), at::kHalf);  // views see the working copy
  auto x = at::randn({2, 16});
  at::matmul(x, w.t());
  const auto before = cast_count();
  at::matmul(x, w.t());
  EXPECT_EQ(cast_count() - before, 1);  // x only: w's copy is reused through the view
  // No substitution without autograd recording (validation in fp32 by default).
  c10::NoGradGuard no_grad;
  EXPECT_EQ(net->fc2->forward(x).scalar_type(), at::kFloat);
}

// ---- the overloads of initialize ---------------------------------------------------------------

struct TwoModelRun {
  std::vector<at::Tensor> params;  // the net's, then the head's (fp32, CPU)
  double first = 0, last = 0;
};

// The general overload: two models and two optimizers, one loss over both, 8 steps.
TwoModelRun train_two_models(OptLevel level) {
  const auto batches = make_batches(4);
  Net net = make_net();
  at::manual_seed(11);
  torch::nn::Linear head(4, 4);
  torch::optim::SGD net_opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD head_opt(head->parameters(), torch::optim::SGDOptions(0.1));
  const auto handle = initialize({net.ptr(), head.ptr()}, {&net_opt, &head_opt}, level, quiet());
  EXPECT_EQ(handle.properties().opt_level, level);
  TwoModelRun run;
  for (int s = 0; s < 8; ++s) {
    const auto& b = batches[s % batches.size()];
    net_opt.zero_grad();
    head_opt.zero_grad();
    const auto out = head->forward(at::relu(net->forward(b.x, b.tag)));
    if (level == OptLevel::O2) {
      EXPECT_EQ(out.scalar_type(), at::kHalf) << "the head's linear runs on its working copies";
      EXPECT_EQ(at::add(head->weight, 1.0).scalar_type(), at::kHalf) << "head.weight substituted";
      EXPECT_EQ(at::add(net->fc2->weight, 1.0).scalar_type(), at::kHalf) << "fc2.weight too";
    }
    const auto loss = at::cross_entropy_loss(out, b.y);
    {
      auto scaled = scale_loss(loss, {&net_opt, &head_opt});
      scaled.backward();
    }
    net_opt.step();
    head_opt.step();
    if (s == 0) run.first = loss.item<double>();
    run.last = loss.item<double>();
  }
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  for (const auto& p : head->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  run.params = fp32_cpu_params(net);
  for (const auto& p : head->parameters()) run.params.push_back(p.detach().clone());
  reset();
  return run;
}

TEST_F(Initialize, VectorsOfModelsAndOptimizersTrainTogether) {
  const auto reference = train_two_models(OptLevel::O0);
  const auto o2 = train_two_models(OptLevel::O2);
  EXPECT_LT(o2.last, o2.first);
  EXPECT_NEAR(o2.last, reference.last, 0.05 * reference.last);
  at::manual_seed(11);
  torch::nn::Linear init_head(4, 4);
  ASSERT_EQ(o2.params.size(), reference.params.size());
  // Both models were stepped (by their own optimizer) and match fp32 training.
  EXPECT_FALSE(at::equal(o2.params.front(), make_net()->conv->weight)) << "net not stepped";
  EXPECT_FALSE(at::equal(o2.params.back(), init_head->bias)) << "head not stepped";
  for (std::size_t i = 0; i < o2.params.size(); ++i) {
    EXPECT_TRUE(
        testing::all_close(o2.params[i], reference.params[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

TEST_F(Initialize, WithoutOptimizerForInference) {
  // A whole forward through five fp16 layers drifts further than one op (the "float16" row).
  const testing::Tolerance forward_half{1e-2, 1e-3};
  const auto b = make_batches(1).front();
  Net net = make_net();
  at::Tensor fp32_out;
  {
    torch::NoGradGuard no_grad;
    fp32_out = net->forward(b.x, b.tag);
  }
  // O1, no optimizer (and so no scale_loss): casting is on.
  const auto handle = initialize(net, "O1", quiet());
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(handle.properties().low_dtype(), at::kHalf);
  EXPECT_EQ(net->forward(b.x, b.tag).scalar_type(), at::kHalf);
  EXPECT_EQ(net->conv_out, at::kHalf);
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(net->forward(b.x, b.tag).scalar_type(), at::kFloat) << "no_grad runs fp32";
    amp::autocast region;  // reduced-precision inference
    const auto out = net->forward(b.x, b.tag);
    EXPECT_EQ(net->conv_out, at::kHalf);
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    EXPECT_TRUE(testing::all_close(out.to(at::kFloat), fp32_out, forward_half));
  }
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  reset();

  // O3, no optimizer, OptLevel: the model itself is cast; inference runs fp16 even under no_grad.
  initialize(net, OptLevel::O3, quiet());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kHalf);
  torch::NoGradGuard no_grad;
  const auto out = net->forward(b.x, b.tag);
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_TRUE(testing::all_close(out.to(at::kFloat), fp32_out, forward_half));
}

TEST_F(Initialize, SharedPtrAndModuleReferenceModels) {
  const auto b = make_batches(1).front();
  at::manual_seed(7);
  auto model = std::make_shared<NetImpl>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  const auto step_changes_conv = [&] {
    const auto before = model->conv->weight.detach().clone();
    opt.zero_grad();
    auto loss = at::cross_entropy_loss(model->forward(b.x, b.tag), b.y);
    {
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
    opt.step();
    return !at::equal(model->conv->weight, before);
  };
  // std::shared_ptr<NetImpl>.
  initialize(model, opt, "O2", quiet());
  EXPECT_EQ(at::add(model->fc2->weight, 1.0).scalar_type(), at::kHalf);
  EXPECT_TRUE(step_changes_conv());
  reset();
  // std::shared_ptr<torch::nn::Module>.
  ModulePtr base = model;
  initialize(base, opt, "O1", quiet());
  model->forward(b.x, b.tag);
  EXPECT_EQ(model->fc_out, at::kHalf);
  EXPECT_TRUE(step_changes_conv());
  reset();
  // A module reference (the object must be owned by a shared_ptr, as modules always are).
  NetImpl& ref = *model;
  initialize(ref, opt, "O3", quiet());
  EXPECT_EQ(model->conv->weight.scalar_type(), at::kHalf);
  EXPECT_TRUE(opt.param_groups()[0].params()[0].is_same(model->conv->weight));
  EXPECT_TRUE(step_changes_conv());
  EXPECT_EQ(model->conv->weight.scalar_type(), at::kHalf);
}

TEST_F(Initialize, OptLevelEnumAndStringLevelsAreTheSame) {
  const auto b = make_batches(1).front();
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  const std::string level = "O4";
  const std::string by_string = initialize(net, *opt, level, quiet()).describe();
  reset();
  const auto handle = initialize(net, *opt, OptLevel::O4, quiet());
  EXPECT_EQ(handle.describe(), by_string);
  EXPECT_EQ(handle.properties().opt_level, OptLevel::O4);
  EXPECT_EQ(handle.properties().low_dtype(), at::kBFloat16);
  const auto before = fp32_cpu_params(net);
  train_step(net, *opt, b);
  EXPECT_EQ(net->conv_out, at::kBFloat16);
  EXPECT_EQ(net->fc_out, at::kBFloat16);
  const auto after = fp32_cpu_params(net);
  for (std::size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(net->parameters()[i].scalar_type(), at::kFloat);
    if (i != 1) EXPECT_FALSE(at::equal(after[i], before[i])) << "parameter " << i;  // not conv.bias
  }
}

// ---- C++ patterns that just work: LR schedulers, clipping ---------------------------------------

// StepLR built before initialize keeps driving the (unchanged) optimizer: at O2 it steps the
// fp32 masters with the scheduled lr, exactly as at O0.
std::vector<at::Tensor> train_with_step_lr(const char* level, double* final_lr, double* first,
                                           double* last) {
  const auto batches = make_batches(4);
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);  // lr 0.05
  torch::optim::StepLR scheduler(*opt, /*step_size=*/2, /*gamma=*/0.5);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < 8; ++s) {
    const double loss = train_step(net, *opt, batches[s % batches.size()]);
    scheduler.step();
    if (s == 0) *first = loss;
    *last = loss;
  }
  EXPECT_EQ(loss_scaler(0).skipped_steps(), 0) << level;
  *final_lr = opt->param_groups()[0].options().get_lr();
  auto params = fp32_cpu_params(net);
  reset();
  return params;
}

TEST_F(Initialize, O2StepLrSchedulerStepsAlong) {
  double lr0 = 0, lr2 = 0, first0 = 0, last0 = 0, first = 0, last = 0;
  const auto reference = train_with_step_lr("O0", &lr0, &first0, &last0);
  const auto params = train_with_step_lr("O2", &lr2, &first, &last);
  // LibTorch's StepLR counts its step() calls from 0: 8 calls decay at the 2nd, 4th and 6th.
  EXPECT_DOUBLE_EQ(lr2, 0.05 * std::pow(0.5, 3));
  EXPECT_DOUBLE_EQ(lr2, lr0);
  EXPECT_LT(last, first);
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

double grad_norm(Net& net) {
  double sum = 0;
  for (const auto& p : net->parameters()) {
    if (p.grad().defined()) sum += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

// clip_grad_norm_ on model->parameters() right after the scale_loss guard: the grads are the
// unscaled fp32 grads of the masters, so the total norm it returns is the fp32 one (not
// loss_scale times it), clipping works, and training tracks fp32 training with clipping.
TEST_F(Initialize, O2GradClippingAfterTheGuardSeesUnscaledGrads) {
  const auto batches = make_batches(4);
  constexpr int kSteps = 6;
  // fp32 reference (no amp): the total grad norm of every step, clipped the same way.
  Net ref = make_net();
  auto ref_opt = make_optimizer(ref, Opt::kSgd);
  std::vector<double> ref_norms;
  double max_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto& b = batches[s % batches.size()];
    ref_opt->zero_grad();
    at::cross_entropy_loss(ref->forward(b.x, b.tag), b.y).backward();
    if (s == 0) max_norm = 0.5 * grad_norm(ref);  // so that clipping acts
    ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm));
    ref_opt->step();
  }
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  double first = 0, last = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto& b = batches[s % batches.size()];
    opt->zero_grad();
    const auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
    {
      auto scaled = scale_loss(loss, *opt);
      scaled.backward();
    }
    ASSERT_GT(loss_scaler(0).loss_scale(), 1000.0) << "scaled grads would be this much larger";
    ASSERT_FALSE(loss_scaler(0).last_step_skipped());
    const double total = torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
    EXPECT_NEAR(total, ref_norms[s], 0.02 * ref_norms[s]) << "step " << s;
    EXPECT_NEAR(grad_norm(net), std::min(total, max_norm), 1e-3 * max_norm) << "step " << s;
    for (const auto& p : net->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    opt->step();
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, first);
  const auto params = fp32_cpu_params(net);
  const auto reference = fp32_cpu_params(ref);
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

// After an overflow the guard leaves the grads undefined: clipping finds nothing (returns 0)
// and the plain step changes nothing.
TEST_F(Initialize, O2GradClippingAfterAnOverflowIsANoOp) {
  const auto b = make_batches(1).front();
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto before = fp32_cpu_params(net);
  opt->zero_grad();
  const auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  {
    auto scaled = scale_loss(loss * std::numeric_limits<float>::infinity(), *opt);
    scaled.backward();
  }
  EXPECT_TRUE(loss_scaler(0).last_step_skipped());
  EXPECT_EQ(torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0), 0.0);
  opt->step();
  const auto after = fp32_cpu_params(net);
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << i;
}

// ---- checkpoints: resume is bit-exact at every level ------------------------------------------

// cuDNN may pick non-deterministic kernels (atomics in conv backward); a resume can only be
// bit-exact against a run that used deterministic ones. Restores the setting on exit.
class DeterministicCudnn {
 public:
  DeterministicCudnn() : was_(at::globalContext().deterministicCuDNN()) {
    at::globalContext().setDeterministicCuDNN(true);
  }
  ~DeterministicCudnn() { at::globalContext().setDeterministicCuDNN(was_); }
  DeterministicCudnn(const DeterministicCudnn&) = delete;
  DeterministicCudnn& operator=(const DeterministicCudnn&) = delete;

 private:
  bool was_;
};

// Trains 3 steps, checkpoints model, optimizer and amp, trains 3 more; then resumes a fresh
// model from the checkpoint (build, initialize, load) and trains the same 3: bitwise equal.
void expect_resume_bit_exact(const char* level, at::Device device) {
  DeterministicCudnn deterministic;
  // Adam's default eps underflows in pure fp16 (O3 warns about it), so O3 resumes with SGD.
  const Opt kind = std::string(level) == "O3" ? Opt::kSgd : Opt::kAdam;
  auto batches = batches_on(device);
  Net net = make_net_on(device);
  auto opt = make_optimizer(net, kind);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < 3; ++s) train_step(net, *opt, batches[s]);
  std::stringstream model_file, opt_file, amp_file;
  torch::save(net, model_file);
  torch::save(*opt, opt_file);
  torch::save(state_dict(), amp_file);
  std::vector<at::Tensor> snapshot;
  for (const auto& p : net->parameters()) snapshot.push_back(p.detach().clone());
  for (int s = 3; s < 6; ++s) train_step(net, *opt, batches[s % batches.size()]);
  const double scale_uninterrupted = loss_scaler(0).loss_scale();
  reset();

  Net resumed = make_net_on(device);
  auto resumed_opt = make_optimizer(resumed, kind);
  initialize(resumed, *resumed_opt, level, quiet());  // O3 casts before loading fp16 values
  torch::load(resumed, model_file);
  torch::load(*resumed_opt, opt_file);
  StateDict amp_state;
  torch::load(amp_state, amp_file);
  load_state_dict(amp_state);
  // (Also a regression test: equal's kernel once left history-free working copies in the cache.)
  for (std::size_t i = 0; i < snapshot.size(); ++i) {
    ASSERT_EQ(resumed->parameters()[i].device().type(), device.type()) << "loaded parameter " << i;
    ASSERT_TRUE(at::equal(resumed->parameters()[i], snapshot[i])) << "loaded parameter " << i;
  }
  for (int s = 3; s < 6; ++s) train_step(resumed, *resumed_opt, batches[s % batches.size()]);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(resumed->parameters()[i], net->parameters()[i])) << "parameter " << i;
  }
  EXPECT_EQ(loss_scaler(0).loss_scale(), scale_uninterrupted);
}

// The resume order (docs/cpp.md): build, initialize, then load. Loading first fails loudly: the
// amp state has no loss scaler to go into yet, and at O3 the fp16 checkpoint does not fit the
// still-fp32 model.
TEST_F(Initialize, CheckpointLoadBeforeInitializeFails) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O3", quiet());
  train_step(net, *opt, make_batches(1).front());
  std::stringstream model_file;
  torch::save(net, model_file);
  const auto amp_state = state_dict();
  reset();

  Net resumed = make_net();
  auto resumed_opt = make_optimizer(resumed, Opt::kSgd);
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(amp_state), c10::Error, "call amp::initialize first");
  EXPECT_THROW(torch::load(resumed, model_file), c10::Error) << "fp16 values into fp32 params";
  model_file.clear();
  model_file.seekg(0);
  initialize(resumed, *resumed_opt, "O3", quiet());
  torch::load(resumed, model_file);
  load_state_dict(amp_state);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(resumed->parameters()[i], net->parameters()[i])) << "parameter " << i;
  }
}

class InitializeCheckpoint : public testing::OnDevices<Initialize, const char*> {};

TEST_P(InitializeCheckpoint, ResumeIsBitExact) { expect_resume_bit_exact(param(), device()); }

const auto kAllLevels = ::testing::Values("O0", "O1", "O2", "O3", "O4", "O5");

std::string level_name(
    const ::testing::TestParamInfo<std::tuple<const char*, at::DeviceType>>& info) {
  return std::get<0>(info.param) + testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeCheckpoint,
                         ::testing::Combine(kAllLevels, testing::kDevices), level_name);

// ---- re-initialization -----------------------------------------------------------------------

std::size_t resident_kib() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4;
}

// 50 initialize/train/reset cycles across levels and optimizers: each trains, reset leaves
// nothing on, and host memory stays bounded.
void expect_reinitialization_cycles_clean(at::Device device) {
  const auto b = batches_on(device, 1).front();
  std::size_t rss_after_warmup = 0;
  for (int cycle = 0; cycle < 50; ++cycle) {
    Net net = make_net_on(device);
    auto opt = make_optimizer(net, cycle % 2 ? Opt::kAdam : Opt::kSgd);
    initialize(net, *opt, cycle % 3 == 0 ? "O1" : cycle % 3 == 1 ? "O2" : "O5", quiet());
    const double loss = train_step(net, *opt, b);
    ASSERT_TRUE(std::isfinite(loss)) << "cycle " << cycle;
    for (const auto& p : net->parameters()) {
      ASSERT_EQ(p.device().type(), device.type());
      ASSERT_FALSE(p.isnan().any().item<bool>());
    }
    reset();
    ASSERT_EQ(cache_size(), 0u);
    ASSERT_FALSE(is_initialized());
    ASSERT_FALSE(is_casting_enabled());
    if (cycle == 9) rss_after_warmup = resident_kib();
  }
  EXPECT_LT(resident_kib(), rss_after_warmup + 32 * 1024) << "RSS grew by more than 32 MiB";
}

TEST_P(InitializeOnDevice, ReinitializationCyclesAreBoundedAndClean) {
  expect_reinitialization_cycles_clean(GetParam());
}

TEST_F(Initialize, ResetTurnsCastingOff) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O1", quiet());
  auto a = at::randn({2, 3});
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kHalf);
  reset();
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kFloat);
}

// ---- errors: clear messages, nothing modified -----------------------------------------------

struct IntOnlyImpl : torch::nn::Module {
  IntOnlyImpl() { register_parameter("counts", at::zeros({3}, at::kLong), false); }
};
TORCH_MODULE(IntOnly);

void expect_untouched(Net& net) {
  EXPECT_FALSE(is_initialized());
  EXPECT_FALSE(is_casting_enabled());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST_F(Initialize, ErrorModelWithoutFloatingParams) {
  IntOnly model;
  OPTAMP_EXPECT_THROW_WITH(initialize(model, "O1", quiet()), c10::ValueError,
                           "floating-point parameter");
  EXPECT_FALSE(is_initialized());
}

// Apex's check: a model .half()'d before initialize has no fp32 weights for O1/O2 to keep.
TEST_F(Initialize, ErrorReducedTrainableParametersWhereTheLevelKeepsFp32Weights) {
  for (const char* level : {"O1", "O2", "O4", "O5"}) {
    Net net = make_net();
    net->fc1->weight.set_data(net->fc1->weight.detach().to(at::kHalf));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, level, quiet()), c10::ValueError,
                             "trainable parameters must be torch.float32 at opt_level", level,
                             "fc1.weight", "torch.float16", "cast_model_type=False");
    EXPECT_FALSE(is_initialized()) << level;
    EXPECT_EQ(net->conv->weight.scalar_type(), at::kFloat) << level;
  }
  // Accepted: O3 (casts the model anyway), nothing cast, and frozen reduced parameters.
  for (const char* level : {"O0", "O3", "O2_nothing_cast", "O2_frozen"}) {
    Net net = make_net();
    net->fc1->weight.set_data(net->fc1->weight.detach().to(at::kHalf));
    Options o = quiet();
    const std::string name = level;
    if (name == "O2_nothing_cast") o.cast_model_type = ScalarType::Undefined;
    if (name == "O2_frozen") net->fc1->weight.set_requires_grad(false);
    EXPECT_NO_THROW(initialize(net, name.substr(0, 2), o)) << level;
    reset();
  }
}

TEST_F(Initialize, ErrorOptimizerParamsNotInModel) {
  Net net = make_net();
  Net other = make_net();
  torch::optim::SGD opt(other->parameters(), torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O3", quiet()), c10::ValueError,
                           "optimizer 0 parameter 0", "must be a parameter of the model");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorParameterInTwoOptimizers) {
  Net net = make_net();
  torch::optim::SGD a(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD b({net->fc2->weight}, torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize({net.ptr()}, {&a, &b}, "O2", quiet()), c10::ValueError,
                           "must belong to one optimizer", "optimizer 0", "optimizer 1",
                           "parameter fc2.weight (");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorLbfgsIsUnsupported) {
  Net net = make_net();
  torch::optim::LBFGS opt(net->parameters());
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O1", quiet()), c10::ValueError, "LBFGS",
                           "closure");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorSameOptimizerTwiceWithoutReset) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O1", quiet());
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "O2", quiet()), c10::ValueError,
                           "already passed to amp::initialize", "amp::reset()");
  reset();
  EXPECT_NO_THROW(initialize(net, *opt, "O2", quiet()));
}

TEST_F(Initialize, O3CastsOptimizerStateMadeBeforeInitialize) {
  // O3 casts the parameters; Adam moments from an earlier step (and Adagrad's accumulators,
  // made by its constructor) must follow, or the next step mixes fp32 state with fp16 params.
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kAdam, 1e-4);
  auto b = make_batches(1).front();
  at::cross_entropy_loss(net->forward(b.x, b.tag), b.y).backward();
  opt->step();
  initialize(net, *opt, "O3", quiet());
  const auto& state = static_cast<torch::optim::AdamParamState&>(
      *opt->state().at(net->conv->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(net->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(state.exp_avg().scalar_type(), at::kHalf);
  EXPECT_EQ(state.exp_avg_sq().scalar_type(), at::kHalf);
  const auto before = net->conv->weight.detach().clone();
  const double loss = train_step(net, *opt, b);  // the step runs, with fp16 state
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_FALSE(at::equal(before, net->conv->weight.detach()));
  reset();
  Net net2 = make_net();
  torch::optim::Adagrad adagrad(net2->parameters(), torch::optim::AdagradOptions(0.01));
  initialize(net2, adagrad, "O3", quiet());
  EXPECT_TRUE(std::isfinite(train_step(net2, adagrad, b)));
}

TEST_F(Initialize, ErrorOptimizerStateOnAnotherDevice) {
  Net net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto b = make_batches(1).front();
  at::cross_entropy_loss(net->forward(b.x, b.tag), b.y).backward();
  opt.step();
  auto& state = static_cast<torch::optim::SGDParamState&>(
      *opt.state().at(net->parameters()[0].unsafeGetTensorImpl()));
  state.momentum_buffer(state.momentum_buffer().to(at::kMeta));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O2", quiet()), c10::ValueError,
                           "on the device of its parameter", "meta",
                           "state of parameter conv.weight (");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorLevelConflictsComeFromProperties) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  Options o = quiet();
  o.master_weights = true;
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "O1", o), c10::ValueError, "master_weights");
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "o2", quiet()), c10::ValueError,
                           "capital letter O");
  expect_untouched(net);
}

TEST_F(Initialize, O3WarnsAboutAdamEpsilonBelowFp16Range) {
  struct Capture : c10::WarningHandler {
    std::string text;
    void process(const c10::Warning& w) override { text += w.msg(); }
  } capture;
  c10::WarningUtils::WarningHandlerGuard guard(&capture);
  Net net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-8));
  initialize(net, opt, "O3", quiet());
  EXPECT_NE(capture.text.find("eps=1e-08"), std::string::npos) << capture.text;
}

TEST_F(Initialize, FloorErrorNamesTheModelsParameters) {
  torch::nn::Linear fc(4, 2);
  torch::optim::SGD opt(fc->parameters(), torch::optim::SGDOptions(0.1));
  Options o = quiet();
  o.init_scale = 1.0;
  o.min_loss_scale = 1.0;
  initialize(fc, opt, "O1", o);
  auto x = at::randn({3, 4});
  std::string message;
  try {
    for (int step = 0; step <= LossScaler::kFloorSkipLimit; ++step) {
      opt.zero_grad();
      auto loss = fc->forward(x).sum() * std::numeric_limits<float>::infinity();
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find("weight"), std::string::npos) << message;
  EXPECT_NE(message.find("bias"), std::string::npos) << message;
}

TEST_F(Initialize, VerbosityOnePrintsOneLineAndTwoTheApexReport) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O2");
  const auto out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_NE(out.find("optamp: opt_level O2 ("), std::string::npos) << out;
  EXPECT_NE(out.find("loss scale dynamic"), std::string::npos) << out;
  EXPECT_EQ(out.find("Selected optimization level"), std::string::npos) << out;
  reset();
  Options two;
  two.verbosity = 2;
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O0", two);
  const auto report = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(report.find("Selected optimization level O0"), std::string::npos) << report;
  reset();
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O0", quiet());
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
}

}  // namespace
}  // namespace amp
