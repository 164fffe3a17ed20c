// The gradients of a step's batched copies, converted a bucket at a time
// (cache/gradient_buckets.h): from the second step on no parameter's gradient is converted on its
// own, the values are the engine's own conversions' bit for bit, buckets follow the forward's order
// and their byte bound, and what must keep its own conversion keeps it (gradient hooks, a second
// use in a step).
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cache/gradient_buckets.h"
#include "casting_test.h"
#include "common/step_events.h"
#include "simulated_capture.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the casting fixtures
using testing::SimulatedCapture;
using torch::autograd::Node;

// The distinct ConvertGradientsBackward nodes reachable from `root`, each as the parameters its
// outputs go to (in input order), in the order a depth-first walk meets them.
std::vector<std::vector<const c10::TensorImpl*>> buckets_of(const at::Tensor& root) {
  std::vector<std::vector<const c10::TensorImpl*>> buckets;
  std::set<const Node*> seen;
  std::vector<const Node*> todo{root.grad_fn().get()};
  while (!todo.empty()) {
    const Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    if (n->name() == "ConvertGradientsBackward") {
      auto& params = buckets.emplace_back();
      for (const auto& edge : n->next_edges()) {
        const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(edge.function.get());
        params.push_back(acc ? acc->variable.unsafeGetTensorImpl() : nullptr);
      }
    }
    for (const auto& edge : n->next_edges()) todo.push_back(edge.function.get());
  }
  return buckets;
}

std::size_t half_to_copies(const std::function<void()>& fn) {
  const auto dtypes = first_input_dtypes("aten::_to_copy", fn);
  return std::count(dtypes.begin(), dtypes.end(), at::kHalf);
}

// Buckets on for CPU tensors (a GPU's default) while a test runs.
class CpuBuckets : public Casting {
 protected:
  void SetUp() override { set_gradient_buckets_on_cpu(true); }
  void TearDown() override {
    set_gradient_buckets_on_cpu(false);
    Casting::TearDown();
  }
};

class GradientBucketsTest : public CpuBuckets {
 protected:
  // Six linears with biases, 8 wide: what a step casts at O1.
  void SetUp() override {
    CpuBuckets::SetUp();
    at::manual_seed(0);
    for (int i = 0; i < 6; ++i) {
      weights.push_back(randn({8, 8}).mul_(0.3).requires_grad_());
      biases.push_back(randn({8}).requires_grad_());
    }
    x = randn({3, 8});
  }
  at::Tensor forward() {
    at::Tensor h = x;
    for (std::size_t i = 0; i < weights.size(); ++i)
      h = at::relu(at::linear(h, weights[i], biases[i]));
    return h.to(at::kFloat).sum();
  }
  // Each parameter once (a test may tie two layers' weights).
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> all;
    std::set<const c10::TensorImpl*> seen;
    for (const auto* list : {&weights, &biases}) {
      for (const auto& p : *list) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) all.push_back(p);
      }
    }
    return all;
  }
  // The parameters' gradients (an empty tensor for none), which are then reset.
  std::vector<at::Tensor> grads_and_reset() {
    std::vector<at::Tensor> out;
    for (auto& p : params()) {
      out.push_back(p.grad().defined() ? p.grad().clone() : at::empty({0}));
      p.mutable_grad().reset();
    }
    return out;
  }
  // The gradients with every copy made on its own (the cache forgotten first): each keeps its
  // source's edge and the engine converts each gradient, as before buckets.
  std::vector<at::Tensor> reference_grads() {
    clear_cache();
    forward().backward();
    auto grads = grads_and_reset();
    clear_cache();
    return grads;
  }
  void move_to(const at::Device& device) {
    for (auto* list : {&weights, &biases}) {
      for (auto& p : *list) p = p.detach().to(device).requires_grad_();
    }
    x = x.to(device);
  }
  void expect_no_gradient_converted_on_its_own_from_the_second_step();

  std::vector<at::Tensor> weights, biases;
  at::Tensor x;
};

void GradientBucketsTest::expect_no_gradient_converted_on_its_own_from_the_second_step() {
  enable("O1");
  const auto expected = reference_grads();
  for (int step = 0; step < 3; ++step) {
    const at::Tensor loss = forward();
    const auto buckets = buckets_of(loss);
    const std::size_t conversions = half_to_copies([&] { loss.backward(); });
    if (step == 0) {
      EXPECT_TRUE(buckets.empty());
      EXPECT_EQ(conversions, 12u) << "one per parameter, by the engine";
    } else {
      ASSERT_EQ(buckets.size(), 1u) << "step " << step;
      EXPECT_EQ(buckets[0].size(), 12u);
      EXPECT_EQ(conversions, 0u) << "step " << step;
    }
    EXPECT_TRUE(bit_equal(grads_and_reset(), expected)) << "step " << step;
    detail::notify_weights_may_change();
  }
}

TEST_F(GradientBucketsTest, FromTheSecondStepNoGradientIsConvertedOnItsOwn) {
  expect_no_gradient_converted_on_its_own_from_the_second_step();
}

// On CUDA the conversion is torch's multi-tensor copy's fast path (fp16 in, fp32 out).
TEST_F(GradientBucketsTest, FromTheSecondStepNoGradientIsConvertedOnItsOwn_CUDA) {
  OPTAMP_SKIP_WITHOUT_CUDA();
  move_to(at::kCUDA);
  expect_no_gradient_converted_on_its_own_from_the_second_step();
}

// An eager forward right before a CUDA graph capture (the fourth GPU run's failure, O2 with a
// forward that was never stepped): its batched copies share bucket nodes, which hold their
// parameters' grad accumulators, made on the eager stream. The capture's copies must make
// accumulators of their own, or the captured backward accumulates on that stream, which CUDA
// refuses inside a capture. Releasing one stale copy at a time left its bucket (and the
// accumulators) alive through the bucket's other copies; every copy from outside the capture goes
// at its first use inside it.
TEST_F(GradientBucketsTest, ACaptureAfterAnEagerForwardMakesNewAccumulators) {
  enable("O1");
  forward().backward();
  grads_and_reset();
  detail::notify_weights_may_change();
  std::vector<at::Tensor> expected;
  {
    const at::Tensor eager_loss = forward();  // the step's batch, bucketed; never stepped
    ASSERT_EQ(buckets_of(eager_loss).size(), 1u);
    eager_loss.backward();  // its graph goes; the cached copies still hold the bucket
    expected = grads_and_reset();
  }
  std::vector<std::weak_ptr<Node>> eager;
  for (const auto& p : params()) {
    eager.emplace_back(torch::autograd::impl::try_get_grad_accumulator(p));
    ASSERT_FALSE(eager.back().expired());
  }
  {
    const SimulatedCapture capture(4);
    const at::Tensor captured_loss = forward();
    for (std::size_t i = 0; i < eager.size(); ++i) {
      EXPECT_TRUE(eager[i].expired()) << "parameter " << i << " kept the eager accumulator";
    }
    captured_loss.backward();
  }
  EXPECT_TRUE(bit_equal(grads_and_reset(), expected));
}

TEST_F(GradientBucketsTest, MicroBatchesAndASecondUseConvertEachUseOnItsOwnAndSumInFp32) {
  enable("O1");
  at::Tensor tied_weight = weights[0];
  weights[3] = tied_weight;  // used twice per forward
  biases[3] = randn({8}).requires_grad_();
  const auto once = reference_grads();
  for (int step = 0; step < 3; ++step) {
    forward().backward();
    forward().backward();  // a second micro-batch: the same copies, used again
    const auto grads = grads_and_reset();
    for (std::size_t i = 0; i < grads.size(); ++i) {
      // Two equal micro-batches: each parameter's gradient twice over (exact in fp32: x + x).
      EXPECT_TRUE(at::equal(grads[i], once[i] * 2)) << "step " << step << " parameter " << i;
    }
    detail::notify_weights_may_change();
  }
}

// A weight used twice in one forward: its gradient is the sum, in fp32, of each use's converted
// gradient: the sum of two separate weights' gradients, bit for bit (the first use's conversion
// goes through the bucket, the second through the engine).
TEST_F(CpuBuckets, ATiedWeightsUsesSumInFp32AtEveryStep) {
  enable("O1");
  at::manual_seed(1);
  auto w = randn({6, 6}).requires_grad_();
  auto w_first = w.detach().clone().requires_grad_();
  auto w_second = w.detach().clone().requires_grad_();
  auto x = randn({3, 6});
  for (int step = 0; step < 3; ++step) {
    at::linear(at::tanh(at::linear(x, w)), w).to(at::kFloat).pow(2).sum().backward();
    at::linear(at::tanh(at::linear(x, w_first)), w_second).to(at::kFloat).pow(2).sum().backward();
    EXPECT_TRUE(at::equal(w.grad(), w_first.grad() + w_second.grad())) << "step " << step;
    for (auto* t : {&w, &w_first, &w_second}) t->mutable_grad().reset();
    detail::notify_weights_may_change();
  }
}

TEST_F(GradientBucketsTest, HookedGradientsKeepTheirOwnConversion) {
  enable("O1");
  const auto expected = reference_grads();
  int tensor_hook_calls = 0;
  int accumulator_hook_calls = 0;
  weights[1].register_hook([&](const at::Tensor& g) {
    ++tensor_hook_calls;
    return g;
  });
  // What DDP's reducer registers: a post hook on the parameter's grad accumulator.
  struct CountingPostHook : torch::autograd::FunctionPostHook {
    int* calls;
    explicit CountingPostHook(int* c) : calls(c) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      ++*calls;
      return outputs;
    }
  };
  const auto accumulator = torch::autograd::impl::grad_accumulator(weights[2]);
  accumulator->add_post_hook(std::make_unique<CountingPostHook>(&accumulator_hook_calls));
  EXPECT_FALSE(detail::GradientBuckets::admits(weights[1]));
  EXPECT_TRUE(detail::GradientBuckets::admits(weights[3]));
  set_gradient_buckets_on_cpu(false);
  EXPECT_FALSE(detail::GradientBuckets::admits(weights[3])) << "off for the CPU by default";
  set_gradient_buckets_on_cpu(true);
  EXPECT_FALSE(detail::GradientBuckets::admits(weights[2]));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor loss = forward();
    const auto buckets = buckets_of(loss);
    loss.backward();
    if (step > 0) {
      ASSERT_EQ(buckets.size(), 1u);
      const std::set<const c10::TensorImpl*> bucketed(buckets[0].begin(), buckets[0].end());
      EXPECT_EQ(bucketed.size(), 10u);
      EXPECT_EQ(bucketed.count(weights[1].unsafeGetTensorImpl()), 0u);
      EXPECT_EQ(bucketed.count(weights[2].unsafeGetTensorImpl()), 0u);
    }
    EXPECT_TRUE(bit_equal(grads_and_reset(), expected)) << "step " << step;
    detail::notify_weights_may_change();
  }
  EXPECT_EQ(tensor_hook_calls, 3);
  EXPECT_EQ(accumulator_hook_calls, 3);
}

// torch::autograd::grad for some parameters computes theirs only; create_graph records the
// conversions (a gradient penalty differentiates through them): as the engine's own.
TEST_F(GradientBucketsTest, PartialAndDifferentiableGradsMatchTheEnginesConversions) {
  enable("O1");
  auto grads_of = [&](bool create_graph) {
    const at::Tensor loss = forward();
    auto g = torch::autograd::grad({loss}, {weights[0], biases[5]}, {}, create_graph, create_graph);
    at::Tensor penalty = g[0].pow(2).sum() + g[1].pow(2).sum();
    if (create_graph) penalty.backward();
    return std::vector<at::Tensor>{g[0].detach(), g[1].detach(), penalty.detach()};
  };
  for (const bool create_graph : {false, true}) {
    SCOPED_TRACE(create_graph ? "create_graph" : "grad");
    clear_cache();
    const auto expected = grads_of(create_graph);
    const auto expected_grads = create_graph ? grads_and_reset() : std::vector<at::Tensor>{};
    clear_cache();
    for (int step = 0; step < 3; ++step) {
      EXPECT_TRUE(bit_equal(grads_of(create_graph), expected)) << "step " << step;
      if (create_graph) {
        EXPECT_TRUE(bit_equal(grads_and_reset(), expected_grads)) << "step " << step;
      } else {
        for (const auto& p : params()) EXPECT_FALSE(p.grad().defined());
        // Copies into fp32: the forward's cast of the loss, and two gradients converted (not one
        // per parameter).
        const auto into = first_input_dtypes("aten::copy_", [&] { grads_of(false); });
        EXPECT_EQ(std::count(into.begin(), into.end(), at::kFloat), 1 + 2) << "step " << step;
      }
      detail::notify_weights_may_change();
    }
  }
}

// Buckets hold consecutive copies in the order the step used them, up to kBucketBytes each, and
// run as their last gradient arrives, while the backward goes on.
TEST_F(CpuBuckets, BucketsFollowTheForwardsOrderAndRunDuringTheBackward) {
  enable("O1");
  at::manual_seed(2);
  const int n = 24;  // 2 MiB fp16 copies: 48 MiB, more than one bucket
  std::vector<at::Tensor> ws;
  for (int i = 0; i < n; ++i) ws.push_back(randn({1024, 1024}).mul_(0.03).requires_grad_());
  std::vector<at::Tensor> used(ws.rbegin(), ws.rend());  // used in the reverse of making
  auto forward = [&] {
    at::Tensor h = randn({1, 1024});
    for (const auto& w : used) h = at::linear(h, w);
    return h.to(at::kFloat).sum();
  };
  forward().backward();
  detail::notify_weights_may_change();
  const at::Tensor loss = forward();
  auto buckets = buckets_of(loss);
  ASSERT_EQ(buckets.size(), 2u);
  std::sort(buckets.begin(), buckets.end(),
            [&](const auto& a, const auto& b) { return a.size() > b.size(); });
  const std::int64_t per_copy = 1024 * 1024 * 2;
  EXPECT_EQ(static_cast<std::int64_t>(buckets[0].size()),
            detail::GradientBuckets::kBucketBytes / per_copy);
  std::size_t next = 0;
  for (const auto& bucket : buckets) {
    for (const auto* p : bucket) {
      EXPECT_EQ(p, used[next].unsafeGetTensorImpl()) << "position " << next;
      ++next;
    }
  }
  EXPECT_EQ(next, used.size());

  const std::vector<std::string> ran = backward_nodes_run([&] { loss.backward(); });
  const auto first_bucket = std::find_if(ran.begin(), ran.end(), [](const std::string& s) {
    return s.find("ConvertGradientsBackward") != std::string::npos;
  });
  ASSERT_NE(first_bucket, ran.end()) << c10::Join(", ", ran);
  const auto mm_after = std::count_if(first_bucket, ran.end(), [](const std::string& s) {
    return s.find("MmBackward") != std::string::npos;
  });
  EXPECT_GE(mm_after, static_cast<long>(buckets[0].size()) - 1)
      << "the first bucket ran when the backward had ended: " << c10::Join(", ", ran);
}

}  // namespace
}  // namespace amp
