// The session (csrc/core/session.h): initialize publishes a whole run in one step, reset
// publishes the empty one, and kernels on other threads see one or the other, never a mix.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "optamp/initialize.h"
#include "session.h"
#include "test_util.h"

namespace amp {
namespace {

using detail::current_level_rules;
using detail::current_session;
using detail::LevelRules;

// The two levels differ in every field a kernel reads, so a mix of them is recognizable.
Options level_options(OpLists lists) {
  Options o = testing::quiet();
  o.op_lists = lists;
  return o;
}

bool is_whole(const LevelRules& r) {
  const bool none = r.rules == RuleSet::kNone && r.low == c10::ScalarType::Undefined &&
                    r.op_lists == OpLists::kApex && r.verbosity == 1;
  const bool o1 = r.rules == RuleSet::kFullLists && r.low == c10::ScalarType::Half &&
                  r.op_lists == OpLists::kApex && r.verbosity == 0;
  const bool o4 = r.rules == RuleSet::kFullLists && r.low == c10::ScalarType::BFloat16 &&
                  r.op_lists == OpLists::kTorch && r.verbosity == 0;
  return none || o1 || o4;
}

TEST(Session, KernelsOnOtherThreadsSeeWholeLevelsWhileInitializeAndResetRun) {
  reset();
  torch::nn::Linear net(4, 4);
  std::atomic<bool> stop{false};
  std::atomic<int> mixed{0};
  std::atomic<std::int64_t> reads{0};
  std::thread reader([&] {
    while (!stop.load()) {
      if (!is_whole(current_level_rules())) mixed.fetch_add(1);
      reads.fetch_add(1);
    }
  });
  // On a loaded 2-core machine the 200 rounds can end before the reader is first scheduled.
  while (reads.load() == 0) std::this_thread::yield();
  for (int i = 0; i < 200; ++i) {
    torch::optim::SGD opt(net->parameters(), 0.1);
    initialize(net, opt, i % 2 ? "O4" : "O1",
               level_options(i % 2 ? OpLists::kTorch : OpLists::kApex));
    reset();
  }
  stop.store(true);
  reader.join();
  EXPECT_EQ(mixed.load(), 0) << "of " << reads.load() << " reads";
  EXPECT_GT(reads.load(), 0);
}

TEST(Session, InitializeBuildsOneSessionAndResetDropsIt) {
  reset();
  const auto before = current_session();
  EXPECT_FALSE(before->initialized);
  EXPECT_TRUE(before->loss_scalers.empty());
  torch::nn::Linear net(4, 4);
  torch::optim::SGD opt(net->parameters(), 0.1);
  Options o = testing::quiet();
  o.num_losses = 2;
  initialize(net, opt, "O2", o);
  const auto run = current_session();
  ASSERT_NE(run, before);
  EXPECT_TRUE(run->initialized);
  EXPECT_EQ(run->rules.rules, RuleSet::kMasterWeights);
  EXPECT_EQ(run->loss_scalers.size(), 2u);
  EXPECT_EQ(run->working_copy_sources.size(), 2u);  // weight and bias
  ASSERT_TRUE(run->optimizers.has_value());
  EXPECT_EQ(run->optimizers->count(&opt), 1u);
  ASSERT_NE(run->find_parameter(net->weight), nullptr);
  EXPECT_EQ(run->find_parameter(net->weight)->name, "weight");
  EXPECT_EQ(run->find_parameter(net->weight)->dtype, at::kFloat);
  // The published session is not edited in place: what a kernel holds stays as it was.
  reset();
  EXPECT_TRUE(run->initialized);
  EXPECT_EQ(run->loss_scalers.size(), 2u);
  const auto after = current_session();
  EXPECT_FALSE(after->initialized);
  EXPECT_TRUE(after->loss_scalers.empty());
  EXPECT_TRUE(after->working_copy_sources.empty());
  EXPECT_TRUE(after->parameters.empty());
}

TEST(Session, ARefusedInitializeLeavesTheSessionAsItWas) {
  reset();
  torch::nn::Linear net(4, 4);
  torch::optim::SGD opt(net->parameters(), 0.1);
  initialize(net, opt, "O1", testing::quiet());
  const auto run = current_session();
  torch::nn::Linear other(4, 4);
  torch::optim::SGD other_opt(other->parameters(), 0.1);
  EXPECT_THROW(initialize(other, other_opt, "O2", testing::quiet()), c10::ValueError);
  EXPECT_EQ(current_session(), run);
  reset();
}

// A kernel's thread keeps a snapshot of the session until its next call. When such a thread ends
// after a reset, its snapshot may be the last holder of the replaced session; destroying it there
// aborted a CUDA test's process at exit (the autograd engine's device threads end after the CUDA
// runtime began shutting down, and the replaced loss scaler's event could not be destroyed). The
// session is released by the next publish instead, on the publishing thread.
TEST(Session, AThreadThatEndsLeavesAReplacedSessionToTheNextPublish) {
  reset();
  torch::nn::Linear net(4, 4);
  torch::optim::SGD opt(net->parameters(), 0.1);
  initialize(net, opt, "O1", testing::quiet());
  const std::weak_ptr<const detail::Session> run = current_session();
  const std::weak_ptr<LossScaler> scaler = current_session()->loss_scalers.at(0);
  std::atomic<int> phase{0};
  std::thread worker([&] {
    EXPECT_EQ(current_level_rules().rules, RuleSet::kFullLists);  // takes its snapshot
    phase.store(1);
    while (phase.load() != 2) std::this_thread::yield();
  });
  while (phase.load() != 1) std::this_thread::yield();
  reset();
  EXPECT_FALSE(current_session()->initialized);  // this thread's snapshot moves on
  EXPECT_FALSE(run.expired()) << "the worker's snapshot holds the replaced session";
  phase.store(2);
  worker.join();
  EXPECT_FALSE(run.expired()) << "destroyed on the thread that ended";
  EXPECT_FALSE(scaler.expired());
  // A thread that ends holding the current session drops its reference and nothing else.
  std::thread([] { EXPECT_FALSE(current_session()->initialized); }).join();
  EXPECT_FALSE(run.expired());
  initialize(net, opt, "O1", testing::quiet());  // the next publish releases it here
  EXPECT_TRUE(run.expired());
  EXPECT_TRUE(scaler.expired());
  reset();
}

}  // namespace
}  // namespace amp
