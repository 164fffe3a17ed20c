// LossScaler and the scale_loss guard: unscaling, overflow skipping for every built-in optimizer,
// accumulation both ways, multiple losses/optimizers, the floor error, state_dict round trips,
// every user error, exception safety, and a 1,000-step fault-injection run.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "common/step_events.h"
#include "optamp/amp.h"
#include "optamp/core.h"
#include "test_util.h"

namespace amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

Properties props(Options o = {}) {
  if (!o.verbosity) o.verbosity = 0;
  return resolve("O1", o);
}

// A tiny two-layer model on raw tensors (no nn headers: they compile slowly).
struct Model {
  at::Tensor w1, b1, w2;
  explicit Model(int seed = 0) {
    at::manual_seed(seed);
    w1 = (at::randn({6, 8}) * 0.3).requires_grad_();
    b1 = (at::randn({8}) * 0.1).requires_grad_();
    w2 = (at::randn({8, 3}) * 0.3).requires_grad_();
  }
  std::vector<at::Tensor> params() const { return {w1, b1, w2}; }
  at::Tensor loss(const at::Tensor& x) const { return (x.mm(w1) + b1).tanh().mm(w2).pow(2).mean(); }
};

at::Tensor batch(int seed) {
  at::manual_seed(1000 + seed);
  return at::randn({5, 6});
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.defined() ? t.detach().clone() : at::Tensor());
  return out;
}

std::vector<at::Tensor> grads(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  out.reserve(ps.size());
  for (const auto& p : ps) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !at::equal(a[i], b[i])) return false;
  }
  return true;
}

std::string serialized(const torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

// Reference gradients: the same loss without any scaling.
std::vector<at::Tensor> plain_grads(const Model& m, const std::vector<int>& batches) {
  Model r = m;
  for (auto* p : {&r.w1, &r.b1, &r.w2}) *p = p->detach().clone().requires_grad_();
  for (int b : batches) r.loss(batch(b)).backward();
  return grads(r.params());
}

class ScaleLossTest : public ::testing::Test {
 protected:
  void SetUp() override { core::reset_loss_scalers(); }
  void TearDown() override { core::reset_loss_scalers(); }
};

TEST_F(ScaleLossTest, LossIsFloatTimesScaleAndGradsComeBackUnscaledExactly) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto expected = plain_grads(m, {0});
  const auto loss = m.loss(batch(0));
  {
    auto scaled = scale_loss(loss, opt);
    EXPECT_TRUE(at::equal(scaled.loss(), loss.to(at::kFloat) * 65536.0));
    scaled.backward();
    EXPECT_TRUE(at::equal(m.w2.grad(), expected[2] * 65536.0)) << "grads are scaled inside";
  }
  EXPECT_TRUE(all_equal(grads(m.params()), expected));
  EXPECT_EQ(loss_scaler().loss_scale(), 65536.0);
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 1);
}

// Per-sample losses (any shape, as Apex's `loss.float() * scale` and GradScaler.scale take them)
// reach backward with a gradient: the grads come back unscaled as their mean's would.
TEST_F(ScaleLossTest, APerSampleLossBackwardWithAGradientIsUnscaledLikeItsMean) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto expected = plain_grads(m, {0});
  const auto per_sample_loss = [&m] {  // [5]
    return (batch(0).mm(m.w1) + m.b1).tanh().mm(m.w2).pow(2).mean(1);
  };
  const auto per_sample = per_sample_loss();
  {
    auto scaled = scale_loss(per_sample, opt);
    EXPECT_EQ(scaled.loss().sizes(), per_sample.sizes());
    scaled.backward(at::full_like(scaled.loss(), 1.0 / 5));
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(at::allclose(m.params()[i].grad(), expected[i], 1e-6, 1e-7)) << i;
  }
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  {
    auto scaled = scale_loss(per_sample_loss() * kInf, opt);
    scaled.backward(at::ones_like(scaled.loss()));
  }
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().loss_scale(), 32768.0);
}

// Injects inf into one scaled gradient inside the guard.
void overflowing_step(Model& m, torch::optim::Optimizer& opt, int b, float bad = kInf) {
  auto scaled = scale_loss(m.loss(batch(b)), opt);
  scaled.backward();
  m.w1.grad()[2][3] = bad;
}

template <typename Opt, typename Options>
void expect_overflow_skips_step(Options options, const char* name) {
  core::reset_loss_scalers();
  core::configure_loss_scalers(props());
  Model m;
  Opt opt(m.params(), options);
  // A clean step first, so the optimizer has state (momentum buffers, Adam moments, step).
  {
    auto scaled = scale_loss(m.loss(batch(0)), opt);
    scaled.backward();
  }
  opt.step();
  const auto params_before = clones(m.params());
  const auto state_before = serialized(opt);
  overflowing_step(m, opt, 1);
  EXPECT_TRUE(loss_scaler().last_step_skipped()) << name;
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined()) << name;
  opt.step();
  EXPECT_TRUE(all_equal(clones(m.params()), params_before)) << name << ": params changed";
  EXPECT_EQ(serialized(opt), state_before) << name << ": optimizer state changed";
  EXPECT_EQ(loss_scaler().loss_scale(), 32768.0);
  // And the next clean step updates again.
  {
    auto scaled = scale_loss(m.loss(batch(2)), opt);
    scaled.backward();
  }
  opt.step();
  EXPECT_FALSE(all_equal(clones(m.params()), params_before)) << name;
}

TEST_F(ScaleLossTest, OverflowSkipsTheStepOfEveryBuiltInOptimizerBitwise) {
  using namespace torch::optim;
  expect_overflow_skips_step<SGD>(SGDOptions(0.1), "SGD");
  expect_overflow_skips_step<SGD>(SGDOptions(0.1).momentum(0.9).weight_decay(0.01),
                                  "SGD momentum+wd");
  expect_overflow_skips_step<SGD>(SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01),
                                  "SGD nesterov");
  expect_overflow_skips_step<Adam>(AdamOptions(1e-3).weight_decay(0.01), "Adam");
  expect_overflow_skips_step<Adam>(AdamOptions(1e-3).amsgrad(true), "Adam amsgrad");
  expect_overflow_skips_step<AdamW>(AdamWOptions(1e-3), "AdamW");
  expect_overflow_skips_step<RMSprop>(RMSpropOptions(1e-3).momentum(0.9).centered(true), "RMSprop");
  expect_overflow_skips_step<Adagrad>(AdagradOptions(0.1).weight_decay(0.01), "Adagrad");
}

TEST_F(ScaleLossTest, NanIsAnOverflowToo) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  overflowing_step(m, opt, 0, std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().skipped_steps(), 1);
}

// ---- found_inf reducer (model parallelism) ----------------------------------------------------

// A stand-in for the other ranks: max-combines this rank's flag with `remote` in place.
struct FakeRanks {
  float remote = 0;
  int calls = 0;
  at::Device device = at::kCPU;
  void operator()(at::Tensor& found) {
    ++calls;
    device = found.device();
    EXPECT_EQ(found.numel(), 1);
    EXPECT_EQ(found.scalar_type(), at::kFloat);
    found.clamp_min_(remote);
  }
};

TEST_F(ScaleLossTest, FoundInfReducerMakesEveryRankSkipWhenAnotherOverflowed) {
  core::configure_loss_scalers(props());
  auto ranks = std::make_shared<FakeRanks>();
  loss_scaler().set_found_inf_reducer([ranks](at::Tensor& f) { (*ranks)(f); });
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto before = clones(m.params());
  ranks->remote = 1;  // another rank overflowed; this one's grads are finite
  {
    auto scaled = scale_loss(m.loss(batch(0)), opt);
    scaled.backward();
  }
  EXPECT_EQ(ranks->calls, 1);
  EXPECT_TRUE(ranks->device.is_cpu());
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().loss_scale(), 32768.0) << "the same backoff as the overflowing rank";
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined());
  opt.step();
  EXPECT_TRUE(all_equal(clones(m.params()), before));
  ranks->remote = 0;  // nobody overflowed: a normal step
  {
    auto scaled = scale_loss(m.loss(batch(1)), opt);
    scaled.backward();
  }
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_TRUE(all_equal(grads(m.params()), plain_grads(m, {1})));
  // A local overflow stays an overflow whatever the others report.
  overflowing_step(m, opt, 2);
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(ranks->calls, 3);
  loss_scaler().set_found_inf_reducer({});
  EXPECT_FALSE(loss_scaler().has_found_inf_reducer());
}

TEST_F(ScaleLossTest, FoundInfReducerIsNotCalledForDelayedOrUncheckedScaling) {
  core::configure_loss_scalers(props());
  auto ranks = std::make_shared<FakeRanks>();
  loss_scaler().set_found_inf_reducer([ranks](at::Tensor& f) { (*ranks)(f); });
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  {
    auto scaled = scale_loss(m.loss(batch(0)), opt, ScaleLossOptions{0, /*delay_unscale=*/true});
    scaled.backward();
  }
  EXPECT_EQ(ranks->calls, 0) << "a delayed micro-batch has no overflow decision yet";
  Options fixed;
  fixed.loss_scale = LossScale::fixed(128.0);
  core::reset_loss_scalers();
  core::configure_loss_scalers(props(fixed));
  loss_scaler().set_found_inf_reducer([ranks](at::Tensor& f) { (*ranks)(f); });
  Model m2;
  torch::optim::SGD opt2(m2.params(), torch::optim::SGDOptions(0.1));
  {
    auto scaled = scale_loss(m2.loss(batch(0)), opt2);
    scaled.backward();
  }
  EXPECT_EQ(ranks->calls, 1) << "a fixed scale skips overflowing steps too: ranks must agree";
  fixed.overflow_check = false;
  core::reset_loss_scalers();
  core::configure_loss_scalers(props(fixed));
  loss_scaler().set_found_inf_reducer([ranks](at::Tensor& f) { (*ranks)(f); });
  {
    auto scaled = scale_loss(m2.loss(batch(0)), opt2);
    scaled.backward();
  }
  EXPECT_EQ(ranks->calls, 1) << "overflow_check=False: nothing is checked, nothing to agree on";
}

TEST_F(ScaleLossTest, AFailingFoundInfReducerSkipsTheStepAndPropagates) {
  core::configure_loss_scalers(props());
  loss_scaler().set_found_inf_reducer(
      [](at::Tensor&) { TORCH_CHECK(false, "collective timed out"); });
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto before = clones(m.params());
  auto step = [&] {
    auto scaled = scale_loss(m.loss(batch(0)), opt);
    scaled.backward();
  };
  OPTAMP_EXPECT_THROW_WITH(step(), c10::Error, "collective timed out");
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_EQ(loss_scaler().loss_scale(), 65536.0) << "the scale is unchanged";
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined());
  opt.step();
  EXPECT_TRUE(all_equal(clones(m.params()), before));
  // A reducer that breaks the flag's contract is named.
  loss_scaler().set_found_inf_reducer([](at::Tensor& f) { f = at::zeros({2}); });
  OPTAMP_EXPECT_THROW_WITH(step(), c10::ValueError, "found_inf reducer of loss scaler 0",
                           "one-element float32 tensor");
  loss_scaler().set_found_inf_reducer({});
  step();  // and the guard machinery is still consistent
  EXPECT_FALSE(loss_scaler().last_step_skipped());
}

TEST_F(ScaleLossTest, LogsTheApexMessageAtVerbosityOneOnly) {
  Options o;
  o.verbosity = 1;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  ::testing::internal::CaptureStderr();
  overflowing_step(m, opt, 0);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find(
                "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0"),
            std::string::npos);
  core::reset_loss_scalers();
  core::configure_loss_scalers(props());
  ::testing::internal::CaptureStderr();
  overflowing_step(m, opt, 0);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(ScaleLossTest, AccumulationWithDelayUnscaleAndWithRescalingBothGiveTheUnscaledSum) {
  core::configure_loss_scalers(props());
  const auto expected = plain_grads(Model(), {0, 1, 2});
  for (bool delay : {true, false}) {
    Model m;
    torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
    for (int b = 0; b < 3; ++b) {
      auto scaled = scale_loss(m.loss(batch(b)), opt, {0, /*delay_unscale=*/delay && b < 2});
      scaled.backward();
    }
    // Bitwise: scaling by a power of two commutes with fp32 rounding (no overflow/underflow
    // here), and both paths add the micro-batches in the order plain autograd does.
    EXPECT_TRUE(all_equal(grads(m.params()), expected)) << "delay=" << delay;
  }
  // Delayed micro-batches do not update the scale; each non-delayed exit does.
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 1 + 3);
}

// What a backward's readers of .grad see (DDP's all-reduce after no_sync, a post-accumulate hook):
// the whole accumulated sum at the guard's scale, as under torch's GradScaler, not only the
// current micro-batch's gradient.
TEST_F(ScaleLossTest, AccumulatedGradientsAreAtTheScaleOfTheBackwardThatAddsToThem) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  {
    auto s = scale_loss(m.loss(batch(0)), opt);
    s.backward();
  }
  std::vector<at::Tensor> seen;
  {
    auto s = scale_loss(m.loss(batch(1)), opt);
    s.backward();
    seen = grads(m.params());
  }
  const double scale = loss_scaler().loss_scale();
  const auto expected = plain_grads(Model(), {0, 1});
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_TRUE(at::equal(seen[i], expected[i] * scale)) << i;
  }
  EXPECT_TRUE(all_equal(grads(m.params()), expected));
}

// An embedding with sparse gradients (nn.Embedding(sparse=True)); torch's GradScaler unscales
// their values, and so does the guard, accumulated ones included.
at::Tensor sparse_loss(const at::Tensor& table, int b) {
  at::manual_seed(2000 + b);
  const auto ids = at::randint(0, table.size(0), {4, 3});
  return at::embedding(table, ids, -1, false, /*sparse=*/true).pow(2).sum() * (b + 1);
}

TEST_F(ScaleLossTest, SparseGradientsAreUnscaledAccumulatedAndSkippedLikeDenseOnes) {
  core::configure_loss_scalers(props());
  at::manual_seed(0);
  const auto start = at::randn({10, 4});
  at::Tensor expected;
  {
    auto ref = start.clone().requires_grad_();
    for (int b = 0; b < 3; ++b) sparse_loss(ref, b).backward();
    expected = ref.grad().to_dense();
  }
  for (bool delay : {true, false}) {
    auto table = start.clone().requires_grad_();
    torch::optim::SGD opt(std::vector<at::Tensor>{table}, torch::optim::SGDOptions(0.1));
    for (int b = 0; b < 3; ++b) {
      auto scaled = scale_loss(sparse_loss(table, b), opt, {0, /*delay_unscale=*/delay && b < 2});
      scaled.backward();
    }
    ASSERT_TRUE(table.grad().is_sparse());
    EXPECT_TRUE(at::equal(table.grad().to_dense(), expected)) << "delay=" << delay;
    EXPECT_FALSE(loss_scaler().last_step_skipped());
    opt.step();
    EXPECT_TRUE(all_close(table.detach(), start - 0.1 * expected, testing::tolerance(at::kFloat)));
  }
  auto table = start.clone().requires_grad_();
  torch::optim::SGD opt(std::vector<at::Tensor>{table}, torch::optim::SGDOptions(0.1));
  {
    auto scaled = scale_loss(sparse_loss(table, 0) * kInf, opt);
    scaled.backward();
  }
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_FALSE(table.grad().defined());
  opt.step();
  EXPECT_TRUE(at::equal(table.detach(), start));
}

// One SGD step from `start` through a guard: the gradient comes back unscaled bit for bit as an
// unscaled backward's (a power-of-two scale); then a step whose gradient `poison` puts an inf
// into inside the guard is skipped, the parameter unchanged bit for bit.
void expect_exact_unscale_then_bitwise_skip(
    const at::Tensor& start, const std::function<at::Tensor(const at::Tensor&)>& loss_of,
    const std::function<void(const at::Tensor&)>& poison) {
  auto ref = start.clone().requires_grad_();
  loss_of(ref).backward();
  auto w = start.clone().requires_grad_();
  torch::optim::SGD opt(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1));
  {
    auto scaled = scale_loss(loss_of(w), opt);
    scaled.backward();
  }
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_EQ(w.grad().scalar_type(), start.scalar_type());
  EXPECT_TRUE(at::equal(w.grad(), ref.grad()));
  opt.step();
  const auto stepped = w.detach().clone();
  EXPECT_TRUE(at::equal(stepped, start.add(ref.grad(), -0.1)));  // SGD's own update
  opt.zero_grad();
  {
    auto scaled = scale_loss(loss_of(w), opt);
    scaled.backward();
    poison(w.grad());
  }
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_FALSE(w.grad().defined());
  opt.step();
  EXPECT_TRUE(at::equal(w.detach(), stepped));
}

// A complex parameter (a spectral layer's weights) is unscaled and checked as the float pairs it
// is made of: its gradient comes back exactly unscaled, an inf in an imaginary part alone skips
// the step bitwise. torch's GradScaler refuses complex gradients ("not implemented for
// 'ComplexFloat'").
TEST_F(ScaleLossTest, ComplexGradientsAreUnscaledAndCheckedAsTheirFloatPairs) {
  core::configure_loss_scalers(props());
  at::manual_seed(0);
  const auto x = at::randn({5, 4}, at::kComplexFloat);
  expect_exact_unscale_then_bitwise_skip(
      at::randn({4, 3}, at::kComplexFloat),
      [&x](const at::Tensor& w) { return at::view_as_real(x.mm(w)).pow(2).mean(); },
      [](const at::Tensor& g) { at::view_as_real(g)[1][2][1].fill_(kInf); });  // one imaginary
  // A conjugate view (its conj bit set) is unscaled through the memory it shares, and checked.
  LossScaler scaler(props(), 0);
  const auto base = at::randn({3}, at::kComplexFloat) * 4;
  at::Tensor conj_grad = base.conj();
  ASSERT_TRUE(conj_grad.is_conj());
  const auto expected = (base / scaler.loss_scale()).conj().resolve_conj();
  scaler.unscale({conj_grad});
  EXPECT_FALSE(scaler.update());
  EXPECT_TRUE(at::equal(conj_grad.resolve_conj(), expected));
  at::view_as_real(base)[0][1].fill_(-kInf);  // through the view's memory
  scaler.unscale({conj_grad});
  EXPECT_TRUE(scaler.update());
}

// A float64 parameter (a physical constant someone keeps in double, which torch.amp trains) and
// a complex128 one: their gradients come back unscaled in their own precision, and an inf in
// either skips the step bitwise. Both were refused until 2026-12-07.
TEST_F(ScaleLossTest, Float64AndComplex128GradientsAreUnscaledInTheirOwnPrecision) {
  core::configure_loss_scalers(props());
  at::manual_seed(0);
  for (const auto dtype : {at::kDouble, at::kComplexDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto x = at::randn({5, 4}, dtype);
    expect_exact_unscale_then_bitwise_skip(
        at::randn({4, 3}, dtype) * 1e-3,  // below fp32's resolution beside the 1 added
        [&x](const at::Tensor& w) {
          const auto y = x.mm(w + 1);
          return (y.is_complex() ? at::view_as_real(y) : y).pow(2).mean();
        },
        [](const at::Tensor& g) {
          (g.is_complex() ? at::view_as_real(g) : g).view(-1)[7].fill_(kInf);
        });
  }
}

TEST_F(ScaleLossTest, BackwardOnTheLossInsteadOfTheScaledLossWarns) {
  // The slip gives unscaled gradients that the exit divides by the scale: training would go on
  // with gradients 65536 times too small and nothing said.
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const std::string needle = "finished without a backward through its scaled loss, but 3 of";
  ::testing::internal::CaptureStderr();
  {
    const auto loss = m.loss(batch(0));
    auto scaled = scale_loss(loss, opt);
    loss.backward();
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(needle), std::string::npos) << err;
  ::testing::internal::CaptureStderr();
  {  // the same slip on a later micro-batch, whose gradients accumulate onto the earlier ones
    const auto loss = m.loss(batch(1));
    auto scaled = scale_loss(loss, opt);
    loss.backward();
  }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(needle), std::string::npos) << err;
  opt.zero_grad();
  ::testing::internal::CaptureStderr();
  {  // the right call, and a guard whose backward never ran, say nothing
    auto scaled = scale_loss(m.loss(batch(1)), opt);
    scaled.backward();
  }
  { auto unused = scale_loss(m.loss(batch(2)), opt); }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("without a backward"), std::string::npos) << err;
}

// The braces of the header's recipe left out: the guard lives past the step, which updates with
// gradients still multiplied by the scale and unchecked. Training went on silently with updates
// 65536 times too large; the guard's end now names it (the update cannot be undone).
constexpr const char* kAllThreeChanged =
    "(optimizer 0 param_groups[0].params[0], shape [6, 8]) and 2 more parameters were changed in "
    "place inside the scale_loss guard (loss_id 0)";

void expect_a_step_inside_the_guard_refused(torch::optim::Optimizer& opt, Model& m,
                                            const char* name, const char* seen = kAllThreeChanged) {
  core::reset_loss_scalers();
  core::configure_loss_scalers(props());
  opt.zero_grad();
  const auto no_braces = [&] {
    auto scaled = scale_loss(m.loss(batch(0)), opt);
    scaled.backward();
    opt.step();
  };
  OPTAMP_EXPECT_THROW_WITH(no_braces(), c10::Error, seen, "still multiplied by the loss scale",
                           "{ auto scaled = amp::scale_loss(loss, optimizer); scaled.backward(); } "
                           "optimizer.step();");
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined()) << name << ": grads dropped";
  EXPECT_EQ(loss_scaler().loss_scale(), 65536.0) << name;
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 0) << name << ": no scale update";
  {  // the guard was released, and the recipe with its braces steps as before
    auto scaled = scale_loss(m.loss(batch(1)), opt);
    scaled.backward();
  }
  EXPECT_TRUE(step(opt)) << name;
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 1) << name;
}

// Seen through the parameters' version counters: LibTorch's Adam, AdamW, RMSprop and Adagrad
// bump them, as optamp's fused optimizers do. Its SGD writes through p.data(), which does not:
// with momentum its step is seen from the buffers it makes or updates; without, it is not seen.
TEST_F(ScaleLossTest, AStepInsideTheGuardIsAnErrorAtItsEnd) {
  Model m;
  torch::optim::Adam adam(m.params(), torch::optim::AdamOptions(1e-3));
  expect_a_step_inside_the_guard_refused(adam, m, "Adam");
  torch::optim::AdamW adamw(m.params(), torch::optim::AdamWOptions(1e-3));
  expect_a_step_inside_the_guard_refused(adamw, m, "AdamW");
  torch::optim::RMSprop rmsprop(m.params(), torch::optim::RMSpropOptions(1e-3));
  expect_a_step_inside_the_guard_refused(rmsprop, m, "RMSprop");
  torch::optim::Adagrad adagrad(m.params(), torch::optim::AdagradOptions(1e-3));
  expect_a_step_inside_the_guard_refused(adagrad, m, "Adagrad");
  FusedAdam fused_adam(m.params(), torch::optim::AdamOptions(1e-3));
  expect_a_step_inside_the_guard_refused(fused_adam, m, "FusedAdam");
  FusedAdamW fused_adamw(m.params(), torch::optim::AdamWOptions(1e-3));
  expect_a_step_inside_the_guard_refused(fused_adamw, m, "FusedAdamW");
  FusedSGD fused_sgd(m.params(), torch::optim::SGDOptions(0.1).momentum(0.9));
  expect_a_step_inside_the_guard_refused(fused_sgd, m, "FusedSGD");
  torch::optim::SGD momentum(m.params(), torch::optim::SGDOptions(0.01).momentum(0.5));
  const char* buffers_seen =
      "optimizer 0 (torch::optim::SGD) made or updated momentum buffers, so it stepped, inside "
      "the scale_loss guard (loss_id 0)";
  expect_a_step_inside_the_guard_refused(momentum, m, "SGD, buffers made", buffers_seen);
  expect_a_step_inside_the_guard_refused(momentum, m, "SGD, buffers updated", buffers_seen);
  torch::optim::SGD sgd(m.params(), torch::optim::SGDOptions(0.1));

  // One parameter written inside the guard by hand is named alone.
  {
    auto scaled = scale_loss(m.loss(batch(2)), sgd);
    scaled.backward();
    at::NoGradGuard no_grad;
    m.b1.add_(1.0);
    OPTAMP_EXPECT_THROW_WITH(core::finish(scaled, /*unwinding=*/false), c10::Error,
                             "(optimizer 0 param_groups[0].params[1], shape [8]) was changed "
                             "in place");
  }
  // Frozen parameters are no step's: one written inside the guard (an EMA held as a parameter)
  // is left alone, and the guard ends as usual.
  sgd.zero_grad();
  Model frozen(3);
  frozen.w2.requires_grad_(false);
  torch::optim::SGD with_frozen(frozen.params(), torch::optim::SGDOptions(0.1));
  {
    auto scaled = scale_loss(frozen.loss(batch(3)), with_frozen);
    scaled.backward();
    at::NoGradGuard no_grad;
    frozen.w2.mul_(0.5);
  }
  EXPECT_TRUE(frozen.w1.grad().defined());
  EXPECT_TRUE(step(with_frozen));
}

TEST_F(ScaleLossTest, AScaledLossThatReachesNoneOfTheOptimizersParametersWarns) {
  // An optimizer over other tensors than the forward used (built before FSDP2's fully_shard
  // replaced the model's parameters) stepped nothing, every step, and nothing said so; torch's
  // GradScaler raises there.
  core::configure_loss_scalers(props());
  Model m, other;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const std::string needle = "gave no gradient to any of its optimizers' 3 trainable parameters";
  ::testing::internal::CaptureStderr();
  {
    auto scaled = scale_loss(other.loss(batch(0)), opt);
    scaled.backward();
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(needle), std::string::npos) << err;
  ::testing::internal::CaptureStderr();
  {  // a loss that reaches them, autograd::grad (a gradient penalty's), frozen ones: nothing
    auto scaled = scale_loss(m.loss(batch(1)), opt);
    scaled.backward();
  }
  opt.zero_grad();
  {
    auto scaled = scale_loss(m.loss(batch(1)), opt);
    torch::autograd::grad({scaled.loss()}, m.params());
  }
  opt.zero_grad();
  for (auto& p : m.params()) p.requires_grad_(false);
  {
    auto scaled = scale_loss(other.loss(batch(2)), opt);
    scaled.backward();
  }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("gave no gradient"), std::string::npos) << err;
}

TEST_F(ScaleLossTest, StashedGradOfAParamUnusedByTheNextMicroBatchIsKept) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  {
    auto s = scale_loss(m.loss(batch(0)), opt);
    s.backward();
  }
  const auto first = grads(m.params());
  {  // only w1 gets a new gradient
    auto s = scale_loss((batch(1).mm(m.w1)).pow(2).mean(), opt);
    s.backward();
  }
  EXPECT_TRUE(at::equal(m.b1.grad(), first[1]));
  EXPECT_TRUE(at::equal(m.w2.grad(), first[2]));
  at::Tensor extra = m.w1.detach().clone().requires_grad_();
  (batch(1).mm(extra)).pow(2).mean().backward();
  EXPECT_TRUE(all_close(m.w1.grad(), first[0] + extra.grad(), testing::tolerance(at::kFloat)));
}

TEST_F(ScaleLossTest, MultipleLossesHaveTheirOwnScalersAndSeveralOptimizersShareALoss) {
  Options o;
  o.num_losses = 2;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt_a({m.w1, m.b1}, torch::optim::SGDOptions(0.1));
  torch::optim::Adam opt_b({m.w2}, torch::optim::AdamOptions(0.1));
  const auto expected = plain_grads(m, {0});
  {
    auto s = scale_loss(m.loss(batch(0)), {&opt_a, &opt_b}, {/*loss_id=*/1});
    EXPECT_TRUE(at::equal(s.loss(), m.loss(batch(0)) * 65536.0));
    s.backward();
  }
  EXPECT_TRUE(all_equal(grads(m.params()), expected));
  for (auto& p : m.params()) p.mutable_grad() = at::Tensor();
  {
    auto s = scale_loss(m.loss(batch(1)), {&opt_a, &opt_b}, {/*loss_id=*/1});
    s.backward();
    m.w2.grad()[0][0] = kInf;  // in the second optimizer's param
  }
  EXPECT_TRUE(loss_scaler(1).last_step_skipped());
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined());
  EXPECT_EQ(loss_scaler(1).loss_scale(), 32768.0);
  EXPECT_EQ(loss_scaler(0).loss_scale(), 65536.0);
  EXPECT_EQ(loss_scaler(0).skipped_steps(), 0);
}

// Apex's rule: with several guards before one step, an overflow in any of them skips the step.
// A plain step() cannot see an earlier guard's overflow (the later backward refills the grads);
// amp::step can.
TEST_F(ScaleLossTest, AmpStepSkipsWhenAnEarlierLossOfTheStepOverflowed) {
  Options o;
  o.num_losses = 2;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto before = clones(m.params());
  const auto state_before = serialized(opt);
  {
    auto s = scale_loss(m.loss(batch(0)), opt, /*loss_id=*/0);
    s.backward();
    m.w1.grad()[0][0] = kInf;
  }
  {
    auto s = scale_loss(m.loss(batch(1)), opt, /*loss_id=*/1);
    s.backward();
  }
  EXPECT_TRUE(loss_scaler(0).last_step_skipped());
  EXPECT_FALSE(loss_scaler(1).last_step_skipped());
  for (const auto& p : m.params()) EXPECT_TRUE(p.grad().defined()) << "refilled by loss 1";
  EXPECT_FALSE(step(opt));
  for (const auto& p : m.params()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(all_equal(clones(m.params()), before)) << "params changed on a skipped step";
  EXPECT_EQ(serialized(opt), state_before) << "optimizer state changed on a skipped step";

  // The record is consumed: the next clean step runs and equals a plain step.
  Model ref = m;
  for (auto* p : {&ref.w1, &ref.b1, &ref.w2}) *p = p->detach().clone().requires_grad_();
  torch::optim::SGD ref_opt(ref.params(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int id : {0, 1}) {
    auto s = scale_loss(m.loss(batch(2 + id)), opt, id);
    s.backward();
  }
  ref.loss(batch(2)).backward();
  ref.loss(batch(3)).backward();
  EXPECT_TRUE(step(opt));
  ref_opt.step();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(all_close(m.params()[i], ref.params()[i], testing::tolerance(at::kFloat))) << i;
  }
}

TEST_F(ScaleLossTest, AmpStepSkipsAccumulationWhoseEarlyMicroBatchOverflowed) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::Adam opt(m.params(), torch::optim::AdamOptions(1e-3));
  const auto before = clones(m.params());
  for (int b = 0; b < 3; ++b) {  // stashing accumulation (no delay_unscale)
    auto s = scale_loss(m.loss(batch(b)), opt);
    s.backward();
    if (b == 0) m.b1.grad()[1] = std::numeric_limits<float>::quiet_NaN();
  }
  EXPECT_FALSE(loss_scaler().last_step_skipped()) << "the last micro-batch was clean";
  EXPECT_FALSE(step(opt));
  EXPECT_TRUE(all_equal(clones(m.params()), before));
  EXPECT_TRUE(opt.state().empty()) << "Adam must not have created state";
}

TEST_F(ScaleLossTest, AmpStepRefusesScaledGradsAndStepsSeveralOptimizers) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt_a({m.w1, m.b1}, torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_b({m.w2}, torch::optim::SGDOptions(0.1));
  {
    auto s = scale_loss(m.loss(batch(0)), {&opt_a, &opt_b}, {0, /*delay_unscale=*/true});
    s.backward();
  }
  const auto before = clones(m.params());
  const auto scaled_grads = grads(m.params());
  OPTAMP_EXPECT_THROW_WITH(step({&opt_a, &opt_b}), c10::Error, "still holds scaled gradients",
                           "delay_unscale");
  EXPECT_TRUE(all_equal(grads(m.params()), scaled_grads)) << "a refused step changed grads";
  {
    auto s = scale_loss(m.loss(batch(1)), {&opt_a, &opt_b});
    s.backward();
  }
  EXPECT_TRUE(step({&opt_a, &opt_b}));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_FALSE(at::equal(m.params()[i], before[i])) << "param " << i << " was not stepped";
  }
  OPTAMP_EXPECT_THROW_WITH(step(std::vector<torch::optim::Optimizer*>{}), c10::ValueError,
                           "optimizers must not be empty");
}

TEST_F(ScaleLossTest, FixedScaleUnscalesAndSkipsOverflowsButKeepsItsScale) {
  Options o;
  o.loss_scale = LossScale::fixed(128.0);
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto expected = plain_grads(m, {0});
  {
    auto s = scale_loss(m.loss(batch(0)), opt);
    EXPECT_FALSE(loss_scaler().dynamic());
    EXPECT_TRUE(loss_scaler().checks_overflow());
    s.backward();
  }
  EXPECT_TRUE(all_equal(grads(m.params()), expected));
  overflowing_step(m, opt, 1);
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_FALSE(m.w1.grad().defined());
  EXPECT_EQ(loss_scaler().loss_scale(), 128.0);
  EXPECT_EQ(loss_scaler().skipped_steps(), 1);
}

TEST_F(ScaleLossTest, OverflowCheckOffIsApexsFixedScaleThatNeverSkips) {
  Options o;
  o.loss_scale = LossScale::fixed(128.0);
  o.overflow_check = false;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  EXPECT_FALSE(loss_scaler().checks_overflow());
  overflowing_step(m, opt, 1);
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  EXPECT_TRUE(m.w1.grad().defined());
  EXPECT_EQ(loss_scaler().loss_scale(), 128.0);
  EXPECT_EQ(loss_scaler().skipped_steps(), 0);
}

TEST_F(ScaleLossTest, ScaleStaysWithinMinAndMaxAndGrowsEveryInterval) {
  Options o;
  o.init_scale = 4.0;
  o.min_loss_scale = 1.0;
  o.max_loss_scale = 16.0;
  o.growth_interval = 2;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.0));
  std::vector<double> trajectory;
  for (int i = 0; i < 8; ++i) {
    {
      auto s = scale_loss(m.loss(batch(i)), opt);
      s.backward();
    }
    trajectory.push_back(loss_scaler().loss_scale());
  }
  EXPECT_EQ(trajectory, (std::vector<double>{4, 8, 8, 16, 16, 16, 16, 16}));
  for (int i = 0; i < 5; ++i) overflowing_step(m, opt, i);
  EXPECT_EQ(loss_scaler().loss_scale(), 1.0);
}

TEST_F(ScaleLossTest, FloorRaisesAfterTheBoundNamingTheNonFiniteParameters) {
  Options o;
  o.init_scale = 2.0;
  o.min_loss_scale = 1.0;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  overflowing_step(m, opt, 0);  // 2 -> 1: not yet at the floor
  EXPECT_EQ(loss_scaler().loss_scale(), 1.0);
  for (int64_t i = 1; i < LossScaler::kFloorSkipLimit; ++i) overflowing_step(m, opt, 0);
  EXPECT_EQ(loss_scaler().floor_skips(), LossScaler::kFloorSkipLimit - 1);
  OPTAMP_EXPECT_THROW_WITH(overflowing_step(m, opt, 0), c10::Error, "50 consecutive steps",
                           "min_loss_scale", "optimizer 0 param_groups[0].params[0]");
  try {
    overflowing_step(m, opt, 0);  // count 51: no error
  } catch (const c10::Error& e) {
    ADD_FAILURE() << e.what();
  }
  // Only the culprit is named.
  core::reset_loss_scalers();
  core::configure_loss_scalers(props(o));
  std::string message;
  for (int64_t i = 0; i <= LossScaler::kFloorSkipLimit && message.empty(); ++i) {
    try {
      overflowing_step(m, opt, 0);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
  }
  EXPECT_NE(message.find("params[0]"), std::string::npos) << message;
  EXPECT_EQ(message.find("params[1]"), std::string::npos) << message;
  EXPECT_FALSE(m.w1.grad().defined()) << "grads reset before the error";
}

TEST_F(ScaleLossTest, ErrorsAreClearAndLeaveStateUnchanged) {
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto loss = m.loss(batch(0));
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt), c10::Error, "call amp::initialize first");
  OPTAMP_EXPECT_THROW_WITH(loss_scaler(), c10::Error, "call amp::initialize first");
  OPTAMP_EXPECT_THROW_WITH(state_dict(), c10::Error, "call amp::initialize first");

  core::configure_loss_scalers(props());
  loss.backward(at::Tensor(), /*retain_graph=*/true);
  const auto grads_before = grads(m.params());
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt, /*loss_id=*/3), c10::ValueError,
                           "loss_id must be in [0, 1)", "got 3");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt, /*loss_id=*/-1), c10::ValueError, "got -1");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(at::ones({}, at::kLong), opt), c10::ValueError,
                           "loss must be a floating-point tensor", "Long");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(at::ones({0}, at::kFloat).requires_grad_(), opt),
                           c10::ValueError,
                           "loss must be a floating-point tensor with at least one", "[0]");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss.detach(), opt), c10::ValueError,
                           "loss must have a grad_fn", "requires_grad=False");
  {
    // The scaled loss made under no_grad had no grad_fn for the guard's hook: a crash until
    // 2026-12-06 (an error from Tensor::register_hook before that day's change).
    const torch::NoGradGuard no_grad;
    OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt), c10::ValueError,
                             "scale_loss must be entered with grad mode on");
  }
  torch::optim::SGD empty(std::vector<at::Tensor>{}, torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, empty), c10::ValueError,
                           "optimizer must have at least one parameter");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, std::vector<torch::optim::Optimizer*>{&opt, &empty}),
                           c10::ValueError, "optimizers[1] must have at least one parameter");
  OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, std::vector<torch::optim::Optimizer*>{}),
                           c10::ValueError, "optimizers must not be empty");
  {
    auto outer = scale_loss(loss, opt);
    OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt), c10::Error, "must not be nested",
                             "optimizer 0 param_groups[0].params[0]");
    outer.backward(std::nullopt, /*retain_graph=*/true);
    const auto scaled = grads(m.params());
    OPTAMP_EXPECT_THROW_WITH(step(opt), c10::Error, "amp::step: optimizer 0 param_groups[0]",
                             "is inside an active scale_loss guard");
    EXPECT_TRUE(all_equal(grads(m.params()), scaled)) << "a refused step changed grads";
  }
  // The failed calls changed nothing; only the outer guard's step counted.
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 1);
  EXPECT_EQ(loss_scaler().skipped_steps(), 0);
  for (size_t i = 0; i < grads_before.size(); ++i) {
    EXPECT_TRUE(
        all_close(m.params()[i].grad(), grads_before[i] * 2, testing::tolerance(at::kFloat)));
  }
}

// A guard holds its parameters against guards on other threads too (optimizers sharing a
// parameter), until it has finished; guards over other parameters run beside it.
TEST_F(ScaleLossTest, AGuardOnAnotherThreadHoldsItsParametersUntilItFinishes) {
  core::configure_loss_scalers(props());
  Model m;
  Model other(1);
  torch::optim::SGD first({m.w1, m.b1}, torch::optim::SGDOptions(0.1));
  torch::optim::SGD sharing({m.b1, m.w2}, torch::optim::SGDOptions(0.1));
  torch::optim::SGD separate(other.params(), torch::optim::SGDOptions(0.1));
  std::atomic<int> stage{0};
  std::thread holder([&] {
    auto s = scale_loss(m.loss(batch(0)), first);
    s.backward();
    stage = 1;
    while (stage.load() != 2) std::this_thread::yield();
  });
  while (stage.load() != 1) std::this_thread::yield();
  const auto before = grads(m.params());
  OPTAMP_EXPECT_THROW_WITH(scale_loss(m.loss(batch(1)), sharing), c10::Error, "must not be nested",
                           "optimizer 0 param_groups[0].params[0]");
  EXPECT_TRUE(all_equal(grads(m.params()), before)) << "the refused guard stashed nothing";
  {
    auto s = scale_loss(other.loss(batch(1)), separate);  // no shared parameter: runs beside it
    s.backward();
  }
  stage = 2;
  holder.join();
  auto s = scale_loss(m.loss(batch(1)), sharing);  // the holder has finished
  s.backward();
}

TEST_F(ScaleLossTest, ExceptionInsideTheGuardLeavesGradientsUnscaledAndDoesNotThrowAgain) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  {
    auto s = scale_loss(m.loss(batch(0)), opt);
    s.backward();
  }
  const auto before = grads(m.params());
  try {  // before the backward: the gradients of entry, bit for bit (rescaled and back)
    [[maybe_unused]] auto s = scale_loss(m.loss(batch(1)), opt);
    throw std::runtime_error("user error");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "user error");
  }
  EXPECT_TRUE(all_equal(grads(m.params()), before)) << "the accumulated grads are unscaled again";
  try {  // after it: what it added, unscaled (nothing stays multiplied by the scale)
    auto s = scale_loss(m.loss(batch(1)), opt);
    s.backward();
    throw std::runtime_error("user error");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "user error");
  }
  EXPECT_TRUE(all_equal(grads(m.params()), plain_grads(Model(), {0, 1})));
  EXPECT_EQ(loss_scaler().growth_tracker().item<int>(), 1) << "no update while unwinding";
  auto s = scale_loss(m.loss(batch(2)), opt);  // the guard was released
  s.backward();
}

TEST_F(ScaleLossTest, AGuardOutlivesReconfiguration) {
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  const auto expected = plain_grads(m, {0});
  {
    auto s = scale_loss(m.loss(batch(0)), opt);
    s.backward();
    core::reset_loss_scalers();  // the guard keeps its scaler alive
  }
  EXPECT_TRUE(all_equal(grads(m.params()), expected));
}

// Listeners stay registered for the process (step_events.h): later tests' threads call this one
// too (Robustness.* under --gtest_repeat), so the count is atomic.
std::atomic<int> g_notified{0};
void count_notification() { ++g_notified; }

TEST_F(ScaleLossTest, NotifiesWeightsMayChangeAfterEachNonDelayedUnscaleOnly) {
  detail::add_weights_may_change_listener(&count_notification);
  core::configure_loss_scalers(props());
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.1));
  g_notified = 0;
  {
    auto s = scale_loss(m.loss(batch(0)), opt, {0, /*delay_unscale=*/true});
    s.backward();
  }
  EXPECT_EQ(g_notified.load(), 0);
  {
    auto s = scale_loss(m.loss(batch(1)), opt);
    s.backward();
  }
  EXPECT_EQ(g_notified.load(), 1);
  overflowing_step(m, opt, 2);
  EXPECT_EQ(g_notified.load(), 2);
}

TEST_F(ScaleLossTest, StateDictRoundTripsBitExactThroughTorchSave) {
  Options o;
  o.num_losses = 2;
  o.hysteresis = 2;
  o.init_scale = 3.0;  // not a power of two
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.0));
  for (int i = 0; i < 3; ++i) overflowing_step(m, opt, i);
  {
    auto s = scale_loss(m.loss(batch(5)), opt, 1);
    s.backward();
  }
  const auto path = (std::filesystem::temp_directory_path() /
                     ("optamp_state_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  const StateDict saved = state_dict();
  torch::save(state_dict(), path);
  const double scale0 = loss_scaler(0).loss_scale();
  for (int i = 0; i < 4; ++i) overflowing_step(m, opt, i);  // move away
  EXPECT_NE(loss_scaler(0).loss_scale(), scale0);
  StateDict loaded;
  torch::load(loaded, path);
  std::remove(path.c_str());
  load_state_dict(loaded);
  ASSERT_EQ(loaded.keys(), saved.keys());
  const StateDict again = state_dict();
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(at::equal(again.items()[i].second, saved.items()[i].second))
        << saved.items()[i].first;
    EXPECT_EQ(again.items()[i].second.scalar_type(), saved.items()[i].second.scalar_type());
  }
  EXPECT_EQ(loss_scaler(0).loss_scale(), scale0);
  EXPECT_EQ(loss_scaler(0).skipped_steps(), 3);
  EXPECT_EQ(saved.at("loss_scaler0.hysteresis").item<int>(), 0);

  // Validation: nothing changes on error.
  StateDict partial;
  for (const auto& [k, v] : saved.items())
    if (k != "loss_scaler1.growth_tracker") partial.insert(k, v);
  for (int i = 0; i < 2; ++i) overflowing_step(m, opt, i);
  const StateDict current = state_dict();
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(partial), c10::ValueError,
                           "must contain 'loss_scaler1.growth_tracker'");
  StateDict one;
  for (const auto& [k, v] : saved.items())
    if (k.rfind("loss_scaler0.", 0) == 0) one.insert(k, v);
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(one), c10::ValueError, "num_losses=2", "got 1");
  StateDict wrong = saved;
  wrong.insert("loss_scaler1.scale", at::ones({}, at::kDouble));
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(wrong), c10::ValueError, "loss_scaler1.scale",
                           "float32");
  const StateDict after = state_dict();
  for (size_t i = 0; i < current.size(); ++i) {
    EXPECT_TRUE(at::equal(after.items()[i].second, current.items()[i].second));
  }
}

// 1,000 steps; inf/NaN injected into a random gradient at random steps. Every injected step is
// skipped, no other step is, params and optimizer state are bitwise unchanged by skipped steps,
// and the scale stays within [min, max].
TEST_F(ScaleLossTest, FaultInjectionThousandSteps) {
  Options o;
  o.init_scale = 1024.0;
  o.min_loss_scale = 1.0;
  o.max_loss_scale = 8192.0;
  o.growth_interval = 7;
  core::configure_loss_scalers(props(o));
  Model m;
  torch::optim::SGD opt(m.params(),
                        torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(1e-4));
  std::mt19937 rng(12345);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  const auto x = batch(0);
  int injected = 0, skipped = 0;
  for (int step = 0; step < 1000; ++step) {
    const bool inject = coin(rng) < 0.1;
    const auto params_before = clones(m.params());
    std::vector<at::Tensor> momentum_before;
    for (const auto& [key, state] : opt.state()) {
      momentum_before.push_back(
          static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer().clone());
    }
    for (auto& p : m.params()) p.mutable_grad() = at::Tensor();
    {
      auto s = scale_loss(m.loss(x + 0.01 * step), opt);
      s.backward();
      if (inject) {
        auto g = m.params()[rng() % 3].grad().view(-1);
        g[static_cast<int64_t>(rng() % g.numel())] = coin(rng) < 0.5 ? kInf : NAN;
      }
    }
    opt.step();
    injected += inject;
    skipped += loss_scaler().last_step_skipped();
    ASSERT_EQ(loss_scaler().last_step_skipped(), inject) << "step " << step;
    if (inject) {
      ASSERT_TRUE(all_equal(clones(m.params()), params_before)) << "step " << step;
      std::vector<at::Tensor> momentum_after;
      for (const auto& [key, state] : opt.state()) {
        momentum_after.push_back(
            static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer());
      }
      ASSERT_TRUE(all_equal(momentum_after, momentum_before)) << "step " << step;
    }
    const double s = loss_scaler().loss_scale();
    ASSERT_TRUE(s >= 1.0 && s <= 8192.0) << s;
  }
  EXPECT_GT(injected, 50);
  EXPECT_EQ(skipped, injected);
  EXPECT_EQ(loss_scaler().skipped_steps(), injected);
}

// One clean step and one overflowing step with a loss on `device`: the scaler's state lives
// there, the clean step's gradient is the unscaled one, the overflow skips and backs off.
void check_guard_keeps_state_on_the_loss_device(at::Device device) {
  core::configure_loss_scalers(props());
  // Made on the CPU and moved, so every device sees the same numbers (CUDA's generator differs).
  // x is small enough that the fp16 branch's gradient fits fp16 at the initial scale 2^16: d/d
  // out = 2^16 * 2 out / 12 stays below 65504 while |out| < 6 (here |out| < 2). The first GPU
  // run used CUDA-generated x ~ N(0, 1): |out| reached 6 and the clean step overflowed.
  at::manual_seed(0);
  auto w = at::randn({16, 4}).to(device).requires_grad_();
  auto wh = at::randn({16, 4}).to(device).to(at::kHalf).requires_grad_();
  torch::optim::SGD opt({w, wh}, torch::optim::SGDOptions(0.1));
  const auto x = (at::randn({3, 16}) / 16).to(device);
  auto loss = [&] { return (x.mm(w) + x.to(at::kHalf).mm(wh).to(at::kFloat)).pow(2).mean(); };
  loss().backward();
  const auto g_ref = w.grad().clone();
  w.mutable_grad() = at::Tensor();
  wh.mutable_grad() = at::Tensor();
  {
    auto s = scale_loss(loss(), opt);
    s.backward();
  }
  EXPECT_FALSE(loss_scaler().last_step_skipped());
  // The loss's device as the tensors report it (cuda:0), not the index-less one asked for.
  EXPECT_EQ(loss_scaler().scale_tensor().device(), w.device());
  EXPECT_EQ(w.device().type(), device.type());
  EXPECT_TRUE(all_close(w.grad(), g_ref, testing::tolerance(at::kFloat)));
  {
    auto s = scale_loss(loss(), opt);
    s.backward();
    wh.grad()[0][0] = kInf;
  }
  EXPECT_TRUE(loss_scaler().last_step_skipped());
  EXPECT_FALSE(w.grad().defined());
  EXPECT_EQ(loss_scaler().loss_scale(), 32768.0);
}

TEST_F(ScaleLossTest, GuardKeepsStateOnTheLossDevice) {
  check_guard_keeps_state_on_the_loss_device(at::kCPU);
}

TEST_F(ScaleLossTest, GuardOnCudaLossKeepsStateOnTheDevice_CUDA) {
  OPTAMP_SKIP_WITHOUT_CUDA();
  check_guard_keeps_state_on_the_loss_device(at::kCUDA);
}

// Labels are made from the optimizers' group sizes only when a message needs one.
TEST(ParamLabels, NameTheOptimizerTheGroupAndTheIndexWithinIt) {
  const auto label = core::optimizer_param_labels({{2, 1}, {3}});
  EXPECT_EQ(label(0), "optimizer 0 param_groups[0].params[0]");
  EXPECT_EQ(label(1), "optimizer 0 param_groups[0].params[1]");
  EXPECT_EQ(label(2), "optimizer 0 param_groups[1].params[0]");
  EXPECT_EQ(label(4), "optimizer 1 param_groups[0].params[1]");
  EXPECT_EQ(label(9), "param 9");
}

}  // namespace
}  // namespace amp
