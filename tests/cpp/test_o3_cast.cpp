// O3 casts the model itself: its parameters and batch-norm (unless keep_batchnorm_fp32), the
// optimizer's state made before initialize with them, and it warns about an Adam epsilon below
// fp16's range.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <string>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

TEST_F(Initialize, O3CastsTheModelAndKeepsItOverridable) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O3", quiet());
  EXPECT_EQ(net->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(net->bn->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(net->bn->running_var.scalar_type(), at::kHalf);
  // The optimizer still holds the very same tensors.
  EXPECT_TRUE(opt->param_groups()[0].params()[0].is_same(net->conv->weight));
  reset();
  Net kept = make_net();
  auto kept_opt = make_optimizer(kept, Opt::kSgd);
  Options o = quiet();
  o.keep_batchnorm_fp32 = true;
  initialize(kept, *kept_opt, "O3", o);
  EXPECT_EQ(kept->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(kept->bn->weight.scalar_type(), at::kFloat);
}

TEST_F(Initialize, O3CastsOptimizerStateMadeBeforeInitialize) {
  // O3 casts the parameters; Adam moments from an earlier step (and Adagrad's accumulators,
  // made by its constructor) must follow, or the next step mixes fp32 state with fp16 params.
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kAdam, 1e-4);
  auto b = make_batches(1).front();
  at::cross_entropy_loss(net->forward(b.x, b.tag), b.y).backward();
  opt->step();
  initialize(net, *opt, "O3", quiet());
  const auto& state = static_cast<torch::optim::AdamParamState&>(
      *opt->state().at(net->conv->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(net->conv->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(state.exp_avg().scalar_type(), at::kHalf);
  EXPECT_EQ(state.exp_avg_sq().scalar_type(), at::kHalf);
  const auto before = net->conv->weight.detach().clone();
  const double loss = train_step(net, *opt, b);  // the step runs, with fp16 state
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_FALSE(at::equal(before, net->conv->weight.detach()));
  reset();
  Net net2 = make_net();
  torch::optim::Adagrad adagrad(net2->parameters(), torch::optim::AdagradOptions(0.01));
  initialize(net2, adagrad, "O3", quiet());
  EXPECT_TRUE(std::isfinite(train_step(net2, adagrad, b)));
}

TEST_F(Initialize, O3WarnsAboutAdamEpsilonBelowFp16Range) {
  struct Capture : c10::WarningHandler {
    std::string text;
    void process(const c10::Warning& w) override { text += w.msg(); }
  } capture;
  c10::WarningUtils::WarningHandlerGuard guard(&capture);
  Net net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-8));
  initialize(net, opt, "O3", quiet());
  EXPECT_NE(capture.text.find("eps=1e-08"), std::string::npos) << capture.text;
}

}  // namespace
}  // namespace amp
