// The overloads of amp::initialize: vectors of models and optimizers trained by one loss, no
// optimizer (inference), std::shared_ptr and module-reference models, OptLevel and string levels.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

struct TwoModelRun {
  std::vector<at::Tensor> params;  // the net's, then the head's (fp32, CPU)
  double first = 0, last = 0;
};

// The general overload: two models and two optimizers, one loss over both, 8 steps.
TwoModelRun train_two_models(OptLevel level) {
  const auto batches = make_batches(4);
  Net net = make_net();
  at::manual_seed(11);
  torch::nn::Linear head(4, 4);
  torch::optim::SGD net_opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD head_opt(head->parameters(), torch::optim::SGDOptions(0.1));
  const auto handle = initialize({net.ptr(), head.ptr()}, {&net_opt, &head_opt}, level, quiet());
  EXPECT_EQ(handle.properties().opt_level, level);
  TwoModelRun run;
  for (int s = 0; s < 8; ++s) {
    const auto& b = batches[s % batches.size()];
    net_opt.zero_grad();
    head_opt.zero_grad();
    const auto out = head->forward(at::relu(net->forward(b.x, b.tag)));
    if (level == OptLevel::O2) {
      EXPECT_EQ(out.scalar_type(), at::kHalf) << "the head's linear runs on its working copies";
      EXPECT_EQ(at::add(head->weight, 1.0).scalar_type(), at::kHalf) << "head.weight substituted";
      EXPECT_EQ(at::add(net->fc2->weight, 1.0).scalar_type(), at::kHalf) << "fc2.weight too";
    }
    const auto loss = at::cross_entropy_loss(out, b.y);
    {
      auto scaled = scale_loss(loss, {&net_opt, &head_opt});
      scaled.backward();
    }
    net_opt.step();
    head_opt.step();
    if (s == 0) run.first = loss.item<double>();
    run.last = loss.item<double>();
  }
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  for (const auto& p : head->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  run.params = fp32_cpu_params(net);
  for (const auto& p : head->parameters()) run.params.push_back(p.detach().clone());
  reset();
  return run;
}

TEST_F(Initialize, VectorsOfModelsAndOptimizersTrainTogether) {
  const auto reference = train_two_models(OptLevel::O0);
  const auto o2 = train_two_models(OptLevel::O2);
  EXPECT_LT(o2.last, o2.first);
  EXPECT_NEAR(o2.last, reference.last, 0.05 * reference.last);
  at::manual_seed(11);
  torch::nn::Linear init_head(4, 4);
  ASSERT_EQ(o2.params.size(), reference.params.size());
  // Both models were stepped (by their own optimizer) and match fp32 training.
  EXPECT_FALSE(at::equal(o2.params.front(), make_net()->conv->weight)) << "net not stepped";
  EXPECT_FALSE(at::equal(o2.params.back(), init_head->bias)) << "head not stepped";
  for (std::size_t i = 0; i < o2.params.size(); ++i) {
    EXPECT_TRUE(
        testing::all_close(o2.params[i], reference.params[i], testing::tolerance("train_float16")))
        << "parameter " << i;
  }
}

TEST_F(Initialize, WithoutOptimizerForInference) {
  // A whole forward through five fp16 layers drifts further than one op (the "float16" row).
  const testing::Tolerance forward_half{1e-2, 1e-3};
  const auto b = make_batches(1).front();
  Net net = make_net();
  at::Tensor fp32_out;
  {
    torch::NoGradGuard no_grad;
    fp32_out = net->forward(b.x, b.tag);
  }
  // O1, no optimizer (and so no scale_loss): casting is on.
  const auto handle = initialize(net, "O1", quiet());
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(handle.properties().low_dtype(), at::kHalf);
  EXPECT_EQ(net->forward(b.x, b.tag).scalar_type(), at::kHalf);
  EXPECT_EQ(net->conv_out, at::kHalf);
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(net->forward(b.x, b.tag).scalar_type(), at::kFloat) << "no_grad runs fp32";
    amp::autocast region;  // reduced-precision inference
    const auto out = net->forward(b.x, b.tag);
    EXPECT_EQ(net->conv_out, at::kHalf);
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    EXPECT_TRUE(testing::all_close(out.to(at::kFloat), fp32_out, forward_half));
  }
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  reset();

  // O3, no optimizer, OptLevel: the model itself is cast; inference runs fp16 even under no_grad.
  initialize(net, OptLevel::O3, quiet());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kHalf);
  torch::NoGradGuard no_grad;
  const auto out = net->forward(b.x, b.tag);
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_TRUE(testing::all_close(out.to(at::kFloat), fp32_out, forward_half));
}

TEST_F(Initialize, SharedPtrAndModuleReferenceModels) {
  const auto b = make_batches(1).front();
  at::manual_seed(7);
  auto model = std::make_shared<NetImpl>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  const auto step_changes_conv = [&] {
    const auto before = model->conv->weight.detach().clone();
    opt.zero_grad();
    auto loss = at::cross_entropy_loss(model->forward(b.x, b.tag), b.y);
    {
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
    opt.step();
    return !at::equal(model->conv->weight, before);
  };
  // std::shared_ptr<NetImpl>.
  initialize(model, opt, "O2", quiet());
  EXPECT_EQ(at::add(model->fc2->weight, 1.0).scalar_type(), at::kHalf);
  EXPECT_TRUE(step_changes_conv());
  reset();
  // std::shared_ptr<torch::nn::Module>.
  ModulePtr base = model;
  initialize(base, opt, "O1", quiet());
  model->forward(b.x, b.tag);
  EXPECT_EQ(model->fc_out, at::kHalf);
  EXPECT_TRUE(step_changes_conv());
  reset();
  // A module reference (the object must be owned by a shared_ptr, as modules always are).
  NetImpl& ref = *model;
  initialize(ref, opt, "O3", quiet());
  EXPECT_EQ(model->conv->weight.scalar_type(), at::kHalf);
  EXPECT_TRUE(opt.param_groups()[0].params()[0].is_same(model->conv->weight));
  EXPECT_TRUE(step_changes_conv());
  EXPECT_EQ(model->conv->weight.scalar_type(), at::kHalf);
}

TEST_F(Initialize, OptLevelEnumAndStringLevelsAreTheSame) {
  const auto b = make_batches(1).front();
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  const std::string level = "O4";
  const std::string by_string = initialize(net, *opt, level, quiet()).describe();
  reset();
  const auto handle = initialize(net, *opt, OptLevel::O4, quiet());
  EXPECT_EQ(handle.describe(), by_string);
  EXPECT_EQ(handle.properties().opt_level, OptLevel::O4);
  EXPECT_EQ(handle.properties().low_dtype(), at::kBFloat16);
  const auto before = fp32_cpu_params(net);
  train_step(net, *opt, b);
  EXPECT_EQ(net->conv_out, at::kBFloat16);
  EXPECT_EQ(net->fc_out, at::kBFloat16);
  const auto after = fp32_cpu_params(net);
  for (std::size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(net->parameters()[i].scalar_type(), at::kFloat);
    if (i != 1) EXPECT_FALSE(at::equal(after[i], before[i])) << "parameter " << i;  // not conv.bias
  }
}

}  // namespace
}  // namespace amp
