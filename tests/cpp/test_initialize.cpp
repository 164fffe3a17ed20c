// amp::initialize for O0-O5: training vs O0, O2 working copies, O3, checkpoints, errors, reset.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <fstream>
#include <sstream>
#include <thread>

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
  ScalarType conv_out{}, fc_out{}, bn_out{};

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
    h = ln(h) + emb(tag);
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

Options quiet() {
  Options o;
  o.verbosity = 0;
  return o;
}

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

// ---- per level: trains, matches O0 -----------------------------------------------------------

struct LevelCase {
  const char* level;
  Opt opt;
};

// gtest prints the case in test names and failures ("O2 Adam", not the bytes of the struct).
void PrintTo(const LevelCase& c, std::ostream* os) {
  *os << c.level << (c.opt == Opt::kSgd ? " SGD" : " Adam");
}

class InitializeLevels : public Initialize, public ::testing::WithParamInterface<LevelCase> {};

std::vector<Batch> batches_on(at::Device device) {
  auto batches = make_batches(4);
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

TEST_P(InitializeLevels, TrainsAndStaysCloseToO0) {
  expect_trains_close_to_o0(GetParam(), at::kCPU);
}

// The same on a GPU (skipped where none is visible): every level trains through the CUDA
// kernels (casts, multi-tensor unscale, scale update) and stays close to O0 there.
class InitializeLevels_CUDA : public InitializeLevels {
 protected:
  void SetUp() override { OPTAMP_SKIP_WITHOUT_CUDA(); }
};

TEST_P(InitializeLevels_CUDA, TrainsAndStaysCloseToO0) {
  expect_trains_close_to_o0(GetParam(), at::kCUDA);
}

const auto kLevelCases = ::testing::Values(LevelCase{"O1", Opt::kSgd}, LevelCase{"O1", Opt::kAdam},
                                           LevelCase{"O2", Opt::kSgd}, LevelCase{"O2", Opt::kAdam},
                                           LevelCase{"O3", Opt::kSgd}, LevelCase{"O3", Opt::kAdam},
                                           LevelCase{"O4", Opt::kSgd}, LevelCase{"O4", Opt::kAdam},
                                           LevelCase{"O5", Opt::kSgd}, LevelCase{"O5", Opt::kAdam});

std::string level_case_name(const ::testing::TestParamInfo<LevelCase>& info) {
  return std::string(info.param.level) + (info.param.opt == Opt::kSgd ? "_SGD" : "_Adam");
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeLevels_CUDA, kLevelCases, level_case_name);

INSTANTIATE_TEST_SUITE_P(Levels, InitializeLevels, kLevelCases, level_case_name);

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

// ---- dtypes inside forward -------------------------------------------------------------------

void expect_master_weight_dtypes(const char* level, ScalarType low) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, level, quiet());
  auto b = make_batches(1).front();
  auto out = net->forward(b.x, b.tag);
  EXPECT_EQ(net->conv_out, low);
  EXPECT_EQ(net->fc_out, low);
  EXPECT_EQ(net->bn_out, low) << "fp32 batch-norm params, reduced activations (as cuDNN in Apex)";
  EXPECT_EQ(out.scalar_type(), low);
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);  // masters
  EXPECT_EQ(net->bn->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net->bn->running_mean.scalar_type(), at::kFloat);
  EXPECT_EQ(at::cross_entropy_loss(out, b.y).scalar_type(), at::kFloat);
  reset();
}

TEST_F(Initialize, O2SeesHalfWorkingCopiesAndFp32BatchNorm) {
  expect_master_weight_dtypes("O2", at::kHalf);
}

TEST_F(Initialize, O5SeesBFloat16WorkingCopies) {
  expect_master_weight_dtypes("O5", at::kBFloat16);
}

TEST_F(Initialize, O1CastsOpsNotWeights) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O1", quiet());
  auto b = make_batches(1).front();
  net->forward(b.x, b.tag);
  EXPECT_EQ(net->conv_out, at::kHalf);
  EXPECT_EQ(net->fc_out, at::kHalf);
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

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

TEST_F(Initialize, O2OneWorkingCopyPerParamReusedAndRefreshedPerStep) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  auto batches = make_batches(3);
  std::size_t reduced_params = 0;
  for (const auto& p : net->named_parameters()) {
    if (p.key().rfind("bn.", 0) != 0) ++reduced_params;
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
  // Next forward: refreshed exactly once, and equal to the stepped fp32 master cast down.
  before = cast_count();
  net->forward(batches[2].x, batches[2].tag);
  EXPECT_EQ(cast_count() - before, forward_casts);
  EXPECT_EQ(cache_size(), reduced_params);
  auto x = at::randn({2, 16});
  EXPECT_TRUE(at::equal(net->fc2->forward(x),
                        at::linear(x.to(at::kHalf), net->fc2->weight.detach().to(at::kHalf),
                                   net->fc2->bias.detach().to(at::kHalf))));
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

// ---- checkpoints: resume is bit-exact at every level ------------------------------------------

class InitializeCheckpoint : public Initialize,
                             public ::testing::WithParamInterface<const char*> {};

TEST_P(InitializeCheckpoint, ResumeIsBitExact) {
  const char* level = GetParam();
  // Adam's default eps underflows in pure fp16 (O3 warns about it), so O3 resumes with SGD.
  const Opt kind = std::string(level) == "O3" ? Opt::kSgd : Opt::kAdam;
  auto batches = make_batches(4);
  Net net = make_net();
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

  Net resumed = make_net();
  auto resumed_opt = make_optimizer(resumed, kind);
  initialize(resumed, *resumed_opt, level, quiet());  // O3 casts before loading fp16 values
  torch::load(resumed, model_file);
  torch::load(*resumed_opt, opt_file);
  StateDict amp_state;
  torch::load(amp_state, amp_file);
  load_state_dict(amp_state);
  // (Also a regression test: equal's kernel once left history-free working copies in the cache.)
  for (std::size_t i = 0; i < snapshot.size(); ++i) {
    ASSERT_TRUE(at::equal(resumed->parameters()[i], snapshot[i])) << "loaded parameter " << i;
  }
  for (int s = 3; s < 6; ++s) train_step(resumed, *resumed_opt, batches[s % batches.size()]);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(resumed->parameters()[i], net->parameters()[i])) << "parameter " << i;
  }
  EXPECT_EQ(loss_scaler(0).loss_scale(), scale_uninterrupted);
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeCheckpoint,
                         ::testing::Values("O0", "O1", "O2", "O3", "O4", "O5"));

// ---- re-initialization -----------------------------------------------------------------------

std::size_t resident_kib() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4;
}

TEST_F(Initialize, ReinitializationCyclesAreBoundedAndClean) {
  auto b = make_batches(1).front();
  std::size_t rss_after_warmup = 0;
  for (int cycle = 0; cycle < 50; ++cycle) {
    Net net = make_net();
    auto opt = make_optimizer(net, cycle % 2 ? Opt::kAdam : Opt::kSgd);
    initialize(net, *opt, cycle % 3 == 0 ? "O1" : cycle % 3 == 1 ? "O2" : "O5", quiet());
    const double loss = train_step(net, *opt, b);
    ASSERT_TRUE(std::isfinite(loss)) << "cycle " << cycle;
    for (const auto& p : net->parameters()) ASSERT_FALSE(p.isnan().any().item<bool>());
    reset();
    ASSERT_EQ(cache_size(), 0u);
    ASSERT_FALSE(is_initialized());
    ASSERT_FALSE(is_casting_enabled());
    if (cycle == 9) rss_after_warmup = resident_kib();
  }
  EXPECT_LT(resident_kib(), rss_after_warmup + 32 * 1024) << "RSS grew by more than 32 MiB";
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

TEST_F(Initialize, VerbosityOnePrintsTheProperties) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O2");
  const auto out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("Selected optimization level O2"), std::string::npos) << out;
}

}  // namespace
}  // namespace amp
