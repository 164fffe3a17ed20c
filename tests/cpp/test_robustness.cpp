// Nothing corrupts the weights, at any level, and no bad state or misuse is accepted: threads
// sharing one loss scaler, 1,000-step fault injection at O1-O5 through amp::initialize, the
// scale floor, state_dict validation, optimizers that were not initialized, backward after the
// guard, out-of-range opt levels, meta models, and state dicts with many losses.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cache/cast_cache.h"
#include "common/step_events.h"
#include "ops/multi_tensor.h"
#include "optamp/amp.h"
#include "optamp/autocast.h"
#include "optamp/core.h"
#include "test_util.h"

namespace amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Two linear layers on raw registered parameters (the nn layer headers compile slowly).
struct TinyNetImpl : torch::nn::Module {
  at::Tensor w1, b1, w2;
  explicit TinyNetImpl(int seed, at::Device device = at::kCPU) {
    at::manual_seed(seed);
    w1 = register_parameter("w1", (at::randn({8, 16}) * 0.3).to(device));
    b1 = register_parameter("b1", at::zeros({16}).to(device));
    w2 = register_parameter("w2", (at::randn({16, 4}) * 0.3).to(device));
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(at::addmm(b1, x, w1)).mm(w2); }
};
TORCH_MODULE(TinyNet);

struct Batch {
  at::Tensor x, target;
};

Batch batch(int seed) {
  at::manual_seed(500 + seed);
  return {at::randn({6, 8}), at::randn({6, 4})};
}

// The step's loss; with `bad` finite nothing is injected, else parameter `which` gets a gradient
// full of `bad` (inf or NaN) on top of the real one.
at::Tensor loss_of(TinyNet& net, int step, float bad, int which) {
  const Batch b = batch(step % 16);  // a regression no weights solve: every step has gradients
  at::Tensor loss = (net->forward(b.x).to(at::kFloat) - b.target).pow(2).mean();
  if (std::isfinite(bad)) return loss;
  const auto params = net->parameters();
  return loss + params[which].sum().to(at::kFloat) * bad;
}

bool all_finite(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (!at::isfinite(t).all().item<bool>()) return false;
  return true;
}

std::string serialized(const torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

using testing::bit_equal;
using testing::quiet;
using testing::snapshot;

class Robustness : public ::testing::Test {
 protected:
  void TearDown() override { reset(); }
};

// ---- 0. threads sharing one loss scaler --------------------------------------------------------

// Four threads each train their own model with their own optimizer, all through loss_id 0 of one
// vector initialize; two of them inject inf/NaN every third step. Every injected step (and only
// those) is skipped by its own thread, no weight ever becomes non-finite, the shared scale stays
// within its bounds, and the scaler counts exactly the injected steps. Run under
// -DOPTAMP_SANITIZE=thread too (docs/testing.md).
TEST_F(Robustness, ThreadsSharingOneLossScalerSkipExactlyTheirOwnOverflows) {
  constexpr int kThreads = 4, kSteps = 300;
  std::vector<TinyNet> nets;
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  std::vector<ModulePtr> models;
  std::vector<torch::optim::Optimizer*> opt_ptrs;
  for (int t = 0; t < kThreads; ++t) {
    nets.emplace_back(TinyNet(t));
    opts.push_back(std::make_unique<torch::optim::SGD>(nets.back()->parameters(),
                                                       torch::optim::SGDOptions(0.01)));
    models.push_back(nets.back().ptr());
    opt_ptrs.push_back(opts.back().get());
  }
  Options o = quiet();
  o.init_scale = 1024.0;
  o.growth_interval = 5;
  o.max_loss_scale = 4096.0;
  initialize(models, opt_ptrs, "O1", o);
  const ThreadState state = ThreadState::capture();

  std::atomic<int> wrong_skips{0}, missed_overflows{0}, injected{0}, non_finite{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      thread_state_guard guard(state);
      TinyNet& net = nets[t];
      auto& opt = *opts[t];
      for (int step = 0; step < kSteps; ++step) {
        const bool inject = t % 2 == 0 && step % 3 == 0;
        opt.zero_grad();
        {
          auto scaled = scale_loss(
              loss_of(net, step, inject ? (step % 2 ? kInf : kNaN) : 1.0f, step % 3), opt);
          scaled.backward();
        }
        const bool skipped = !net->w1.grad().defined();
        if (inject) ++injected;
        if (skipped && !inject) ++wrong_skips;
        if (!skipped && inject) ++missed_overflows;
        opt.step();
        if (!all_finite(net->parameters())) ++non_finite;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong_skips.load(), 0) << "a clean step was skipped for another thread's overflow";
  EXPECT_EQ(missed_overflows.load(), 0) << "an injected overflow was not skipped";
  EXPECT_EQ(non_finite.load(), 0);
  EXPECT_EQ(loss_scaler().skipped_steps(), injected.load());
  EXPECT_GE(loss_scaler().loss_scale(), LossScaler::kScaleFloor);
  EXPECT_LE(loss_scaler().loss_scale(), 4096.0);
  EXPECT_EQ(loss_scaler().scale_tensor().item<float>(), loss_scaler().loss_scale());
}

// ---- 1. fault injection at every level ---------------------------------------------------------

class FaultInjection : public Robustness, public ::testing::WithParamInterface<const char*> {};

// 1,000 Adam steps; at random steps an inf or NaN lands in a random parameter's gradient. At
// every level the injected steps are skipped (weights and Adam state bitwise unchanged), the
// others step, and nothing is ever non-finite. O3/O4/O5 have a fixed scale of 1.0: before
// overflow_check they let the NaN through (as Apex and native bf16 autocast do).
TEST_P(FaultInjection, ThousandStepsNeverCorruptWeightsOrAdamState) {
  const std::string level = GetParam();
  TinyNet net(3);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4));
  Options o = quiet();
  // ~140 backoffs in 1,000 steps: with the default interval the scale would sink until fp16
  // gradients underflow to zero (correct, but then clean steps change nothing to compare).
  // The ceiling keeps honest fp16 gradients far from overflowing, so only injected steps skip.
  o.growth_interval = 1;
  o.init_scale = 1024.0;
  o.max_loss_scale = 1024.0;
  initialize(net, opt, level, o);
  std::mt19937 rng(2024);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  int injected = 0, stepped = 0;
  for (int step = 0; step < 1000; ++step) {
    const bool inject = coin(rng) < 0.14;
    const float bad = inject ? (coin(rng) < 0.5 ? kInf : kNaN) : 1.0f;
    const int which = static_cast<int>(coin(rng) * 3);
    const auto before = snapshot(net->parameters());
    const std::string state_before = inject ? serialized(opt) : std::string();
    opt.zero_grad();
    {
      auto scaled = scale_loss(loss_of(net, step, bad, which), opt);
      scaled.backward();
    }
    ASSERT_EQ(net->w1.grad().defined(), !inject) << level << " step " << step << ": skipped?";
    opt.step();
    if (inject) {
      ++injected;
      ASSERT_TRUE(bit_equal(snapshot(net->parameters()), before))
          << level << " step " << step << ": an injected overflow changed the weights";
      ASSERT_EQ(serialized(opt), state_before) << level << " step " << step;
    } else {
      stepped += !bit_equal(snapshot(net->parameters()), before);
    }
    ASSERT_TRUE(all_finite(net->parameters())) << level << " step " << step;
  }
  EXPECT_GT(injected, 100);
  EXPECT_EQ(loss_scaler().skipped_steps(), injected) << level;
  EXPECT_EQ(stepped, 1000 - injected) << level << ": every clean step must update the weights";
  for (const auto& [key, s] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*s);
    EXPECT_TRUE(all_finite({adam.exp_avg(), adam.exp_avg_sq()})) << level;
    EXPECT_EQ(adam.step(), 1000 - injected) << level;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, FaultInjection, ::testing::Values("O1", "O2", "O3", "O4", "O5"),
                         [](const auto& info) { return std::string(info.param); });

TEST_F(Robustness, OverflowCheckOffLetsAFixedScaleStepThroughNaNAsApexDid) {
  TinyNet net(3);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Options o = quiet();
  o.overflow_check = false;
  initialize(net, opt, "O5", o);
  {
    auto scaled = scale_loss(loss_of(net, 0, kNaN, 0), opt);
    scaled.backward();
  }
  opt.step();
  EXPECT_FALSE(all_finite(net->parameters())) << "the documented opt-out must really opt out";
  EXPECT_EQ(loss_scaler().skipped_steps(), 0);
}

// A fixed scale cannot back off: 50 consecutive overflows there mean the model diverged, and the
// guard says which parameters had non-finite gradients (as at min_loss_scale).
TEST_F(Robustness, FixedScaleRaisesTheFloorErrorAfterFiftyConsecutiveSkips) {
  TinyNet net(3);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O5", quiet());
  for (int i = 1; i < LossScaler::kFloorSkipLimit; ++i) {
    auto scaled = scale_loss(loss_of(net, i, kNaN, 2), opt);
    scaled.backward();
  }
  EXPECT_EQ(loss_scaler().floor_skips(), LossScaler::kFloorSkipLimit - 1);
  auto last = [&] {
    auto scaled = scale_loss(loss_of(net, 0, kNaN, 2), opt);
    scaled.backward();
  };
  OPTAMP_EXPECT_THROW_WITH(last(), c10::Error,
                           "skipped 50 consecutive steps at its fixed loss "
                           "scale (1)",
                           "w2 ");
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
}

// ---- 2. the scale floor ------------------------------------------------------------------------

TEST_F(Robustness, ScaleNeverFallsBelowTheFloorAndTheNextCleanStepStaysFinite) {
  TinyNet net(1);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  Options o = quiet();
  o.init_scale = 1.0;
  initialize(net, opt, "O1", o);
  for (int i = 0; i < 160; ++i) {  // 1 -> 2^-126 takes 126 backoffs; torch's scaler goes on
    opt.zero_grad();
    auto scaled = scale_loss(loss_of(net, i, kInf, 0), opt);
    scaled.backward();
  }
  EXPECT_EQ(loss_scaler().loss_scale(), LossScaler::kScaleFloor);
  EXPECT_TRUE(std::isfinite(1.0f / loss_scaler().scale_tensor().item<float>()));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    {
      auto scaled = scale_loss(loss_of(net, i, 1.0f, 0), opt);
      scaled.backward();
    }
    opt.step();
  }
  EXPECT_TRUE(all_finite(net->parameters()));
  for (const auto& [key, s] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*s);
    EXPECT_TRUE(all_finite({adam.exp_avg(), adam.exp_avg_sq()}));
  }
}

// A finite gradient that unscaling pushes out of range is an overflow: float32 past 3.4e38, and
// fp16 past 65504 on the way back to the gradient's dtype.
TEST_F(Robustness, UnscaleThatOverflowsFiniteGradientsIsAnOverflow) {
  for (auto [dtype, value, inv] : {std::tuple{at::kFloat, 1e30, 1e10},
                                   {at::kHalf, 60000.0, 2.0},
                                   {at::kBFloat16, 1e38, 100.0}}) {
    for (int64_t n : {3, 40}) {  // scalar tail and the vector path
      const at::Tensor g = at::full({n}, value, at::kFloat).to(dtype);
      ASSERT_TRUE(at::isfinite(g).all().item<bool>());
      const at::Tensor found = at::zeros({1});
      ops::unscale_check_({g}, found, at::full({1}, inv, at::kFloat));
      EXPECT_EQ(found.item<float>(), 1.0f) << dtype << " n=" << n;
      const at::Tensor out = at::zeros({n}, dtype), found2 = at::zeros({1});
      ops::axpby_check_({out}, {at::full({n}, value, at::kFloat).to(dtype)},
                        {at::zeros({n}, dtype)}, at::full({1}, inv, at::kFloat), 1.0, found2);
      EXPECT_EQ(found2.item<float>(), 1.0f) << dtype << " n=" << n;
    }
  }
  // inv_scale 1.0 (a fixed scale of 1) is a read-only check: inf/NaN anywhere is found, nothing
  // is written.
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t at_index : {0, 17, 38}) {  // vector body and scalar tail
      at::Tensor g = at::randn({40}).to(dtype);
      g[at_index] = at_index == 17 ? kNaN : kInf;
      const at::Tensor before = g.clone(), flag = at::zeros({1});
      ops::unscale_check_({g}, flag, at::ones({1}));
      EXPECT_EQ(flag.item<float>(), 1.0f) << dtype << " at " << at_index;
      EXPECT_TRUE(at::equal(g.isnan(), before.isnan()) &&
                  at::equal(g.nan_to_num(0), before.nan_to_num(0)));
    }
  }
  const at::Tensor fine = at::full({40}, 2.0), found = at::zeros({1});
  ops::unscale_check_({fine}, found, at::full({1}, 0.5f));
  EXPECT_EQ(found.item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(fine, at::ones({40})));
}

// ---- 3. load_state_dict validates every field --------------------------------------------------

struct Corruption {
  const char* key;
  at::Tensor value;  // undefined: add an unknown key instead
  std::vector<const char*> message;
};

TEST_F(Robustness, LoadStateDictRefusesValuesNoRunCouldProduceAndChangesNothing) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Options o = quiet();
  o.num_losses = 2;
  o.hysteresis = 2;
  o.growth_interval = 100;
  initialize(net, opt, "O1", o);
  const StateDict good = state_dict();
  load_state_dict(good);  // the dict itself is fine
  const std::vector<Corruption> cases = {
      {"loss_scaler1.scale",
       at::scalar_tensor(1e30, at::kFloat),
       {"[", "16777216", "got 1.0000000150474662e+30"}},
      {"loss_scaler1.scale", at::scalar_tensor(0x1p-127, at::kFloat), {"2^-126", "got"}},
      {"loss_scaler0.scale", at::scalar_tensor(kNaN, at::kFloat), {"loss_scaler0.scale", "nan"}},
      {"loss_scaler0.scale", at::full({1}, 1024.0f), {"0-dim", "[1]"}},
      {"loss_scaler0.growth_tracker", at::scalar_tensor(-7, at::kInt), {"[0, 99]", "got -7"}},
      {"loss_scaler0.growth_tracker",
       at::scalar_tensor(1000000000, at::kInt),
       {"[0, 99]", "got 1000000000"}},
      {"loss_scaler1.hysteresis", at::scalar_tensor(-3, at::kInt), {"[0, 2]", "got -3"}},
      {"loss_scaler1.hysteresis", at::scalar_tensor(3, at::kInt), {"[0, 2]", "got 3"}},
      {"loss_scaler0.skipped",
       at::scalar_tensor(-1, at::kLong),
       {"loss_scaler0.skipped", "got -1"}},
      {"loss_scaler0.floor_skips", at::scalar_tensor(-1, at::kLong), {"floor_skips", "got -1"}},
      {"loss_scaler0.floor_skips", at::scalar_tensor(5, at::kLong), {"at most 'skipped'", "got 5"}},
      {"loss_scaler0.scale", at::scalar_tensor(2.0, at::kDouble), {"float32", "torch.float64"}},
      {"loss_scaler2.scale", at::Tensor(), {"num_losses=2", "got 3"}},
      {"loss_scaler0.momentum", at::Tensor(), {"unknown entry 'loss_scaler0.momentum'"}},
  };
  for (const auto& c : cases) {
    StateDict bad = good;
    bad.insert(c.key, c.value.defined() ? c.value : at::scalar_tensor(0, at::kLong));
    const StateDict before = state_dict();
    try {
      load_state_dict(bad);
      ADD_FAILURE() << "accepted " << c.key;
    } catch (const c10::ValueError& e) {
      const std::string what = e.what_without_backtrace();
      for (const char* needle : c.message)
        EXPECT_NE(what.find(needle), std::string::npos) << c.key << ": " << what;
      if (c.value.defined()) EXPECT_NE(what.find(c.key), std::string::npos) << what;
    }
    const StateDict after = state_dict();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(after.items()[i].second, before.items()[i].second)) << c.key;
  }
}

TEST_F(Robustness, FixedScaleLoadsOnlyItsOwnScale) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O5", quiet());
  StateDict sd = state_dict();
  load_state_dict(sd);
  sd.insert("loss_scaler0.scale", at::scalar_tensor(65536.0, at::kFloat));
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(sd), c10::ValueError, "fixed loss scale 1", "got 65536",
                           "loss_scale=\"dynamic\"", "leave the loss scalers' state out");
  EXPECT_EQ(loss_scaler().loss_scale(), 1.0);
}

// A level without loss scaling (O5's fixed scale of 1) resumed at fp16's dynamic O2: going on from
// scale 1 would underflow fp16 gradients until the scale grew back, one growth_interval per
// doubling. Refused (the ".dynamic" entry says the scale was fixed) unless init_scale asks for it;
// a checkpoint without the entry (written before 2026-12-06) loads as before.
TEST_F(Robustness, AFixedScalesStateIsNotResumedByADynamicScalerAtAnotherScale) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O5", quiet());
  const StateDict fixed = state_dict();
  ASSERT_TRUE(fixed.contains("loss_scaler0.dynamic"));
  EXPECT_FALSE(fixed.at("loss_scaler0.dynamic").item<bool>());
  reset();
  initialize(net, opt, "O2", quiet());
  EXPECT_TRUE(state_dict().at("loss_scaler0.dynamic").item<bool>());
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(fixed), c10::ValueError,
                           "'loss_scaler0.dynamic' is False", "fixed scale of 1",
                           "init_scale 65536", "leave the loss scalers' state out", "init_scale=1");
  EXPECT_EQ(loss_scaler().loss_scale(), 65536.0);
  StateDict old_layout;
  for (const auto& [key, value] : fixed.items())
    if (key != "loss_scaler0.dynamic") old_layout.insert(key, value);
  load_state_dict(old_layout);
  EXPECT_EQ(loss_scaler().loss_scale(), 1.0);
  reset();
  Options from_one = quiet();
  from_one.init_scale = 1.0;
  initialize(net, opt, "O2", from_one);
  load_state_dict(fixed);
  EXPECT_EQ(loss_scaler().loss_scale(), 1.0);
  StateDict not_bool = fixed;
  not_bool.insert("loss_scaler0.dynamic", at::scalar_tensor(0, at::kLong));
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(not_bool), c10::ValueError,
                           "'loss_scaler0.dynamic' must be a 0-dim torch.bool tensor", "int64");
}

// ---- 4. an optimizer that initialize never saw -------------------------------------------------

TEST_F(Robustness, ScaleLossRefusesAnOptimizerNotPassedToInitialize) {
  TinyNet net(1), other(2);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD stranger(other->parameters(), torch::optim::SGDOptions(0.1));
  initialize(std::vector<ModulePtr>{net.ptr(), other.ptr()}, {&opt}, "O1", quiet());
  const auto before = snapshot(other->parameters());
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss_of(other, 0, 1.0f, 0), stranger), c10::ValueError,
                           "optimizer must be an optimizer passed to amp::initialize");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss_of(net, 0, 1.0f, 0), {&opt, &stranger}), c10::ValueError,
                           "optimizers[1] must be an optimizer passed");
  EXPECT_TRUE(bit_equal(snapshot(other->parameters()), before));
  {
    auto scaled = scale_loss(loss_of(net, 0, 1.0f, 0), opt);  // the initialized one still works
    scaled.backward();
  }
  reset();
  initialize(net, "O1", quiet());  // inference: no optimizer at all
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss_of(net, 0, 1.0f, 0), opt), c10::ValueError,
                           "passed to amp::initialize");
}

// ---- 5. guards that end out of order or on another thread --------------------------------------

at::ScalarType mm_dtype() {
  const at::Tensor a = at::randn({2, 2}, at::requires_grad());
  return at::mm(a, a).scalar_type();
}

TEST_F(Robustness, GuardsEndingOutOfOrderLeaveTheStateOfTheGuardsStillOpen) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O1", quiet());
  ASSERT_EQ(mm_dtype(), at::kHalf);
  // Two coroutines on one thread: A enters disable_casts, B enters autocast(bf16), A exits, B
  // exits. Saving and restoring one mode variable left the thread in "disabled" for good.
  auto a = std::make_unique<disable_casts>();
  EXPECT_FALSE(is_casting_enabled());
  auto b = std::make_unique<autocast>(true, at::kBFloat16);
  EXPECT_EQ(mm_dtype(), at::kBFloat16);
  ::testing::internal::CaptureStderr();
  a.reset();  // out of order: warns, B's region stays
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("amp::disable_casts ended while guards entered after it"),
            std::string::npos)
      << warning;
  EXPECT_EQ(mm_dtype(), at::kBFloat16);
  b.reset();
  EXPECT_EQ(mm_dtype(), at::kHalf) << "back to the level's rules";
  EXPECT_TRUE(is_casting_enabled());
  // The same with autocast first.
  b = std::make_unique<autocast>(true, at::kBFloat16);
  a = std::make_unique<disable_casts>();
  b.reset();
  EXPECT_EQ(mm_dtype(), at::kFloat) << "disable_casts is still open";
  EXPECT_FALSE(is_casting_enabled());
  a.reset();
  EXPECT_EQ(mm_dtype(), at::kHalf);
}

// Threads casting the same parameters through the cast cache while their versions move on (a
// stale entry's copy is released with the cache unlocked, then the entry is looked up again):
// every cast is the parameter's, and afterwards the cache serves each one's current copy. Run
// under -DOPTAMP_SANITIZE=thread too.
TEST_F(Robustness, ThreadsCastingSharedParametersThroughTheCacheWhileTheyGoStale) {
  constexpr int kThreads = 4, kIterations = 2000, kParams = 8;
  std::vector<at::Tensor> params;
  for (int i = 0; i < kParams; ++i) params.push_back(at::randn({4, 3}).requires_grad_());
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        const at::Tensor& p = params[(i * 7 + t) % kParams];
        if (i % 5 == t) torch::autograd::impl::bump_version(p);  // stale, with no data written
        const auto copy = detail::cast_through_cache(p, at::kHalf).tensor;
        if (copy.scalar_type() != at::kHalf || !at::equal(copy, p.detach().to(at::kHalf))) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  for (const auto& p : params) {
    const auto first = detail::cast_through_cache(p, at::kHalf);
    const auto again = detail::cast_through_cache(p, at::kHalf);
    EXPECT_FALSE(again.performed_cast);
    EXPECT_TRUE(again.tensor.is_same(first.tensor));
  }
  clear_cache();
}

// Threads training on shared parameters through the cache's gradient buckets (on for CPU tensors
// here, as on a GPU): each step's first use of a copy sends its gradient through the bucket, the
// other threads' uses through their aliases, so backward passes run one bucket node at once and
// accumulate into the same parameters, while steps (recasts that make new buckets) come from any
// thread. Every gradient is a one: the sums are exact whatever the order. Run under
// -DOPTAMP_SANITIZE=thread too.
TEST_F(Robustness, ThreadsTrainingSharedParametersThroughGradientBuckets) {
  constexpr int kThreads = 4, kIterations = 200, kParams = 8;
  const bool was_on = set_gradient_buckets_on_cpu(true);
  std::vector<at::Tensor> params;
  for (int i = 0; i < kParams; ++i) params.push_back(at::randn({4, 3}).requires_grad_());
  auto train = [&] {
    at::Tensor loss = at::zeros({});
    for (const auto& p : params) {
      loss = loss + detail::cast_through_cache(p, at::kHalf).tensor.to(at::kFloat).sum();
    }
    loss.backward();
  };
  train();  // the first step makes the copies the next ones batch
  detail::notify_weights_may_change();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        train();
        if (i % 50 == t) detail::notify_weights_may_change();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& p : params) {
    EXPECT_TRUE(at::equal(p.grad(), at::full_like(p, 1 + kThreads * kIterations)));
  }
  set_gradient_buckets_on_cpu(was_on);
  clear_cache();
}

TEST_F(Robustness, GuardEndedOnAnotherThreadFreesItsOwnThread) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O1", quiet());
  auto guard = std::make_unique<disable_casts>();
  EXPECT_EQ(mm_dtype(), at::kFloat);
  std::thread([&] { guard.reset(); }).join();
  EXPECT_EQ(mm_dtype(), at::kHalf) << "the first thread must not stay disabled";
  EXPECT_TRUE(is_casting_enabled());
}

TEST_F(Robustness, ResetEndsEveryThreadsRegionsAndIsCastingEnabledTellsTheTruth) {
  EXPECT_FALSE(is_casting_enabled());
  auto stuck = std::make_unique<disable_casts>();
  std::atomic<int> phase{0};
  at::ScalarType worker_after = at::kByte;
  bool worker_enabled_after = true;
  std::thread worker([&] {
    autocast region(true, at::kBFloat16);  // open across the reset below
    phase = 1;
    while (phase.load() != 2) std::this_thread::yield();
    worker_after = mm_dtype();
    worker_enabled_after = is_casting_enabled();
  });
  while (phase.load() != 1) std::this_thread::yield();
  reset();  // the caller's disable_casts and the worker's region both end
  phase = 2;
  worker.join();
  EXPECT_EQ(worker_after, at::kFloat);
  EXPECT_FALSE(worker_enabled_after);
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O1", quiet());
  EXPECT_EQ(mm_dtype(), at::kHalf) << "not stuck in the disabled mode of before the reset";
  EXPECT_TRUE(is_casting_enabled());
  stuck.reset();  // its frame ended with the reset: a no-op now
  EXPECT_TRUE(is_casting_enabled());
  {
    at::NoGradGuard no_grad;
    EXPECT_FALSE(is_casting_enabled()) << "O1 casts nothing under no_grad";
    autocast region;
    EXPECT_TRUE(is_casting_enabled()) << "an explicit region casts under no_grad";
  }
}

// ---- 6. backward after the guard ---------------------------------------------------------------

TEST_F(Robustness, BackwardOnTheScaledLossAfterTheGuardFinishedRaises) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O1", quiet());
  at::Tensor kept;
  {
    auto scaled = scale_loss(loss_of(net, 0, 1.0f, 0), opt);
    kept = scaled.loss();
  }
  opt.zero_grad();
  OPTAMP_EXPECT_THROW_WITH(kept.backward(), c10::Error, "already finished",
                           "multiplied by the loss scale");
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  // Inside the guard, retain_graph and a second backward are fine.
  {
    auto scaled = scale_loss(loss_of(net, 1, 1.0f, 0), opt);
    scaled.backward(std::nullopt, /*retain_graph=*/true);
    scaled.backward();
  }
  EXPECT_TRUE(net->w1.grad().defined());
}

// ---- 7. opt levels made from integers ----------------------------------------------------------

TEST_F(Robustness, OptLevelOutsideTheEnumIsAValueError) {
  const auto bad = static_cast<OptLevel>(42);
  OPTAMP_EXPECT_THROW_WITH(to_string(bad), c10::ValueError, "OptLevel(42)", "O0", "O5");
  OPTAMP_EXPECT_THROW_WITH(resolve(bad), c10::ValueError, "OptLevel(42)");
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, bad, quiet()), c10::ValueError, "OptLevel(42)");
  EXPECT_FALSE(is_initialized());
}

// ---- 8. many losses ----------------------------------------------------------------------------

// 20,000 losses (120,000 entries) round-trip; with the old linear-search dict this took ~10 s to
// save and ~45 s to load, now well under a second (see docs/loss_scaling.md).
TEST_F(Robustness, StateDictWithManyLossesRoundTrips) {
  TinyNet net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Options o = quiet();
  o.num_losses = 20000;
  initialize(net, opt, "O1", o);
  {
    auto scaled = scale_loss(loss_of(net, 0, kInf, 0), opt, 19999);
    scaled.backward();
  }
  const StateDict sd = state_dict();
  ASSERT_EQ(sd.size(), 120000u);
  EXPECT_EQ(sd.at("loss_scaler19999.scale").item<float>(), 32768.0f);
  reset();
  initialize(net, opt, "O1", o);
  load_state_dict(sd);
  EXPECT_EQ(loss_scaler(19999).loss_scale(), 32768.0);
  EXPECT_EQ(loss_scaler(19999).skipped_steps(), 1);
  EXPECT_EQ(loss_scaler(0).loss_scale(), 65536.0);
}

// ---- 9. meta models ----------------------------------------------------------------------------

TEST_F(Robustness, MetaModelIsRefusedAtEveryLevel) {
  for (const char* level : {"O0", "O1", "O2", "O3", "O4", "O5"}) {
    TinyNet net(1, at::Device(at::kMeta));  // as torch.device("meta") construction makes it
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, level, quiet()), c10::ValueError, "materialized",
                             "meta device", "w1", "to_empty");
    EXPECT_FALSE(is_initialized()) << level;
  }
}

}  // namespace
}  // namespace amp
