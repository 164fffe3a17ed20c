// The cast cache (docs/casting.md, "The cast cache"): one cast per weight and version, refreshed
// after in-place updates and optimizer steps, separate no_grad entries, dropped at the outermost
// region exit and by the scale_loss guard, bounded over many iterations.
#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cache/cast_cache.h"
#include "casting_test.h"
#include "common/step_events.h"
#include "simulated_capture.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the casting fixtures

TEST_F(Casting, CacheCastsEachWeightOncePerVersion) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto before = cast_count();
  at::mm(randn({2, 3}), w.t());
  at::mm(randn({2, 3}), w.t());  // t() is a view: a new TensorImpl, not cached, cast again
  EXPECT_EQ(cast_count() - before, 4);
  before = cast_count();
  at::linear(randn({2, 3}), w);
  at::linear(randn({2, 3}), w);
  at::linear(randn({2, 3}), w);
  EXPECT_EQ(cast_count() - before, 1 + 3);  // w once, each input once
  EXPECT_EQ(cache_size(), 1u);
}

std::size_t count_named(const std::vector<std::string>& names, const std::string& part) {
  return std::count_if(names.begin(), names.end(),
                       [&](const std::string& n) { return n.find(part) != std::string::npos; });
}

// A cached cast of a parameter records no ToCopyBackward node: its gradient edge is the
// parameter's grad accumulator, and the engine converts the fp16 gradient to fp32 on the way.
TEST_F(Casting, CachedCastsOfParametersRecordNoCastNode) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto b = randn({4}).requires_grad_();
  auto x = randn({2, 3});
  auto out = at::linear(x, w, b);  // w and b through the cache; x (not a leaf) cast as usual
  const auto names = graph_node_names(out);
  EXPECT_EQ(count_named(names, "ToCopyBackward"), 0u) << c10::Join(", ", names);
  EXPECT_EQ(count_named(names, "AccumulateGrad"), 2u) << c10::Join(", ", names);
  out.backward(at::ones_like(out));
  ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
  ASSERT_EQ(b.grad().scalar_type(), at::kFloat);
  // The same gradients as through ToCopyBackward: fp16 products, converted to fp32.
  const auto g16 = at::ones({2, 4}, at::kHalf);
  EXPECT_TRUE(at::equal(w.grad(), at::mm(g16.t(), x.to(at::kHalf)).to(at::kFloat)));
  EXPECT_TRUE(at::equal(b.grad(), g16.sum(0).to(at::kFloat)));
}

TEST_F(Casting, CacheRefreshesAfterInPlaceUpdates) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  auto first = at::linear(x, w);
  {
    c10::NoGradGuard no_grad;
    w.add_(1.0);  // bumps the version counter
  }
  auto second = at::linear(x, w);
  auto expected = at::linear(x.to(at::kHalf), w.detach().to(at::kHalf));
  EXPECT_TRUE(at::equal(second, expected));
  EXPECT_FALSE(at::equal(first, second));
  // Through .data() (LibTorch's optimizers): no version bump, so the step-boundary event.
  w.data().mul_(2.0);
  detail::notify_weights_may_change();
  EXPECT_EQ(cache_size(), 0u);
  auto third = at::linear(x, w);
  EXPECT_TRUE(at::equal(third, at::linear(x.to(at::kHalf), w.detach().to(at::kHalf))));
}

// A stale copy is released before its replacement is made, so the replacement does not take over
// the parameter's grad accumulator through it: on CUDA that node keeps the stream it was made on,
// and an eager copy replaced inside a graph capture would have the captured backward accumulate
// on the default stream. A node something else holds (a live graph) is shared, as torch keeps one
// accumulator per parameter.
TEST_F(Casting, AStaleCopyIsReleasedBeforeItsReplacementIsMade) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  const auto x = randn({2, 3});
  auto accumulator = [&w] {
    return std::weak_ptr<torch::autograd::Node>(torch::autograd::impl::try_get_grad_accumulator(w));
  };
  at::linear(x, w);  // the cached copy alone holds w's accumulator
  const auto eager = accumulator();
  ASSERT_FALSE(eager.expired());
  {
    const SimulatedCapture capture(5);
    at::linear(x, w);  // made eagerly: stale in the capture
    EXPECT_TRUE(eager.expired()) << "the capture's copy took over the eager copy's accumulator";
  }
  const auto captured = accumulator();
  ASSERT_FALSE(captured.expired());
  at::linear(x, w);  // the capture's copy is stale outside it
  EXPECT_TRUE(captured.expired());

  const auto kept = at::linear(x, w);  // its graph holds the accumulator too
  const auto shared = accumulator();
  {
    c10::NoGradGuard no_grad;
    w.add_(1.0);  // stale by its version
  }
  const auto after = at::linear(x, w);
  EXPECT_EQ(accumulator().lock(), shared.lock());
  (kept.sum() + after.sum()).backward();
  const auto g16 = at::ones({2, 4}, at::kHalf);
  EXPECT_TRUE(at::equal(w.grad(), (at::mm(g16.t(), x.to(at::kHalf)) * 2).to(at::kFloat)));
}

TEST_F(Casting, CacheSeparatesNoGradFromGradEntries) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    c10::NoGradGuard no_grad;
    autocast region;
    auto out = at::linear(x, w);
    EXPECT_FALSE(out.requires_grad());
    EXPECT_EQ(cache_size(), 1u);
  }
  EXPECT_EQ(cache_size(), 0u);  // leaving the outermost region dropped the entry
  {
    c10::NoGradGuard no_grad;
    autocast outer;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
    c10::GradMode::set_enabled(true);
    auto out = at::linear(x, w);  // must not reuse the history-free no_grad copy
    c10::GradMode::set_enabled(false);
    EXPECT_TRUE(out.requires_grad());
    EXPECT_EQ(cache_size(), 2u);
  }
  EXPECT_EQ(cache_size(), 0u);
}

TEST_F(Casting, CacheIsDroppedAtTheOutermostAutocastExitOnly) {
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    autocast outer;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
    {
      autocast inner(true, at::kBFloat16);
      at::linear(x, w);
      EXPECT_EQ(cache_size(), 2u);  // a bf16 copy next to the fp16 one
    }
    EXPECT_EQ(cache_size(), 2u) << "an inner exit must keep the entries";
    { autocast off(false); }
    { disable_casts no_casts; }
    EXPECT_EQ(cache_size(), 2u);
    at::linear(x, w);  // still served from the cache
    EXPECT_EQ(cache_size(), 2u);
  }
  EXPECT_EQ(cache_size(), 0u) << "the outermost exit must drop every entry";
  // The same when the thread is on through the level: entries made outside any region are
  // dropped by the region's exit too.
  enable("O1");
  at::linear(x, w);
  EXPECT_EQ(cache_size(), 1u);
  {
    autocast region;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
  }
  EXPECT_EQ(cache_size(), 0u);
}

TEST_F(Casting, CopiesMadeInsideKernelsAreNotServedToAutograd) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    // What a kernel's inner calls see: GradMode on, autograd keys excluded.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::linear(x, w);
  }
  auto out = at::linear(x, w);
  ASSERT_TRUE(out.requires_grad());
  out.sum().backward();
  EXPECT_TRUE(w.grad().defined());
}

TEST_F(Casting, CacheStaysBoundedOverManyIterations) {
  enable("O1");
  auto x = randn({2, 3});
  auto kept = randn({4, 3}).requires_grad_();  // a live parameter reused every iteration
  std::size_t peak = 0;
  const auto casts_before = cast_count();
  for (int i = 0; i < 1000; ++i) {
    auto w = randn({4, 3}).requires_grad_();  // a fresh parameter each iteration, then dropped
    at::linear(x, w);
    at::linear(x, kept);
    peak = std::max(peak, cache_size());
  }
  EXPECT_LE(peak, 200u);
  // Per iteration: x twice (not cacheable) and the fresh w; `kept` stays cached across sweeps.
  EXPECT_LE(cast_count() - casts_before, 3 * 1000 + 5);
}

// A model with more cached tensors than the first sweep's threshold (64) keeps them all, and its
// copies are made together, in one block (batched_cast.h): from the second step on up to 256
// tensors, from the third for 1000 (the first step keeps its first 256 through the sweeps, each
// step after it twice as many more). Before, every step's sweeps dropped copies it had just made.
TEST_F(Casting, ManyParametersStayCachedAndAreReCastTogether) {
  enable("O1");
  for (const auto& [params, first_whole_step] : {std::pair{200, 1}, std::pair{1000, 2}}) {
    std::vector<at::Tensor> weights;
    for (int i = 0; i < params; ++i) weights.push_back(randn({4, 3}).requires_grad_());
    for (int step = 0; step < 4; ++step) {
      std::vector<at::Tensor> copies;  // held through the step: freed blocks are reused
      std::set<const c10::StorageImpl*> blocks;
      for (const auto& w : weights) {
        copies.push_back(detail::cast_through_cache(w, at::kHalf).tensor);
        blocks.insert(copies.back().storage().unsafeGetStorageImpl());
      }
      if (step >= first_whole_step) {
        EXPECT_EQ(cache_size(), static_cast<std::size_t>(params)) << params << " step " << step;
        EXPECT_EQ(blocks.size(), 1u) << params << " step " << step;
      }
      copies.clear();
      detail::notify_weights_may_change();  // the step
    }
    EXPECT_EQ(detail::cache_entries_waiting_for_recast(), static_cast<std::size_t>(params));
    clear_cache();
  }
}

// FSDP2 frees a gathered parameter's storage (resize to 0 bytes) between its module's uses and
// gathers it again, in the same tensor, before the next: the next step's batch re-cast read such
// a parameter while another layer's use made the batch ("its data is not allocated yet"). It
// waits, and is re-cast with the next batch once its data is back.
TEST_F(Casting, ABatchReCastLeavesParametersWhoseStorageIsFreedForLater) {
  enable("O1");
  auto first = randn({4, 3}).requires_grad_();
  auto gathered = randn({4, 3}).requires_grad_();
  for (const auto& w : {first, gathered}) detail::cast_through_cache(w, at::kHalf);
  detail::notify_weights_may_change();  // the step
  const auto values = gathered.detach().clone();
  at::native::resize_bytes_cpu(gathered.storage().unsafeGetStorageImpl(), 0);  // resize_(0)
  auto copy = detail::cast_through_cache(first, at::kHalf);  // the batch: first only
  EXPECT_FALSE(copy.performed_cast);
  EXPECT_EQ(detail::cache_entries_waiting_for_recast(), 1u);
  at::native::resize_bytes_cpu(gathered.storage().unsafeGetStorageImpl(), values.nbytes());
  {
    at::NoGradGuard no_grad;  // gathered again
    gathered.copy_(values * 2);
  }
  auto regathered = detail::cast_through_cache(gathered, at::kHalf);
  EXPECT_FALSE(regathered.performed_cast);  // its own batch
  EXPECT_EQ(detail::cache_entries_waiting_for_recast(), 0u);
  EXPECT_TRUE(at::equal(regathered.tensor, (values * 2).to(at::kHalf)));
}

TEST_F(Casting, RealOptimizerStepIsSeenByTheNextForward) {
  // torch::optim::SGD updates through p.data(), which does not bump the version counter (Adam
  // in LibTorch 2.11 does bump it): the step-boundary event (raised by scale_loss after its
  // unscale) must drop the stale copy.
  enable("O1");
  auto x = randn({2, 3});
  auto w_sgd = randn({4, 3}).requires_grad_();
  auto w_adam = randn({4, 3}).requires_grad_();
  torch::optim::SGD sgd({w_sgd}, torch::optim::SGDOptions(0.5).momentum(0.9));
  torch::optim::Adam adam({w_adam}, torch::optim::AdamOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    (at::linear(x, w_sgd).to(at::kFloat).sum() + at::linear(x, w_adam).to(at::kFloat).sum())
        .backward();
    sgd.step();
    adam.step();
    sgd.zero_grad();
    adam.zero_grad();
    detail::notify_weights_may_change();
    for (const auto& w : {w_sgd, w_adam}) {
      EXPECT_TRUE(
          at::equal(at::linear(x, w), at::linear(x.to(at::kHalf), w.detach().to(at::kHalf))))
          << "stale working copy after step " << step;
    }
  }
}

// The same through the public loop: amp::initialize at O1, forward, the real scale_loss guard,
// the unchanged optimizer.step(); the next forward must see the stepped weights. (With SGD the
// version counter does not move, so without the guard's drop the copy would be served stale;
// checked once by refilling the cache between the guard and the step.)
TEST_F(CastingInitialized, ScaleLossGuardMakesRealOptimizerStepsVisible) {
  for (const bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "Adam" : "SGD");
    at::manual_seed(3);
    auto model = std::make_shared<OneWeight>();
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (adam) {
      optimizer =
          std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.1));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                      torch::optim::SGDOptions(0.5).momentum(0.9));
    }
    initialize(model, *optimizer, "O1", quiet());
    const at::Tensor& w = model->w;
    const auto x = randn({2, 3});
    auto fresh = [&] { return at::linear(x.to(at::kHalf), w.detach().to(at::kHalf)); };
    for (int step = 0; step < 4; ++step) {
      optimizer->zero_grad();
      const auto out = at::linear(x, w);
      ASSERT_EQ(out.scalar_type(), at::kHalf);
      EXPECT_TRUE(at::equal(out, fresh())) << "stale working copy at step " << step;
      EXPECT_EQ(cache_size(), 1u);
      {
        auto scaled = scale_loss(out.to(at::kFloat).pow(2).mean(), *optimizer);
        scaled.backward();
      }
      EXPECT_EQ(cache_size(), 0u) << "the guard's exit must drop the cached copy";
      const auto before = w.detach().clone();
      optimizer->step();
      ASSERT_FALSE(at::equal(w.detach(), before)) << "the step did not change the weight";
    }
    EXPECT_TRUE(at::equal(at::linear(x, w), fresh()));
    reset();
  }
}

}  // namespace
// The same step through the low-level pair (LossScaler::unscale, then update), which the
// Python front uses where a schedule runs the backward (torch.distributed.pipelining): update()
// ends the step for the cache as the guard's exit does. Before 2026-12-06 it did not, and every
// forward after the first ran on the first step's copy of an SGD-stepped weight.
TEST_F(CastingInitialized, LowLevelUnscaleAndUpdateMakeRealOptimizerStepsVisible) {
  at::manual_seed(3);
  auto model = std::make_shared<OneWeight>();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
  initialize(model, optimizer, "O1", quiet());
  const at::Tensor& w = model->w;
  const auto x = randn({2, 3});
  LossScaler& scaler = loss_scaler();
  for (int step = 0; step < 4; ++step) {
    optimizer.zero_grad();
    const auto out = at::linear(x, w);
    EXPECT_TRUE(at::equal(out, at::linear(x.to(at::kHalf), w.detach().to(at::kHalf))))
        << "stale working copy at step " << step;
    scaler.scale(out.to(at::kFloat).pow(2).mean()).backward();
    scaler.unscale({w.grad()});
    ASSERT_FALSE(scaler.update());
    EXPECT_EQ(cache_size(), 0u) << "update() must drop the cached copy";
    const auto before = w.detach().clone();
    optimizer.step();
    ASSERT_FALSE(at::equal(w.detach(), before)) << "the step did not change the weight";
  }
  reset();
}

}  // namespace amp
