// amp::hold_records_for_swap / restore_records_after_swap (optamp/tensor_swap.h): what the Python
// front's torch.utils.swap_tensors wrapper calls around an exchange of two TensorImpls, which
// torch refuses while anything holds a weak reference to either (tests/python covers the swap).
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <string>
#include <vector>

#include "dispatch/substitution.h"
#include "dispatch/substitution_call.h"
#include "mlp_model.h"
#include "optamp/cast_cache.h"
#include "optamp/initialize.h"
#include "optamp/scale_loss.h"
#include "optamp/tensor_swap.h"
#include "session.h"
#include "test_util.h"

namespace amp {
namespace {

using testing::Mlp;

// Weak references to `t`'s TensorImpl (intrusive_ptr counts one more while strong ones exist).
std::size_t weak_references(const at::Tensor& t) {
  return t.getIntrusivePtr().weak_use_count() - 1;
}

at::Tensor loss_of(Mlp& net, int step) {
  at::manual_seed(step);
  return net->forward(at::randn({6, 8})).to(at::kFloat).pow(2).mean();
}

// Two micro-batches (the first with delay_unscale: its scaled gradients wait in the guards'
// records) and a step. `between` runs between them.
std::vector<at::Tensor> accumulate_and_step(Mlp& net, torch::optim::SGD& opt,
                                            const std::function<void()>& between) {
  opt.zero_grad();
  {
    auto scaled = scale_loss(loss_of(net, 0), opt, ScaleLossOptions{0, /*delay_unscale=*/true});
    scaled.backward();
  }
  between();
  {
    auto scaled = scale_loss(loss_of(net, 1), opt);
    scaled.backward();
  }
  opt.step();
  return testing::snapshot(net->parameters());
}

class TensorSwap : public ::testing::TestWithParam<std::string> {
 protected:
  void TearDown() override { reset(); }
};

TEST_P(TensorSwap, AHoldLeavesNoWeakReferenceAndRestoreBringsEveryRecordBack) {
  const std::string level = GetParam();
  reset();
  at::manual_seed(0);
  Mlp twin;
  at::manual_seed(0);
  Mlp net;  // the same initial weights
  torch::optim::SGD twin_opt(twin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  initialize(twin, twin_opt, level, testing::quiet());
  const auto expected = accumulate_and_step(twin, twin_opt, [] {});
  reset();

  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  initialize(net, opt, level, testing::quiet());
  const at::Tensor weight = net->fc1->weight;
  const bool substituted = level == "O2" || level == "O5";
  const auto got = accumulate_and_step(net, opt, [&] {
    // A copy of the session, as a thread's snapshot taken before the hold keeps it.
    const auto earlier = detail::current_session();
    ASSERT_GT(weak_references(weight), 0u) << "the session, the cache and the guards' records";
    const at::Tensor other = at::empty_like(weight);
    auto hold = hold_records_for_swap(weight, other);
    EXPECT_EQ(weak_references(weight), 0u) << "torch.utils.swap_tensors would refuse it";
    EXPECT_EQ(detail::current_session()->find_parameter(weight), nullptr);
    EXPECT_EQ(earlier->find_parameter(weight), nullptr) << "released in every copy";
    EXPECT_FALSE(detail::carries_substitution_key(weight));
    restore_records_after_swap(*hold, weight, other);  // not swapped: back where they were
    const auto* record = detail::current_session()->find_parameter(weight);
    ASSERT_NE(record, nullptr);
    EXPECT_EQ(record->name, "fc1.weight");
    EXPECT_EQ(detail::carries_substitution_key(weight), substituted);
    EXPECT_FALSE(detail::carries_substitution_key(other));
    EXPECT_THROW(restore_records_after_swap(*hold, weight, other), c10::Error);
  });
  // The delayed micro-batch's gradients stayed marked as scaled: unscaled once, as without the
  // hold, and at O2/O5 the weight was read as its working copy again.
  EXPECT_TRUE(testing::bit_equal(got, expected));
}

TEST_P(TensorSwap, RecordsFollowTheTensorThatHoldsTheOtherImplAfterTheSwap) {
  reset();
  Mlp net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, GetParam(), testing::quiet());
  const at::Tensor weight = net->fc2->weight;
  // After torch.utils.swap_tensors(weight, other) the Python object `weight` holds `other`'s
  // TensorImpl: restoring with the two exchanged says so.
  const at::Tensor other = weight.detach().clone().requires_grad_();
  auto hold = hold_records_for_swap(weight, other);
  restore_records_after_swap(*hold, other, weight);
  const auto session = detail::current_session();
  EXPECT_EQ(session->find_parameter(weight), nullptr);
  const auto* record = session->find_parameter(other);
  ASSERT_NE(record, nullptr);
  EXPECT_EQ(record->name, "fc2.weight");
  const bool substituted = GetParam() == "O2" || GetParam() == "O5";
  EXPECT_EQ(detail::carries_substitution_key(other), substituted);
  EXPECT_EQ(detail::is_working_copy_source(other), substituted);
  EXPECT_FALSE(detail::carries_substitution_key(weight));
  // And back, inside a batch (one session published at its end): a moved parameter's entries
  // share one reference, and the second move must still find both.
  {
    SwapBatch batch;
    auto back = hold_records_for_swap(other, weight);
    restore_records_after_swap(*back, weight, other);
    EXPECT_EQ(detail::current_session()->find_parameter(weight), nullptr) << "not yet published";
  }
  ASSERT_NE(detail::current_session()->find_parameter(weight), nullptr);
  EXPECT_EQ(detail::current_session()->find_parameter(weight)->name, "fc2.weight");
  EXPECT_EQ(detail::is_working_copy_source(weight), substituted);
  EXPECT_EQ(detail::carries_substitution_key(weight), substituted);
  EXPECT_FALSE(detail::is_working_copy_source(other));
}

TEST(TensorSwapErrors, UndefinedTensorsAreRefusedByName) {
  EXPECT_THROW(
      {
        try {
          hold_records_for_swap(at::Tensor(), at::zeros({1}));
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("an undefined a"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::ValueError);
}

INSTANTIATE_TEST_SUITE_P(Levels, TensorSwap, ::testing::Values("O0", "O1", "O2", "O4", "O5"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace amp
