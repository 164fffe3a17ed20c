// O2's fp16 working copies of the fp32 master weights: one per parameter, reused across
// micro-batches, refreshed by every step and never stale (CPU and CUDA); views see the copy,
// ops that make their own data (clone, to) stay fp32, and no_grad runs fp32.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cache/cast_cache.h"
#include "initialize_test.h"
#include "optamp/amp.h"
#include "optamp/core.h"
#include "optamp/fused_optimizers.h"
#include "simulated_capture.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

// InitializeOnDevice's one instantiation (initialize_test.h): it also runs the fixture's tests in
// the other files (test_reset.cpp).
INSTANTIATE_TEST_SUITE_P(Devices, InitializeOnDevice, testing::kDevices, testing::on_device);

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

// The working copy ops see for `master` now (through a view, which is substituted).
at::Tensor working_copy(const at::Tensor& master) { return master.view(master.sizes()); }

// The working copies ops see now, one per reduced parameter (held: their storages cannot be
// freed and their addresses reused while the test compares them).
std::vector<at::Tensor> working_copies(Net& net) {
  std::vector<at::Tensor> copies;
  for (const auto& p : net->named_parameters()) {
    if (!is_batchnorm_param(p.key())) copies.push_back(working_copy(p.value()));
  }
  return copies;
}

// The distinct storages (blocks) `copies` live in.
std::set<const c10::StorageImpl*> storages_of(const std::vector<at::Tensor>& copies) {
  std::set<const c10::StorageImpl*> blocks;
  for (const auto& t : copies) blocks.insert(t.storage().unsafeGetStorageImpl());
  return blocks;
}

// After the first step, a step's working copies are made together at the first use of any of
// them: one block per device and dtype (batched_cast.h), one multi-tensor copy. Between steps
// none is held: the optimizer step runs without them, as it did when each was cast on its own.
TEST_P(InitializeOnDevice, O2WorkingCopiesAreMadeTogetherAndFreedBeforeTheStep) {
  Net net = make_net_on(GetParam());
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto batches = batches_on(GetParam(), 3);
  std::size_t reduced_params = 0;
  for (const auto& p : net->named_parameters()) reduced_params += !is_batchnorm_param(p.key());
  for (int step = 0; step < 3; ++step) {
    const auto& b = batches[step % batches.size()];
    opt->zero_grad();
    auto out = net->forward(b.x, b.tag);
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
    {
      const auto copies = working_copies(net);
      for (const auto& c : copies) storages.emplace_back(c.storage().getWeakStorageImpl());
      // The first step casts each on its own: no step before it said which to make together.
      EXPECT_EQ(storages_of(copies).size(), step == 0 ? reduced_params : 1u) << "step " << step;
    }
    {
      auto scaled = scale_loss(at::cross_entropy_loss(out, b.y), *opt);
      scaled.backward();
    }
    out.reset();  // its graph saved some of the copies
    for (const auto& storage : storages) EXPECT_TRUE(storage.expired()) << "step " << step;
    EXPECT_EQ(detail::cache_entries_waiting_for_recast(), reduced_params);
    opt->step();
  }
  expect_copies_are_rounded_masters(net, "after the batched re-casts");
}

// Forward, loss and a scale_loss guard's backward on `b`: the guard's end is the event after
// which the cache's copies are made again.
void scaled_backward(Net& net, torch::optim::Optimizer& opt, const Batch& b) {
  auto scaled = scale_loss(at::cross_entropy_loss(net->forward(b.x, b.tag), b.y), opt);
  scaled.backward();
}

// A copy something still holds (here a graph kept with retain_graph) keeps the values it was made
// with: the next step's copies are new tensors.
TEST_F(Initialize, O2ACopyAKeptGraphHoldsKeepsItsValues) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto batches = batches_on(at::kCPU, 2);
  const auto& w = net->fc2->weight;
  auto kept_loss = at::cross_entropy_loss(net->forward(batches[0].x, batches[0].tag), batches[0].y);
  kept_loss.backward({}, /*retain_graph=*/true);
  const at::Tensor first_grad = w.grad().clone();
  scaled_backward(net, *opt, batches[1]);
  opt->step();                                 // the weights change
  net->forward(batches[1].x, batches[1].tag);  // the batched re-cast
  opt->zero_grad();
  kept_loss.backward();  // the kept graph again: its copies still hold the first step's weights
  EXPECT_TRUE(at::equal(w.grad(), first_grad));
  expect_copies_are_rounded_masters(net, "after the re-cast beside a kept graph");
}

// A parameter frozen, then thawed, between steps: the re-cast copy sends it a gradient exactly
// when it wants one.
TEST_F(Initialize, O2ReCastFollowsAParameterFrozenAndThawedBetweenSteps) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto batches = batches_on(at::kCPU, 3);
  auto& w = net->fc2->weight;
  for (int step = 0; step < 3; ++step) {
    opt->zero_grad();
    w.requires_grad_(step != 1);
    scaled_backward(net, *opt, batches[step]);
    EXPECT_EQ(w.grad().defined(), step != 1) << "step " << step;
    EXPECT_TRUE(net->fc1->weight.grad().defined()) << "step " << step;
  }
}

// How many of `a`'s storages are among `b`'s.
std::size_t shared_storages(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  const auto in_b = storages_of(b);
  std::size_t shared = 0;
  for (const auto& t : a) shared += in_b.count(t.storage().unsafeGetStorageImpl());
  return shared;
}

// An O2 net after one step: from now on a step's copies are made together at the first use.
struct O2AfterAStep {
  Net net = make_net();
  std::unique_ptr<torch::optim::Optimizer> opt = make_optimizer(net, Opt::kSgd);
  O2AfterAStep() {
    initialize(net, *opt, "O2", quiet());
    scaled_backward(net, *opt, batches_on(at::kCPU, 1)[0]);
    opt->step();
  }
};

// A CUDA graph reads what its capture used by address. A copy made before a capture is not served
// inside it (the graph would keep reading it after the next step frees it: make_graphed_callables
// captures a forward after eager warm-up forwards), and a copy made inside one holds nothing
// until a replay, so it is not served outside. Capture simulated on the CPU (simulated_capture.h).
TEST_F(Initialize, O2CopiesAreServedOnlyInTheCaptureTheyWereMadeIn) {
  const O2AfterAStep o2;
  Net net = o2.net;
  const auto eager = working_copies(net);  // the step's batched re-cast, outside a capture
  const std::size_t n = eager.size();
  EXPECT_EQ(shared_storages(working_copies(net), eager), n);  // served again outside
  std::vector<at::Tensor> captured;
  {
    const testing::SimulatedCapture capture(7);
    captured = working_copies(net);
    EXPECT_EQ(shared_storages(captured, eager), 0u);
    EXPECT_EQ(shared_storages(working_copies(net), captured), n);  // served again inside
    expect_copies_are_rounded_masters(net, "inside the capture");
  }
  {
    const testing::SimulatedCapture another(8);
    EXPECT_EQ(shared_storages(working_copies(net), captured), 0u);
  }
  const auto after = working_copies(net);
  EXPECT_EQ(shared_storages(after, captured), 0u);
  EXPECT_EQ(shared_storages(after, eager), 0u);  // the capture replaced the eager entries
  expect_copies_are_rounded_masters(net, "after the capture");
}

// The whole-step recipe: the step before the capture ends a generation, so the captured forward's
// first use makes the batch inside the capture, and the next eager use makes its own.
TEST_F(Initialize, O2TheFirstUseInACaptureMakesTheStepsBatchThere) {
  const O2AfterAStep o2;
  Net net = o2.net;
  std::vector<at::Tensor> captured;
  {
    const testing::SimulatedCapture capture(3);
    captured = working_copies(net);
  }
  EXPECT_EQ(storages_of(captured).size(), 1u);  // one batch
  EXPECT_EQ(shared_storages(working_copies(net), captured), 0u);
  expect_copies_are_rounded_masters(net, "after the captured batch");
}

// docs/loss_scaling.md's capture recipe with an eager forward just before the capture (the Python
// test_cuda_graph_replays_match_eager_steps_bit_for_bit[...-True], which failed at O2 on the fourth
// GPU run): that forward makes the step's batch, whose copies share their gradient buckets' nodes
// (buckets on, as on a GPU), and the nodes hold the parameters' grad accumulators, made on the
// eager stream. Inside the capture none of those accumulators may live on, or the captured
// backward accumulates on the eager stream (CUDA refuses it during a capture).
// Through the model boundary too (the seventh run's failure of the same Python test, which calls
// the model as Python users do): the eager forward's fp32 output offered its reduced output as the
// loss's companion, and the thread kept that companion, with the whole graph of the forward, until
// the next step's end: its nodes held the accumulators into the capture.
TEST_F(Initialize, ACaptureAfterAnEagerForwardMakesItsOwnAccumulators) {
  struct CpuBucketsOn {  // a GPU's default, for this test only (also when it fails midway)
    CpuBucketsOn() { set_gradient_buckets_on_cpu(true); }
    ~CpuBucketsOn() { set_gradient_buckets_on_cpu(false); }
  } const buckets_on;
  for (const bool boundary : {false, true}) {
    for (const char* level : {"O2", "O5"}) {
      SCOPED_TRACE(std::string(level) + (boundary ? " through amp::forward" : ""));
      Net net = make_net();
      // A capture needs an optimizer that skips on the device (no host sync in the step).
      auto opt = std::make_unique<FusedSGD>(net->parameters(), torch::optim::SGDOptions(0.05));
      initialize(net, *opt, level, quiet());
      const auto batches = batches_on(at::kCPU, 2);
      scaled_backward(net, *opt, batches[0]);
      opt->step();
      opt->zero_grad();
      if (boundary) {  // never stepped: its copies stay cached
        amp::forward(net, batches[1].x, batches[1].tag);
      } else {
        net->forward(batches[1].x, batches[1].tag);
      }
      std::vector<std::weak_ptr<torch::autograd::Node>> eager;
      for (const auto& p : net->parameters()) {
        std::weak_ptr<torch::autograd::Node> acc(
            torch::autograd::impl::try_get_grad_accumulator(p));
        if (!acc.expired()) eager.push_back(acc);  // held by a cached copy
      }
      EXPECT_GE(eager.size(), 4u);
      {
        const testing::SimulatedCapture capture(11);
        const at::Tensor logits = net->forward(batches[1].x, batches[1].tag);
        for (std::size_t i = 0; i < eager.size(); ++i) {
          EXPECT_TRUE(eager[i].expired())
              << "an eager accumulator lived on in the capture (" << i << ")";
        }
        auto scaled = scale_loss(at::cross_entropy_loss(logits, batches[1].y), *opt);
        scaled.backward();
      }
      opt->step();
      reset();
    }
  }
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
  // Comparisons of the parameter's own values see the master: allclose of the fp16 copy and an
  // fp32 tensor raised, and a composite's inner ops would have compared rounded values.
  const at::Tensor saved = w.detach().clone();
  EXPECT_TRUE(at::allclose(w, saved, /*rtol=*/0, /*atol=*/0));
  EXPECT_TRUE(at::isclose(w, saved, /*rtol=*/0, /*atol=*/0).all().item<bool>());
  EXPECT_EQ(w.resolve_conj().scalar_type(), at::kFloat);
  auto x = at::randn({2, 16});
  at::matmul(x, w.t());
  const auto before = cast_count();
  at::matmul(x, w.t());
  EXPECT_EQ(cast_count() - before, 1);  // x only: w's copy is reused through the view
  // No substitution without autograd recording (validation in fp32 by default).
  c10::NoGradGuard no_grad;
  EXPECT_EQ(net->fc2->forward(x).scalar_type(), at::kFloat);
}

// Complex values made from parameters come from the fp32 masters: the working copies made
// complex32 at O2 (`w * 1j`, `view_as_complex`), which the CPU cannot exponentiate, and
// view_as_complex of O5's bf16 copy failed (an S4D layer keeps its complex state as real
// pairs). A complex scalar (an unboxed kernel's argument) and a complex tensor (the boxed
// fallback's) both count; real arithmetic still sees the copy.
struct PairsNetImpl : torch::nn::Module {
  PairsNetImpl()
      : pairs(register_parameter("pairs", at::randn({4, 8, 2}))),
        fc(register_module("fc", torch::nn::Linear(8, 4))) {}
  at::Tensor pairs;
  torch::nn::Linear fc;
};
TORCH_MODULE(PairsNet);

TEST_F(Initialize, O2O5ComplexValuesAreMadeFromTheMasters) {
  for (const char* level : {"O2", "O5"}) {
    reset();
    PairsNet net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    initialize(net, opt, level, quiet());
    const at::Tensor& w = net->pairs;
    const at::Tensor master = w.detach().clone();
    const at::Tensor times_i = w * c10::Scalar(c10::complex<double>(0, 1));
    EXPECT_EQ(times_i.scalar_type(), at::kComplexFloat) << level;
    EXPECT_TRUE(at::equal(at::imag(times_i), master)) << level;
    const at::Tensor complex = at::view_as_complex(w);
    EXPECT_EQ(complex.scalar_type(), at::kComplexFloat) << level;
    EXPECT_TRUE(at::equal(at::view_as_real(complex), master)) << level;
    EXPECT_TRUE(at::equal(at::exp(complex), at::exp(at::view_as_complex(master)))) << level;
    const at::Tensor zeros = at::zeros({4, 8, 2}, at::kComplexFloat);
    const at::Tensor chosen = at::where(at::ones({4, 8, 2}, at::kBool), w, zeros);
    EXPECT_TRUE(at::equal(at::real(chosen), master)) << level;
    EXPECT_NE((w * 2).scalar_type(), at::kFloat) << level;  // real ops: the working copy
    // The gradient reaches the master through the complex values.
    at::abs(complex).sum().add(at::imag(times_i).sum()).backward();
    ASSERT_TRUE(w.grad().defined()) << level;
    EXPECT_EQ(w.grad().scalar_type(), at::kFloat) << level;
  }
}

// A float64 buffer (a frequency table, a noise schedule) keeps its values at O2/O5: its fp16/bf16
// working copy rounded `t * freqs` while the result stayed float64 (1 + 1e-9 became 1). A float8
// buffer stays float8 for the kernels that take it (`_scaled_mm` refused its fp16 copy). fp32
// buffers beside them are still read as working copies.
struct TablesNetImpl : torch::nn::Module {
  TablesNetImpl()
      : fc(register_module("fc", torch::nn::Linear(4, 4))),
        freqs(register_buffer("freqs", at::tensor({1.0, 1e-3, 1e-6, 1.0 + 1e-9}, at::kDouble))),
        shift(register_buffer("shift", at::tensor({0.1F, 0.2F, 0.3F, 0.4F}))),
        weight8(register_buffer("weight8", at::eye(16).to(at::kFloat8_e4m3fn))) {}
  torch::nn::Linear fc;
  at::Tensor freqs, shift, weight8;
};
TORCH_MODULE(TablesNet);

TEST_F(Initialize, O2O5Float64AndFloat8BuffersKeepTheirValues) {
  for (const char* level : {"O2", "O5"}) {
    reset();
    TablesNet net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    initialize(net, opt, level, quiet());
    const at::Tensor times = at::arange(3, at::kDouble).unsqueeze(1) * net->freqs;
    EXPECT_EQ(times.scalar_type(), at::kDouble) << level;
    EXPECT_TRUE(at::equal(times[1], net->freqs)) << level;
    EXPECT_EQ((net->freqs * 1).scalar_type(), at::kDouble) << level;
    EXPECT_NE((net->shift * 1).scalar_type(), at::kFloat) << level;  // fp32: its working copy
    const at::Tensor x8 = at::ones({16, 16}).to(at::kFloat8_e4m3fn);
    const at::Tensor one = at::ones({});
    const at::Tensor product =
        at::_scaled_mm(x8, net->weight8.t(), one, one, {}, {}, at::kFloat);  // took fp16 before
    EXPECT_TRUE(at::equal(product, at::ones({16, 16}))) << level;
  }
}

// Norms that track running statistics (an InstanceNorm at any O2/O5, a batch norm under
// keep_batchnorm_fp32=false) update them in place, though their schemas do not say so: the
// update reaches the fp32 buffers (it used to go to a dropped working copy, and evaluation then
// used the initial statistics). Compared with the same forwards in fp32.
struct StatsNetImpl : torch::nn::Module {
  StatsNetImpl()
      : conv(register_module("conv", torch::nn::Conv1d(3, 6, 3))),
        in(register_module(
            "in", torch::nn::InstanceNorm1d(
                      torch::nn::InstanceNorm1dOptions(6).affine(true).track_running_stats(true)))),
        bn(register_module("bn", torch::nn::BatchNorm1d(6))) {}
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = conv->forward(x);  // statistics well away from 0 (x is shifted)
    return bn->forward(h) + in->forward(h);
  }
  torch::nn::Conv1d conv;
  torch::nn::InstanceNorm1d in;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(StatsNet);

// A StatsNet in fp32 and its twin initialized at `level` with its norms registered
// (keep_batchnorm_fp32=false), the same weights (seeded, as the other tests' twins).
std::pair<StatsNet, StatsNet> stats_nets(const char* level, const at::Device& device) {
  at::manual_seed(0);
  StatsNet reference;
  at::manual_seed(0);
  StatsNet net;
  reference->to(device);
  net->to(device);
  Options options = quiet();
  options.keep_batchnorm_fp32 = false;
  initialize(net, std::string(level), options);
  return {reference, net};
}

TEST_P(InitializeOnDevice, O2O5RunningStatisticsOfRegisteredNormsFollowTraining) {
  for (const char* level : {"O2", "O5"}) {
    auto [reference, net] = stats_nets(level, GetParam());
    for (int step = 0; step < 3; ++step) {
      const auto x = at::randn({4, 3, 8}, at::TensorOptions(GetParam())) + 2.0 * step;
      reference->forward(x);
      net->forward(x);
    }
    c10::NoGradGuard no_grad;  // reads the fp32 buffers themselves
    const auto low = std::string(level) == "O2" ? at::kHalf : at::kBFloat16;
    const auto buffers = net->named_buffers();
    const auto expected_buffers = reference->named_buffers();
    for (const char* name :
         {"in.running_mean", "in.running_var", "bn.running_mean", "bn.running_var"}) {
      ASSERT_NE(buffers.find(name), nullptr) << name;
      const at::Tensor& got = buffers[name];
      const at::Tensor& expected = expected_buffers[name];
      EXPECT_EQ(got.scalar_type(), at::kFloat) << level << " " << name;
      EXPECT_TRUE(testing::all_close(got, expected, testing::tolerance(low)))
          << level << " " << name << ": " << got << " vs " << expected;
    }
    reset();
  }
}

// The same norms given an fp32 input (an activation an fp32 tensor made in the forward promoted,
// a model input left as given) read the fp32 masters: their kernels refuse fp32 input with
// reduced weights ("mixed dtype (CPU): expect parameter to have scalar type of Float"), and fp32
// is what the input asks for. The outputs and the statistics equal the fp32 run's bit for bit
// (nothing is reduced on this path), and the gradients reach the fp32 masters.
TEST_P(InitializeOnDevice, O2O5NormsGivenFp32InputReadTheMasters) {
  for (const char* level : {"O2", "O5"}) {
    auto [reference, net] = stats_nets(level, GetParam());
    for (int step = 0; step < 2; ++step) {
      const auto h = at::randn({4, 6, 8}, at::TensorOptions(GetParam())) + 2.0 * step;
      const at::Tensor expected = reference->bn->forward(h) + reference->in->forward(h);
      const at::Tensor got = net->bn->forward(h) + net->in->forward(h);
      EXPECT_EQ(got.scalar_type(), at::kFloat) << level;
      EXPECT_TRUE(at::equal(got, expected)) << level << " step " << step;
      got.sum().backward();
    }
    EXPECT_EQ(net->bn->weight.grad().scalar_type(), at::kFloat) << level;
    c10::NoGradGuard no_grad;
    const auto buffers = net->named_buffers();
    const auto expected_buffers = reference->named_buffers();
    for (const char* name :
         {"in.running_mean", "in.running_var", "bn.running_mean", "bn.running_var"}) {
      EXPECT_TRUE(at::equal(buffers[name], expected_buffers[name])) << level << " " << name;
    }
    c10::AutoGradMode grad_mode(true);  // after the comparison: this forward updates them too
    const auto low = std::string(level) == "O2" ? at::kHalf : at::kBFloat16;
    const auto reduced = at::randn({4, 6, 8}, at::TensorOptions(GetParam())).to(low);
    EXPECT_EQ(net->bn->forward(reduced).scalar_type(), low)
        << level << ": reduced input still meets the working copies";
    reset();
  }
}

// core::working_copy_dtype() is what the Python front's compile mode substitutes with: the dtype
// ops see the registered tensors in, whether or not the boundary casts the inputs.
TEST_F(Initialize, TheWorkingCopyDtypeFollowsTheGateNotTheInputCast) {
  for (const bool cast_inputs : {true, false}) {
    reset();
    StatsNet net;
    Options options = quiet();
    options.cast_model_inputs = cast_inputs;
    initialize(net, std::string("O5"), options);
    EXPECT_EQ(core::working_copy_dtype(), at::kBFloat16) << cast_inputs;
    EXPECT_EQ(core::model_boundary(nullptr).inputs,
              cast_inputs ? at::kBFloat16 : at::ScalarType::Undefined);
    {
      c10::NoGradGuard no_grad;  // the gate: ops see the fp32 masters
      EXPECT_EQ(core::working_copy_dtype(), at::ScalarType::Undefined) << cast_inputs;
    }
    {
      disable_casts off;
      EXPECT_EQ(core::working_copy_dtype(), at::ScalarType::Undefined) << cast_inputs;
    }
  }
  reset();
  EXPECT_EQ(core::working_copy_dtype(), at::ScalarType::Undefined);
  StatsNet net;
  initialize(net, std::string("O1"), quiet());
  EXPECT_EQ(core::working_copy_dtype(), at::ScalarType::Undefined);  // no working copies
}

// core::call_reads_masters (the compile mode's question) answers from the casting kernel's own
// plan: a layer norm given an fp32 input beside O2's fp16 weights is widened and reads the
// masters, as the eager call shows; given fp16 input it runs on the working copies.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl()
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})))) {
    at::NoGradGuard no_grad;
    norm->weight.fill_(1.0 / 3.0);  // not exact in fp16
    norm->bias.fill_(0.1);
  }
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(NormNet);

TEST_F(Initialize, CallsTheKernelWidensToFp32ReadTheMastersAsTheirDescriptionsSay) {
  NormNet net;
  initialize(net, std::string("O2"), quiet());
  const at::Tensor& weight = net->norm->weight;
  const at::Tensor& bias = net->norm->bias;
  const auto x = at::randn({2, 4});
  const at::Tensor eager = at::layer_norm(x, {4}, weight, bias);
  at::Tensor masters;
  {
    disable_casts off;
    masters = at::layer_norm(x, {4}, weight, bias);
  }
  EXPECT_EQ(eager.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(eager, masters)) << "the fp32 masters' values, not fp16's 1/3";
  using core::TracedTensor;
  const TracedTensor model{at::kFloat, true, true};
  EXPECT_TRUE(core::call_reads_masters("aten::layer_norm", c10::DeviceType::CPU,
                                       {{at::kFloat, false, true}, model, model}, at::kFloat,
                                       false));
  EXPECT_FALSE(core::call_reads_masters("aten::layer_norm", c10::DeviceType::CPU,
                                        {{at::kHalf, false, true}, model, model}, at::kHalf,
                                        false));
  EXPECT_FALSE(core::call_reads_masters("aten::linear", c10::DeviceType::CPU,
                                        {{at::kFloat, false, true}, model, model}, at::kFloat,
                                        false))
      << "lower: the working copies";
  EXPECT_FALSE(
      core::call_reads_masters("aten::relu", c10::DeviceType::CPU, {model}, at::kFloat, false))
      << "in no table";
  reset();
  EXPECT_FALSE(core::call_reads_masters("aten::layer_norm", c10::DeviceType::CPU,
                                        {{at::kFloat, false, true}, model, model}, at::kFloat,
                                        false))
      << "not initialized: no working copies";
}

// View ops hand a registered buffer its own data: a write through the view reaches the buffer
// (it used to reach a view of the dropped working copy), and a read of the view still sees the
// working dtype. A parameter's view is a view of its working copy, as before.
struct BufferNetImpl : torch::nn::Module {
  BufferNetImpl()
      : fc(register_module("fc", torch::nn::Linear(4, 4))),
        memory(register_buffer("memory", at::zeros({3, 4}))),
        table(register_buffer("table", at::arange(8.0).view({2, 4}))) {}  // itself a view
  torch::nn::Linear fc;
  at::Tensor memory;
  at::Tensor table;
};
TORCH_MODULE(BufferNet);

TEST_P(InitializeOnDevice, O2O5WritesThroughABuffersViewReachTheBuffer) {
  for (const char* level : {"O2", "O5"}) {
    BufferNet net;
    net->to(GetParam());
    initialize(net, std::string(level), quiet());
    const auto low = std::string(level) == "O2" ? at::kHalf : at::kBFloat16;
    const auto on = at::TensorOptions(GetParam());
    net->memory.select(0, 0).copy_(at::ones({4}, on));
    net->memory.slice(0, 1, 2).fill_(2.0);
    net->memory.select(0, 2).add_(3.0);
    net->memory.narrow(0, 0, 1).mul_(5.0);
    const auto row = net->table.slice(0, 0, 1);
    EXPECT_EQ(row.scalar_type(), at::kFloat) << "a buffer's view is its own data";
    const auto x = at::ones({1, 4}, on.dtype(low)).requires_grad_();
    EXPECT_EQ((x + row).scalar_type(), low) << level << ": read as the working dtype";
    EXPECT_EQ(at::mul(row, x).scalar_type(), low) << level;
    EXPECT_EQ(net->fc->weight.t().scalar_type(), low) << "a parameter's view: its working copy";
    c10::NoGradGuard no_grad;
    const auto expected = at::tensor({5.0, 2.0, 3.0}, on).unsqueeze(1).expand({3, 4});
    EXPECT_TRUE(at::equal(net->memory, expected)) << level << "\n" << net->memory;
    EXPECT_TRUE(at::equal(net->table, at::arange(8.0, on).view({2, 4}))) << level;
    reset();
  }
}

}  // namespace
}  // namespace amp
