// amp::ThreadState: a worker thread sees the initializing thread's optamp state (the O2
// working copies) under its guard, and its own state again after. One of the concurrency tests
// that scripts/sanitize.sh runs under ThreadSanitizer (Initialize.ThreadState*,
// sanitizers/thread_filter.txt).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

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
      thread_state_guard guard(state);
      carried = at::add(net->fc2->weight, 1.0).scalar_type();
    }
    after = at::add(net->fc2->weight, 1.0).scalar_type();
  }).join();
  EXPECT_EQ(plain, at::kFloat) << "threads start with optamp off";
  EXPECT_EQ(carried, at::kHalf) << "the worker must see the O2 working copy";
  EXPECT_EQ(after, at::kFloat) << "the guard must restore the worker's state";
}

}  // namespace
}  // namespace amp
