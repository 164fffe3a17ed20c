// Steps that never wait for the device: amp::FusedAdam/FusedAdamW/FusedSGD against torch::optim's
// Adam/AdamW/SGD, no host read during steps at O1-O5 (and exactly one per step with an optimizer
// that skips on the host), an injected inf skipped bit-exactly on the device, several guards before
// one step, checkpoints interchangeable with torch::optim::Adam, the floor error, and the lazy
// scaler accessors.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/serialize.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "mlp_model.h"
#include "optamp/amp.h"
#include "optamp/core.h"
#include "simulated_capture.h"
#include "test_util.h"

namespace amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using testing::bit_equal;
using testing::Mlp;
using testing::snapshot;

at::Tensor batch(int i, const c10::Device& device) {
  at::manual_seed(100 + i);
  return at::randn({4, 8}).to(device);
}

at::Tensor loss_of(Mlp& model, int i, const c10::Device& device) {
  return model->forward(batch(i, device)).to(at::kFloat).pow(2).mean();
}

// One training step; `poison` puts an inf into fc1's weight gradient inside the guard.
void train_step(Mlp& model, torch::optim::Optimizer& opt, int i, const c10::Device& device,
                bool poison = false) {
  opt.zero_grad();
  {
    auto scaled = scale_loss(loss_of(model, i, device), opt);
    scaled.backward();
    if (poison) model->fc1->weight.grad()[0][0] = kInf;
  }
  opt.step();
}

// Every moment tensor of an Adam-family optimizer, in parameter order.
template <typename State>
std::vector<at::Tensor> moments(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& p : opt.param_groups()[0].params()) {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const State&>(*it->second);
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
  }
  return out;
}

// The first parameter's step count. Adam's and AdamW's states are unrelated types: cast to the
// one the optimizer made (a static_cast to the other is undefined; UBSan reports it).
int64_t adam_step_count(const torch::optim::Optimizer& opt) {
  const auto& p = opt.param_groups()[0].params()[0];
  const auto& state = *opt.state().at(p.unsafeGetTensorImpl());
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    return adamw->step();
  }
  return dynamic_cast<const torch::optim::AdamParamState&>(state).step();
}

std::string saved(const torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

// The host reads a step makes: top-level aten::_local_scalar_dense / is_nonzero / item calls
// (each one a device->host sync on a GPU) and waits for a queued scaler result.
struct HostReads {
  int64_t scalar_reads = 0;
  int64_t host_waits = 0;
};
template <typename Fn>
HostReads host_reads_of(Fn&& fn) {
  const int64_t waits_before = loss_scaler().host_waits();
  HostReads reads;
  for (const auto& op : testing::top_level_ops(fn)) {
    reads.scalar_reads +=
        op == "aten::_local_scalar_dense" || op == "aten::is_nonzero" || op == "aten::item";
  }
  reads.host_waits = loss_scaler().host_waits() - waits_before;
  return reads;
}

using testing::quiet;

class DeviceSkip : public ::testing::Test {
 protected:
  void SetUp() override { reset(); }
  void TearDown() override { reset(); }
};

// ---- the optimizers themselves -------------------------------------------------------------

template <typename Fused, typename Plain, typename Options>
void expect_same_training(Options options) {
  at::manual_seed(0);
  const at::Tensor w0 = at::randn({5, 3}), b0 = at::randn({3});
  auto make = [&] {
    return std::vector<at::Tensor>{w0.clone().requires_grad_(), b0.clone().requires_grad_()};
  };
  auto fused_params = make(), plain_params = make();
  Fused fused(fused_params, options);
  Plain plain(plain_params, options);
  for (int i = 0; i < 6; ++i) {
    for (auto* ps : {&fused_params, &plain_params}) {
      at::manual_seed(i);
      const at::Tensor x = at::randn({7, 5});
      x.mm((*ps)[0]).add((*ps)[1]).tanh().pow(2).sum().backward();
    }
    fused.step();
    plain.step();
    fused.zero_grad();
    plain.zero_grad();
  }
  for (size_t i = 0; i < fused_params.size(); ++i) {
    EXPECT_TRUE(at::allclose(fused_params[i], plain_params[i], 1e-5, 1e-6))
        << "param " << i << ": fused " << fused_params[i] << " plain " << plain_params[i];
  }
  if constexpr (!std::is_base_of_v<torch::optim::SGD, Fused>) {
    EXPECT_EQ(adam_step_count(plain), 6);
    EXPECT_EQ(saved(fused).empty(), false);
    EXPECT_EQ(adam_step_count(fused), 6) << "save() brings the host step count up to date";
  }
}

TEST_F(DeviceSkip, FusedAdamTrainsLikeAdam) {
  expect_same_training<FusedAdam, torch::optim::Adam>(
      torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  expect_same_training<FusedAdam, torch::optim::Adam>(
      torch::optim::AdamOptions(1e-2).amsgrad(true));
}

TEST_F(DeviceSkip, FusedAdamWTrainsLikeAdamW) {
  expect_same_training<FusedAdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2));
  expect_same_training<FusedAdamW, torch::optim::AdamW>(
      torch::optim::AdamWOptions(1e-2).amsgrad(true).weight_decay(0.3));
}

TEST_F(DeviceSkip, FusedSGDTrainsLikeSGD) {
  using torch::optim::SGDOptions;
  expect_same_training<FusedSGD, torch::optim::SGD>(SGDOptions(1e-2));
  expect_same_training<FusedSGD, torch::optim::SGD>(
      SGDOptions(1e-2).momentum(0.9).weight_decay(0.1));
  expect_same_training<FusedSGD, torch::optim::SGD>(SGDOptions(1e-2).momentum(0.9).nesterov(true));
  expect_same_training<FusedSGD, torch::optim::SGD>(SGDOptions(1e-2).momentum(0.9).dampening(0.5));
}

// torch's fused SGD kernel on the CPU (2.11) writes the momentum buffers but leaves fp16/bf16
// parameters of 16 elements or more unchanged; FusedSGD steps those with SGD's own ops.
TEST_F(DeviceSkip, FusedSGDStepsReducedPrecisionCpuParameters) {
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor w0 = at::ones({32}, dtype);
    auto fused_w = w0.clone().requires_grad_(), plain_w = w0.clone().requires_grad_();
    const auto options = torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(1e-4);
    FusedSGD fused({fused_w}, options);
    torch::optim::SGD plain({plain_w}, options);
    for (int i = 0; i < 3; ++i) {
      for (auto* w : {&fused_w, &plain_w}) w->mutable_grad() = at::full({32}, 0.5, dtype);
      fused.step();
      plain.step();
    }
    EXPECT_LT(fused_w.max().item<float>(), 0.99f) << "the parameters moved, " << dtype;
    EXPECT_TRUE(testing::all_close(fused_w, plain_w, testing::tolerance(dtype))) << dtype;
  }
}

// A float64 parameter (taken at every level since 2026-12-07) steps in float64 through torch's
// fused kernels as through torch::optim's loops.
TEST_F(DeviceSkip, FusedOptimizersStepFloat64ParametersAsTorchOptimDoes) {
  at::manual_seed(0);
  const at::Tensor w0 = at::randn({40}, at::kDouble);
  auto check = [&](auto& fused, auto& plain, at::Tensor& fused_w, at::Tensor& plain_w,
                   const char* name) {
    for (int i = 0; i < 3; ++i) {
      const at::Tensor g = at::randn({40}, at::kDouble);
      fused_w.mutable_grad() = g.clone();
      plain_w.mutable_grad() = g.clone();
      fused.step();
      plain.step();
    }
    EXPECT_EQ(fused_w.scalar_type(), at::kDouble) << name;
    EXPECT_FALSE(at::equal(fused_w, w0)) << "the parameters moved, " << name;
    EXPECT_TRUE(at::allclose(fused_w, plain_w, 1e-12, 1e-14)) << name;
  };
  {
    auto fw = w0.clone().requires_grad_(), pw = w0.clone().requires_grad_();
    FusedAdam fused({fw}, torch::optim::AdamOptions(1e-2));
    torch::optim::Adam plain({pw}, torch::optim::AdamOptions(1e-2));
    check(fused, plain, fw, pw, "Adam");
  }
  {
    auto fw = w0.clone().requires_grad_(), pw = w0.clone().requires_grad_();
    FusedSGD fused({fw}, torch::optim::SGDOptions(1e-2).momentum(0.9));
    torch::optim::SGD plain({pw}, torch::optim::SGDOptions(1e-2).momentum(0.9));
    check(fused, plain, fw, pw, "SGD");
  }
}

TEST_F(DeviceSkip, FusedSGDCheckpointsAreInterchangeableWithTorchSGD) {
  at::manual_seed(0);
  const at::Tensor w0 = at::randn({4, 3});
  const auto options = torch::optim::SGDOptions(1e-1).momentum(0.9).weight_decay(0.01);
  auto fused_w = w0.clone().requires_grad_(), plain_w = w0.clone().requires_grad_();
  FusedSGD fused({fused_w}, options);
  torch::optim::SGD plain({plain_w}, options);
  auto step = [](torch::optim::Optimizer& opt, at::Tensor& w, int i) {
    opt.zero_grad();
    at::manual_seed(i);
    w.mul(at::randn({4, 3})).sum().backward();
    opt.step();
  };
  for (int i = 0; i < 2; ++i) step(fused, fused_w, i);
  // torch::optim::SGD resumes from FusedSGD's checkpoint (its momentum buffer) ...
  std::istringstream from_fused(saved(fused));
  plain_w.detach().copy_(fused_w.detach());
  torch::load(plain, from_fused);
  step(fused, fused_w, 2);
  step(plain, plain_w, 2);
  EXPECT_TRUE(at::allclose(fused_w, plain_w, 1e-6, 1e-7));
  // ... and FusedSGD from torch::optim::SGD's.
  auto resumed_w = plain_w.detach().clone().requires_grad_();
  FusedSGD resumed({resumed_w}, options);
  std::istringstream from_plain(saved(plain));
  torch::load(resumed, from_plain);
  step(resumed, resumed_w, 3);
  step(plain, plain_w, 3);
  EXPECT_TRUE(at::allclose(resumed_w, plain_w, 1e-6, 1e-7));
}

TEST_F(DeviceSkip, FoundInfMustBeAOneElementFloatTensor) {
  FusedAdam opt(std::vector<at::Tensor>{at::zeros({2}, at::requires_grad())});
  OPTAMP_EXPECT_THROW_WITH(opt.add_found_inf(at::zeros({2})), c10::ValueError,
                           "found_inf must be a one-element float32 tensor");
  EXPECT_FALSE(opt.take_found_inf().defined());
}

// What torch's fused kernels cannot step is refused before anything changes: a sparse gradient,
// a complex parameter (a spectral layer's: the unfused optimizers step those). The real
// parameter beside it, listed first, is not stepped and gets no state either.
TEST_F(DeviceSkip, FusedOptimizersRefuseSparseGradientsAndComplexParametersUpFront) {
  auto real = at::ones({3}, at::requires_grad());
  auto complex = at::ones({2}, at::kComplexFloat).requires_grad_();
  real.mutable_grad() = at::ones({3});
  complex.mutable_grad() = at::ones({2}, at::kComplexFloat);
  FusedAdam adam(std::vector<at::Tensor>{real, complex});
  FusedSGD sgd(std::vector<at::Tensor>{real, complex}, torch::optim::SGDOptions(0.1).momentum(0.9));
  OPTAMP_EXPECT_THROW_WITH(adam.step(), c10::ValueError, "FusedAdam needs real parameters",
                           "ComplexFloat", "torch::optim's Adam, AdamW or SGD");
  OPTAMP_EXPECT_THROW_WITH(sgd.step(), c10::ValueError, "FusedSGD needs real parameters",
                           "ComplexFloat");
  EXPECT_TRUE(at::equal(real, at::ones({3})));
  EXPECT_TRUE(adam.state().empty());
  EXPECT_TRUE(sgd.state().empty());
  auto table = at::ones({4, 2}, at::requires_grad());
  table.mutable_grad() = at::ones({4, 2}).to_sparse();
  FusedAdamW adamw(std::vector<at::Tensor>{real, table});
  OPTAMP_EXPECT_THROW_WITH(adamw.step(), c10::ValueError, "FusedAdamW needs dense gradients",
                           "[4, 2]");
  EXPECT_TRUE(adamw.state().empty());
}

// ---- no host read in a step ------------------------------------------------------------------

class DeviceSkipLevels : public testing::OnDevices<DeviceSkip, std::string> {};

TEST_P(DeviceSkipLevels, StepsReadNothingOnTheHostWithAFusedOptimizer) {
  const c10::Device device(this->device());
  Mlp model;
  model->to(device);
  FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-4));
  initialize(model, opt, param(), quiet());
  train_step(model, opt, 0, device);  // first step: state and caches get created
  const HostReads reads = host_reads_of([&] {
    for (int i = 1; i <= 4; ++i) train_step(model, opt, i, device);
  });
  EXPECT_EQ(reads.scalar_reads, 0);
  EXPECT_EQ(reads.host_waits, 0);
  // Reading the results afterwards waits for them, then they are right.
  EXPECT_EQ(loss_scaler().skipped_steps(), 0);
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().loss_scale(), loss_scaler().scale_tensor().item<float>());
}

TEST_P(DeviceSkipLevels, StepsWaitOncePerStepWithAHostSkippingOptimizer) {
  const c10::Device device(this->device());
  Mlp model;
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-4));
  initialize(model, opt, param(), quiet());
  train_step(model, opt, 0, device);
  const HostReads reads = host_reads_of([&] {
    for (int i = 1; i <= 4; ++i) train_step(model, opt, i, device);
  });
  EXPECT_EQ(reads.scalar_reads, 0);
  EXPECT_EQ(reads.host_waits, loss_scaler().checks_overflow() ? 4 : 0);
}

// What a step left in the gradients (kept, unscaled, after a skip on the device): each parameter's
// largest finite magnitude, and which ones are not finite. For the message of a clean step that
// skipped: before the tests were seeded (main.cpp), about one random model in a thousand
// overflowed by itself at the initial 2^16, and this named the gradient (fc2.weight's).
std::string gradient_report(Mlp& model) {
  std::ostringstream out;
  out << "loss scale now " << loss_scaler().loss_scale()
      << "; unscaled gradients, largest magnitude:";
  for (const auto& named : model->named_parameters()) {
    const at::Tensor& g = named.value().grad();
    out << " " << named.key() << "=";
    if (!g.defined()) {
      out << "none";
      continue;
    }
    const at::Tensor finite = at::isfinite(g);
    out << (finite.all().item<bool>() ? "" : "NON-FINITE, finite max ")
        << at::where(finite, g.abs(), 0).max().item<float>();
  }
  return out.str();
}

TEST_P(DeviceSkipLevels, InjectedInfIsSkippedOnTheDeviceBitExactly) {
  const c10::Device device(this->device());
  Mlp model;
  model->to(device);
  FusedAdam opt(model->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4));
  initialize(model, opt, param(), quiet());
  for (int i = 0; i < 2; ++i) {
    train_step(model, opt, i, device);
    ASSERT_EQ(loss_scaler().skipped_steps(), 0)
        << "clean step " << i << " was skipped; " << gradient_report(model);
  }
  const auto params_before = snapshot(model->parameters());
  const auto moments_before = moments<torch::optim::AdamParamState>(opt);
  const double scale_before = loss_scaler().loss_scale();
  train_step(model, opt, 2, device, /*poison=*/true);
  EXPECT_TRUE(model->fc1->weight.grad().defined()) << "the device skips; no host reset";
  EXPECT_TRUE(bit_equal(snapshot(model->parameters()), params_before));
  EXPECT_TRUE(bit_equal(moments<torch::optim::AdamParamState>(opt), moments_before));
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().skipped_steps(), 1);
  EXPECT_EQ(loss_scaler().loss_scale(), loss_scaler().dynamic() ? scale_before / 2 : scale_before);
  saved(opt);
  EXPECT_EQ(adam_step_count(opt), 2) << "the skipped step is not counted";
  train_step(model, opt, 3, device);
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_FALSE(bit_equal(snapshot(model->parameters()), params_before));
}

TEST_P(DeviceSkipLevels, FusedSGDReadsNothingOnTheHostFromItsFirstStep) {
  const c10::Device device(this->device());
  Mlp model;
  model->to(device);
  FusedSGD opt(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  initialize(model, opt, param(), quiet());
  // The first step creates the momentum buffers, and reads nothing either (dampening 0).
  const HostReads reads = host_reads_of([&] {
    for (int i = 0; i < 4; ++i) train_step(model, opt, i, device);
  });
  EXPECT_EQ(reads.scalar_reads, 0);
  EXPECT_EQ(reads.host_waits, 0);
  EXPECT_EQ(loss_scaler().skipped_steps(), 0);
}

// Three steps, one of them poisoned, with `Opt` on a model made from seed 0; its parameters.
template <typename Opt>
std::vector<at::Tensor> sgd_run(const std::string& level, const c10::Device& device,
                                const torch::optim::SGDOptions& options, int poisoned_step) {
  reset();
  at::manual_seed(0);
  Mlp model;
  model->to(device);
  Opt opt(model->parameters(), options);
  initialize(model, opt, level, quiet());
  for (int i = 0; i < 3; ++i) train_step(model, opt, i, device, /*poison=*/i == poisoned_step);
  EXPECT_EQ(loss_scaler().skipped_steps(), 1);
  auto params = snapshot(model->parameters());
  reset();
  return params;
}

// A skipped step, the first one (which creates the momentum buffers) included, trains on as
// torch::optim::SGD's host skip does: undamped buffers stay zeros on the device, damped ones are
// not created (the one host read).
TEST_P(DeviceSkipLevels, FusedSGDTrainsLikeSGDThroughASkippedStep) {
  const c10::Device device(this->device());
  using torch::optim::SGDOptions;
  for (const auto& options : {SGDOptions(1e-2).momentum(0.9).weight_decay(1e-4),
                              SGDOptions(1e-2).momentum(0.9).dampening(0.5)}) {
    for (int poisoned : {0, 1}) {
      const auto fused = sgd_run<FusedSGD>(param(), device, options, poisoned);
      const auto plain = sgd_run<torch::optim::SGD>(param(), device, options, poisoned);
      ASSERT_EQ(fused.size(), plain.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        // O3's parameters are fp16 (on the CPU FusedSGD steps them with SGD's own ops: torch's
        // fused CPU kernel leaves fp16 parameters of 16 elements or more unchanged); on CUDA the
        // fused kernel rounds once where SGD's ops round once per op.
        EXPECT_TRUE(
            testing::all_close(fused[i], plain[i], testing::tolerance(fused[i].scalar_type())))
            << "parameter " << i << ", dampening " << options.dampening() << ", poisoned step "
            << poisoned;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, DeviceSkipLevels,
                         ::testing::Combine(::testing::Values("O1", "O2", "O3", "O4", "O5"),
                                            testing::kDevices),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  testing::device_suffix(std::get<1>(info.param));
                         });

// ---- several guards, mixed optimizers, checkpoints, the floor ------------------------------

TEST_F(DeviceSkip, FusedSGDWithDampeningReadsTheFlagOnceWhenItCreatesBuffers) {
  Mlp model;
  FusedSGD opt(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.5));
  initialize(model, opt, "O1", quiet());
  const HostReads first = host_reads_of([&] { train_step(model, opt, 0, at::kCPU); });
  EXPECT_EQ(first.scalar_reads, 1) << "the step that creates the buffers reads the flag";
  const HostReads later = host_reads_of([&] {
    for (int i = 1; i < 4; ++i) train_step(model, opt, i, at::kCPU);
  });
  EXPECT_EQ(later.scalar_reads, 0);
  EXPECT_EQ(later.host_waits, 0);
}

TEST_F(DeviceSkip, AnOverflowInAnyGuardBeforeTheStepSkipsIt) {
  Mlp model;
  FusedAdam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  initialize(model, opt, "O1", quiet());
  train_step(model, opt, 0, c10::kCPU);
  const auto before = snapshot(model->parameters());
  {
    auto scaled = scale_loss(loss_of(model, 1, c10::kCPU), opt);
    scaled.backward();
    model->fc2->bias.grad()[0] = kInf;
  }
  {
    auto scaled = scale_loss(loss_of(model, 2, c10::kCPU), opt);  // clean: grads accumulate
    scaled.backward();
  }
  opt.step();
  EXPECT_TRUE(bit_equal(snapshot(model->parameters()), before));
  EXPECT_EQ(loss_scaler().skipped_steps(), 1);
  train_step(model, opt, 3, c10::kCPU);
  EXPECT_FALSE(bit_equal(snapshot(model->parameters()), before)) << "the flag was consumed";
}

TEST_F(DeviceSkip, AGuardWithAHostSkippingOptimizerWaitsAndResetsGrads) {
  Mlp model;
  FusedAdam fused(model->fc1->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam plain(model->fc2->parameters(), torch::optim::AdamOptions(1e-3));
  std::vector<torch::optim::Optimizer*> both{&fused, &plain};
  initialize({model}, {fused, plain}, "O1", quiet());
  const int64_t waits = loss_scaler().host_waits();
  {
    auto scaled = scale_loss(loss_of(model, 0, c10::kCPU), both);
    scaled.backward();
    model->fc1->weight.grad()[0][0] = kInf;
  }
  EXPECT_EQ(loss_scaler().host_waits() - waits, 1);
  EXPECT_FALSE(model->fc1->weight.grad().defined()) << "the host skip resets the grads";
  EXPECT_FALSE(fused.take_found_inf().defined());
}

TEST_F(DeviceSkip, CheckpointsAreInterchangeableWithTorchAdam) {
  Mlp model;
  FusedAdam fused(model->parameters(), torch::optim::AdamOptions(1e-3));
  initialize(model, fused, "O1", quiet());
  train_step(model, fused, 0, c10::kCPU);
  train_step(model, fused, 1, c10::kCPU, /*poison=*/true);
  train_step(model, fused, 2, c10::kCPU);
  const std::string archive = saved(fused);

  Mlp other;
  torch::optim::Adam plain(other->parameters(), torch::optim::AdamOptions(1e-3));
  std::istringstream in(archive);
  torch::load(plain, in);
  EXPECT_EQ(adam_step_count(plain), 2);
  EXPECT_TRUE(bit_equal(moments<torch::optim::AdamParamState>(plain),
                        moments<torch::optim::AdamParamState>(fused)));

  // And back: a FusedAdam resumes from the count it loaded.
  FusedAdam resumed(model->parameters(), torch::optim::AdamOptions(1e-3));
  std::istringstream again(saved(plain));
  torch::load(resumed, again);
  reset();
  initialize(model, resumed, "O1", quiet());
  train_step(model, resumed, 3, c10::kCPU);
  saved(resumed);
  EXPECT_EQ(adam_step_count(resumed), 3);
}

TEST_F(DeviceSkip, TheFloorErrorStillNamesTheParameters) {
  Mlp model;
  FusedAdam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  Options o = quiet();
  o.min_loss_scale = 65536.0;  // the initial scale: every overflow is at the floor
  initialize(model, opt, "O1", o);
  std::string error;
  int steps = 0;
  try {
    for (; steps < LossScaler::kFloorSkipLimit + 2; ++steps) {
      train_step(model, opt, steps, c10::kCPU, /*poison=*/true);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  // The results reach the host in order; on the CPU at the next step at the latest.
  EXPECT_GE(steps, LossScaler::kFloorSkipLimit - 1);
  EXPECT_LE(steps, LossScaler::kFloorSkipLimit);
  EXPECT_NE(error.find("consecutive steps at min_loss_scale"), std::string::npos) << error;
  EXPECT_NE(error.find("fc1.weight"), std::string::npos) << error;
}

// ---- steps captured into a CUDA graph ---------------------------------------------------
// Capture is simulated on the CPU (simulated_capture.h).

using testing::SimulatedCapture;

TEST_F(DeviceSkip, ACapturedStepKeepsItsResultOnTheDevice) {
  Mlp model;
  FusedAdam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  initialize(model, opt, "O2", quiet());
  train_step(model, opt, 0, c10::kCPU);
  const int64_t skipped = loss_scaler().skipped_steps();
  const at::Tensor scale = loss_scaler().scale_tensor();
  const void* storage = scale.const_data_ptr();
  const auto before = snapshot(model->parameters());
  {
    SimulatedCapture capture;
    const HostReads reads = host_reads_of([&] { train_step(model, opt, 1, c10::kCPU, true); });
    EXPECT_EQ(reads.scalar_reads, 0);
    EXPECT_EQ(reads.host_waits, 0);
  }
  // The device did everything: the step was skipped and the scale backed off in place (the
  // graph's replays update the same storage), while the host kept no result of the step.
  EXPECT_TRUE(bit_equal(snapshot(model->parameters()), before));
  EXPECT_EQ(loss_scaler().scale_tensor().const_data_ptr(), storage);
  EXPECT_EQ(loss_scaler().scale_tensor().item<float>(), scale.item<float>());
  EXPECT_EQ(scale.item<float>(), 32768.0f);
  EXPECT_EQ(loss_scaler().skipped_steps(), skipped);
}

TEST_F(DeviceSkip, ACapturedStepRefusesAnOptimizerThatSkipsOnTheHost) {
  Mlp model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  initialize(model, opt, "O1", quiet());
  SimulatedCapture capture;
  auto scaled = scale_loss(loss_of(model, 0, c10::kCPU), opt);
  scaled.backward();
  OPTAMP_EXPECT_THROW_WITH(core::finish(scaled, /*unwinding=*/false), c10::Error,
                           "captured into a CUDA graph", "skip on the device", "FusedAdam");
}

}  // namespace
}  // namespace amp
