// LibTorch training patterns that just work after amp::initialize: an LR scheduler made before
// it keeps driving the optimizer (StepLR at O2), and gradient clipping right after the scale_loss
// guard sees the unscaled fp32 grads (and finds none after an overflow).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/schedulers/step_lr.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

// StepLR built before initialize keeps driving the (unchanged) optimizer: at O2 it steps the
// fp32 masters with the scheduled lr, exactly as at O0.
std::vector<at::Tensor> train_with_step_lr(const char* level, double* final_lr, double* first,
                                           double* last) {
  const auto batches = make_batches(4);
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);  // lr 0.05
  torch::optim::StepLR scheduler(*opt, /*step_size=*/2, /*gamma=*/0.5);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < 8; ++s) {
    const double loss = train_step(net, *opt, batches[s % batches.size()]);
    scheduler.step();
    if (s == 0) *first = loss;
    *last = loss;
  }
  EXPECT_EQ(loss_scaler(0).skipped_steps(), 0) << level;
  *final_lr = opt->param_groups()[0].options().get_lr();
  auto params = fp32_cpu_params(net);
  reset();
  return params;
}

TEST_F(Initialize, O2StepLrSchedulerStepsAlong) {
  double lr0 = 0, lr2 = 0, first0 = 0, last0 = 0, first = 0, last = 0;
  const auto reference = train_with_step_lr("O0", &lr0, &first0, &last0);
  const auto params = train_with_step_lr("O2", &lr2, &first, &last);
  // LibTorch's StepLR counts its step() calls from 0: 8 calls decay at the 2nd, 4th and 6th.
  EXPECT_DOUBLE_EQ(lr2, 0.05 * std::pow(0.5, 3));
  EXPECT_DOUBLE_EQ(lr2, lr0);
  EXPECT_LT(last, first);
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

double grad_norm(Net& net) {
  double sum = 0;
  for (const auto& p : net->parameters()) {
    if (p.grad().defined()) sum += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

// clip_grad_norm_ on model->parameters() right after the scale_loss guard: the grads are the
// unscaled fp32 grads of the masters, so the total norm it returns is the fp32 one (not
// loss_scale times it), clipping works, and training tracks fp32 training with clipping.
TEST_F(Initialize, O2GradClippingAfterTheGuardSeesUnscaledGrads) {
  const auto batches = make_batches(4);
  constexpr int kSteps = 6;
  // fp32 reference (no amp): the total grad norm of every step, clipped the same way.
  Net ref = make_net();
  auto ref_opt = make_optimizer(ref, Opt::kSgd);
  std::vector<double> ref_norms;
  double max_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto& b = batches[s % batches.size()];
    ref_opt->zero_grad();
    at::cross_entropy_loss(ref->forward(b.x, b.tag), b.y).backward();
    if (s == 0) max_norm = 0.5 * grad_norm(ref);  // so that clipping acts
    ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm));
    ref_opt->step();
  }
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  double first = 0, last = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto& b = batches[s % batches.size()];
    opt->zero_grad();
    const auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
    {
      auto scaled = scale_loss(loss, *opt);
      scaled.backward();
    }
    ASSERT_GT(loss_scaler(0).loss_scale(), 1000.0) << "scaled grads would be this much larger";
    ASSERT_FALSE(loss_scaler(0).last_step_skipped());
    const double total = torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
    EXPECT_NEAR(total, ref_norms[s], 0.02 * ref_norms[s]) << "step " << s;
    EXPECT_NEAR(grad_norm(net), std::min(total, max_norm), 1e-3 * max_norm) << "step " << s;
    for (const auto& p : net->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    opt->step();
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, first);
  const auto params = fp32_cpu_params(net);
  const auto reference = fp32_cpu_params(ref);
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

// After an overflow the guard leaves the grads undefined: clipping finds nothing (returns 0)
// and the plain step changes nothing.
TEST_F(Initialize, O2GradClippingAfterAnOverflowIsANoOp) {
  const auto b = make_batches(1).front();
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O2", quiet());
  const auto before = fp32_cpu_params(net);
  opt->zero_grad();
  const auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  {
    auto scaled = scale_loss(loss * std::numeric_limits<float>::infinity(), *opt);
    scaled.backward();
  }
  EXPECT_TRUE(loss_scaler(0).last_step_skipped());
  EXPECT_EQ(torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0), 0.0);
  opt->step();
  const auto after = fp32_cpu_params(net);
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << i;
}

}  // namespace
}  // namespace amp
