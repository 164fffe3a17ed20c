// amp::initialize's argument checks: bad models, optimizers, optimizer state and level options are
// refused with a message naming the argument, and a refused initialize changes nothing (optamp
// stays off, no model is cast).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>

#include <string>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

struct IntOnlyImpl : torch::nn::Module {
  IntOnlyImpl() { register_parameter("counts", at::zeros({3}, at::kLong), false); }
};
TORCH_MODULE(IntOnly);

void expect_untouched(Net& net) {
  EXPECT_FALSE(is_initialized());
  EXPECT_FALSE(is_casting_enabled());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST_F(Initialize, ErrorModelWithoutFloatingParams) {
  IntOnly model;
  OPTAMP_EXPECT_THROW_WITH(initialize(model, "O1", quiet()), c10::ValueError,
                           "floating-point parameter");
  EXPECT_FALSE(is_initialized());
}

// Apex's check: a model .half()'d before initialize has no fp32 weights for O1/O2 to keep.
TEST_F(Initialize, ErrorReducedTrainableParametersWhereTheLevelKeepsFp32Weights) {
  for (const char* level : {"O1", "O2", "O4", "O5"}) {
    Net net = make_net();
    net->fc1->weight.set_data(net->fc1->weight.detach().to(at::kHalf));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, level, quiet()), c10::ValueError,
                             "trainable parameters must be torch.float32 at opt_level", level,
                             "fc1.weight", "torch.float16", "cast_model_type=False");
    EXPECT_FALSE(is_initialized()) << level;
    EXPECT_EQ(net->conv->weight.scalar_type(), at::kFloat) << level;
  }
  // Accepted: O3 (casts the model anyway), nothing cast, and frozen reduced parameters.
  for (const char* level : {"O0", "O3", "O2_nothing_cast", "O2_frozen"}) {
    Net net = make_net();
    net->fc1->weight.set_data(net->fc1->weight.detach().to(at::kHalf));
    Options o = quiet();
    const std::string name = level;
    if (name == "O2_nothing_cast") o.cast_model_type = ScalarType::Undefined;
    if (name == "O2_frozen") net->fc1->weight.set_requires_grad(false);
    EXPECT_NO_THROW(initialize(net, name.substr(0, 2), o)) << level;
    reset();
  }
}

TEST_F(Initialize, ErrorOptimizerParamsNotInModel) {
  Net net = make_net();
  Net other = make_net();
  torch::optim::SGD opt(other->parameters(), torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O3", quiet()), c10::ValueError,
                           "optimizer 0 parameter 0", "must be a parameter of the model");
  expect_untouched(net);
}

// At O1/O4 models are not cast, so a parameter of no model passed (learned loss weights) is taken
// and loss-scaled like the model's; it was refused at every level before 2026-12-06.
TEST_F(Initialize, OptimizerParamsOutsideTheModelsAreTakenWhereModelsAreNotCast) {
  for (const char* level : {"O1", "O4"}) {
    Net net = make_net();
    auto weights = torch::zeros({2}).requires_grad_();
    std::vector<at::Tensor> params = net->parameters();
    params.push_back(weights);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    auto handle = initialize(net, opt, level, quiet());
    {
      auto scaled = scale_loss((weights.exp() * 3).sum(), opt);
      scaled.backward();
    }
    EXPECT_TRUE(weights.grad().allclose(torch::full({2}, 3.0))) << level << ": unscaled";
    reset();
  }
  Net net = make_net();
  std::vector<at::Tensor> params = net->parameters();
  params.push_back(torch::zeros({2}).requires_grad_());
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O2", quiet()), c10::ValueError,
                           "parameter of no module, such as learned loss weights");
  expect_untouched(net);
}

// Such a parameter keeps the dtype initialize saw: a loss that casts its own weights to its
// input's dtype (pytorch-metric-learning's ArcFaceLoss: `W.data = W.data.to(emb.dtype)`) is
// refused at the next scale_loss with the remedy, before anything is scaled or stepped; with fp32
// input it trains.
TEST_F(Initialize, AParameterOfNoModelCastSinceIsRefusedWithTheRemedy) {
  for (const char* level : {"O1", "O4"}) {
    Net net = make_net();
    auto centers = torch::randn({4, 3}).requires_grad_();
    std::vector<at::Tensor> params = net->parameters();
    params.push_back(centers);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    Options o = quiet();
    o.init_scale = 256.0;  // the fp32 step below is taken, not skipped as overflowing
    auto handle = initialize(net, opt, level, o);
    auto loss_of = [&](const at::Tensor& embeddings) {
      centers.set_data(centers.detach().to(embeddings.scalar_type()));  // what such losses do
      return at::mm(embeddings, centers.t()).logsumexp(1).sum();
    };
    auto x = torch::randn({2, 3});
    const auto reduced = at::linear(x, torch::randn({3, 3}));  // O1/O4: fp16/bf16
    ASSERT_NE(reduced.scalar_type(), at::kFloat) << level;
    auto loss = loss_of(reduced);
    const double scale_before = loss_scaler(0).loss_scale();
    OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt), c10::ValueError, "param_groups[0].params[",
                             "must still be torch.float32", "parameter of no model passed",
                             "embeddings.float()");
    EXPECT_EQ(loss_scaler(0).loss_scale(), scale_before) << level;
    EXPECT_FALSE(centers.grad().defined()) << level;
    centers.set_data(centers.detach().to(at::kFloat));
    {
      auto scaled = scale_loss(loss_of(reduced.to(at::kFloat)), opt);
      scaled.backward();
    }
    EXPECT_FALSE(loss_scaler(0).last_step_skipped()) << level;
    EXPECT_EQ(centers.scalar_type(), at::kFloat) << level;
    ASSERT_TRUE(centers.grad().defined()) << level;
    EXPECT_TRUE(centers.grad().isfinite().all().item<bool>()) << level;
    reset();
  }
}

TEST_F(Initialize, ErrorParameterInTwoOptimizers) {
  Net net = make_net();
  torch::optim::SGD a(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD b({net->fc2->weight}, torch::optim::SGDOptions(0.1));
  OPTAMP_EXPECT_THROW_WITH(initialize({net.ptr()}, {&a, &b}, "O2", quiet()), c10::ValueError,
                           "must belong to one optimizer", "optimizer 0", "optimizer 1",
                           "parameter fc2.weight (");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorLbfgsIsUnsupported) {
  Net net = make_net();
  torch::optim::LBFGS opt(net->parameters());
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O1", quiet()), c10::ValueError, "LBFGS",
                           "closure");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorSameOptimizerTwiceWithoutReset) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O1", quiet());
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "O2", quiet()), c10::ValueError,
                           "already passed to amp::initialize", "amp::reset()");
  reset();
  EXPECT_NO_THROW(initialize(net, *opt, "O2", quiet()));
}
TEST_F(Initialize, ErrorOptimizerStateOnAnotherDevice) {
  Net net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto b = make_batches(1).front();
  at::cross_entropy_loss(net->forward(b.x, b.tag), b.y).backward();
  opt.step();
  auto& state = static_cast<torch::optim::SGDParamState&>(
      *opt.state().at(net->parameters()[0].unsafeGetTensorImpl()));
  state.momentum_buffer(state.momentum_buffer().to(at::kMeta));
  OPTAMP_EXPECT_THROW_WITH(initialize(net, opt, "O2", quiet()), c10::ValueError,
                           "on the device of its parameter", "meta",
                           "state of parameter conv.weight (");
  expect_untouched(net);
}

TEST_F(Initialize, ErrorLevelConflictsComeFromProperties) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  Options o = quiet();
  o.master_weights = true;
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "O1", o), c10::ValueError, "master_weights");
  OPTAMP_EXPECT_THROW_WITH(initialize(net, *opt, "o2", quiet()), c10::ValueError,
                           "capital letter O");
  expect_untouched(net);
}

}  // namespace
}  // namespace amp
