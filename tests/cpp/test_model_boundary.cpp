// Apex's model boundary (amp::forward, Properties::model_boundary, Options::cast_model_outputs):
// floating inputs cast to the model's dtype, floating outputs to fp32 (or cast_model_outputs)
// wherever the level has a cast_model_type; at O2/O5 inputs follow where ops see working copies.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures (initialize_test.h)
using at::ScalarType;

constexpr ScalarType kNone = ScalarType::Undefined;

// A linear layer that records the dtype its input arrived in.
struct ProbeImpl : torch::nn::Module {
  torch::nn::Linear fc{4, 3};
  ScalarType seen = kNone;
  ProbeImpl() { register_module("fc", fc); }
  at::Tensor forward(const at::Tensor& x) {
    seen = x.scalar_type();
    return fc(x);
  }
};
TORCH_MODULE(Probe);

// Tensors in containers, a non-floating tensor and a plain number, in and out.
struct ContainersImpl : torch::nn::Module {
  torch::nn::Linear fc{4, 4};
  std::vector<ScalarType> seen;
  ContainersImpl() { register_module("fc", fc); }
  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> forward(
      const std::vector<at::Tensor>& xs, const at::Tensor& index, double factor,
      const std::optional<at::Tensor>& extra) {
    seen = {xs[0].scalar_type(), xs[1].scalar_type(), index.scalar_type(), extra->scalar_type()};
    auto h = fc(xs[0] + xs[1]) * factor;
    return {h, index + 1, {h, fc(*extra)}};
  }
};
TORCH_MODULE(Containers);

Options quiet_with_outputs(std::optional<ScalarType> outputs) {
  Options o = quiet();
  o.cast_model_outputs = outputs;
  return o;
}

TEST(ModelBoundary, DefaultsFollowApexCastModelType) {
  struct Row {
    const char* level;
    ScalarType inputs, outputs;
  };
  // Apex patched forward wherever cast_model_type is set, O0's fp32 too; optamp's O0 changes
  // nothing (it does not cast the model to fp32 either, so an fp64 model keeps working).
  for (const Row& row : {Row{"O0", kNone, kNone}, Row{"O1", kNone, kNone},
                         Row{"O2", ScalarType::Half, ScalarType::Float},
                         Row{"O3", ScalarType::Half, ScalarType::Float}, Row{"O4", kNone, kNone},
                         Row{"O5", ScalarType::BFloat16, ScalarType::Float}}) {
    const ModelBoundary b = resolve(row.level).model_boundary();
    EXPECT_EQ(b.inputs, row.inputs) << row.level;
    EXPECT_EQ(b.outputs, row.outputs) << row.level;
  }
  EXPECT_EQ(resolve("O2", quiet_with_outputs(ScalarType::Half)).model_boundary().outputs,
            ScalarType::Half);
  // At O1/O4 only an explicit cast_model_outputs applies (Apex's elif branch).
  const ModelBoundary o1 = resolve("O1", quiet_with_outputs(ScalarType::Float)).model_boundary();
  EXPECT_EQ(o1.inputs, kNone);
  EXPECT_EQ(o1.outputs, ScalarType::Float);
  Options off = quiet();
  off.enabled = false;
  EXPECT_FALSE(resolve("O2", off).model_boundary().casts());
  Options uncast = quiet();
  uncast.cast_model_type = kNone;
  EXPECT_FALSE(resolve("O2", uncast).model_boundary().casts());
  uncast.cast_model_type = ScalarType::Float;  // Apex's "cast to fp32": nothing is cast
  EXPECT_FALSE(resolve("O2", uncast).model_boundary().casts());
}

TEST(ModelBoundary, RefusesANonFloatingOutputType) {
  OPTAMP_EXPECT_THROW_WITH(resolve("O2", quiet_with_outputs(ScalarType::Long)), c10::ValueError,
                           "cast_model_outputs must be a floating type", "got torch.int64");
  EXPECT_NE(resolve("O2", quiet_with_outputs(ScalarType::BFloat16))
                .describe()
                .find("cast_model_outputs         : torch.bfloat16"),
            std::string::npos);
}

Options quiet_with_inputs_as_given() {
  Options o = quiet();
  o.cast_model_inputs = false;
  return o;
}

TEST(ModelBoundary, CastModelInputsFalseLeavesTheInputsOut) {
  for (const char* level : {"O2", "O5"}) {
    const Properties p = resolve(level, quiet_with_inputs_as_given());
    EXPECT_EQ(p.model_boundary().inputs, kNone) << level;
    EXPECT_EQ(p.model_boundary().outputs, ScalarType::Float) << level;
    EXPECT_NE(p.describe().find("cast_model_inputs          : False"), std::string::npos);
    EXPECT_NE(p.describe().find("cast_model_inputs=False"), std::string::npos);
  }
  EXPECT_TRUE(resolve("O2").cast_model_inputs);
}

TEST(ModelBoundary, CastModelInputsFalseIsRefusedWhereTheModelIsCastInPlace) {
  // O3 (and O2/O5 without master weights) have no fp32 weights for fp32 inputs to meet.
  OPTAMP_EXPECT_THROW_WITH(resolve("O3", quiet_with_inputs_as_given()), c10::ValueError,
                           "cast_model_inputs=False needs fp32 master weights",
                           "opt_level O3 casts the model itself to torch.float16");
  Options no_masters = quiet_with_inputs_as_given();
  no_masters.master_weights = false;
  OPTAMP_EXPECT_THROW_WITH(resolve("O5", no_masters), c10::ValueError,
                           "opt_level O5 casts the model itself to torch.bfloat16");
}

// A diffusion / flow-matching network: a float timestep in [0, 1) turned into sinusoidal
// features of high frequency, added to the input's projection.
struct TimestepNetImpl : torch::nn::Module {
  torch::nn::Linear embed{16, 8}, body{8, 8};
  at::Tensor features;  // the last forward's sinusoidal features
  ScalarType timestep_dtype = kNone;
  TimestepNetImpl() {
    register_module("embed", embed);
    register_module("body", body);
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t) {
    timestep_dtype = t.scalar_type();
    const at::Tensor freqs = at::exp(at::arange(8, t.options()) * (-std::log(1e4) / 8)) * 1000;
    const at::Tensor angles = t.unsqueeze(1) * freqs.unsqueeze(0);
    features = at::cat({angles.sin(), angles.cos()}, 1).detach();
    return body(x + embed(features));
  }
};
TORCH_MODULE(TimestepNet);

TEST_F(Initialize, ForwardWithInputsAsGivenKeepsAFloatTimestepExact) {
  // Apex's boundary rounds the timestep to fp16/bf16 (bf16 holds t = 0.9 to within 2e-3),
  // so features of frequency 1000 come out with the wrong phase.
  for (const char* level : {"O2", "O5"}) {
    at::manual_seed(0);
    TimestepNet model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    const at::Tensor x = at::randn({8, 8});
    const at::Tensor t = at::rand({8});
    const at::Tensor expected = [&] {
      at::NoGradGuard no_grad;  // fp32 (the no_grad gate), before initialize anyway
      model->forward(x, t);
      return model->features.clone();
    }();
    initialize(model, opt, level, quiet());
    amp::forward(model, x, t);
    EXPECT_NE(model->timestep_dtype, at::kFloat) << level << ": Apex's boundary casts it";
    EXPECT_GT((model->features.to(at::kFloat) - expected).abs().max().item<double>(), 0.1) << level;
    reset();
    initialize(model, opt, level, quiet_with_inputs_as_given());
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      const at::Tensor out = amp::forward(model, x, t);
      EXPECT_EQ(out.scalar_type(), at::kFloat) << level;
      EXPECT_EQ(model->timestep_dtype, at::kFloat) << level;
      if (step == 0) EXPECT_TRUE(at::equal(model->features, expected)) << level;
      {
        auto scaled = scale_loss(out.pow(2).mean(), opt);
        scaled.backward();
      }
      opt.step();
      EXPECT_FALSE(loss_scaler().last_step_skipped()) << level;
    }
    reset();
  }
}

TEST_F(Initialize, ForwardCastsInputsToTheModelAndOutputsToFp32) {
  struct Row {
    const char* level;
    ScalarType seen, out;  // input dtype the model saw, output dtype
  };
  for (const Row& row : {Row{"O0", ScalarType::Float, ScalarType::Float},
                         Row{"O1", ScalarType::Float, ScalarType::Half},
                         Row{"O2", ScalarType::Half, ScalarType::Float},
                         Row{"O3", ScalarType::Half, ScalarType::Float},
                         Row{"O4", ScalarType::Float, ScalarType::BFloat16},
                         Row{"O5", ScalarType::BFloat16, ScalarType::Float}}) {
    at::manual_seed(0);
    Probe model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    initialize(model, opt, row.level, quiet());
    const at::Tensor out = amp::forward(model, at::randn({2, 4}));
    EXPECT_EQ(model->seen, row.seen) << row.level;
    EXPECT_EQ(out.scalar_type(), row.out) << row.level;
    reset();
  }
}

TEST_F(Initialize, ForwardHonoursAnExplicitOutputType) {
  Probe model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O2", quiet_with_outputs(ScalarType::Half));
  EXPECT_EQ(amp::forward(model, at::randn({2, 4})).scalar_type(), ScalarType::Half);
  reset();
  initialize(model, opt, "O1", quiet_with_outputs(ScalarType::Float));
  EXPECT_EQ(amp::forward(model, at::randn({2, 4})).scalar_type(), ScalarType::Float);
  EXPECT_EQ(model->seen, ScalarType::Float);  // O1 casts no input at the boundary
}

TEST_F(Initialize, ForwardAtO2FeedsFp32WhereOpsSeeTheMasters) {
  // Under no_grad (the gate) and on a thread initialize did not turn on, ops at O2 see the fp32
  // masters: fp16 inputs there would fail against them, so the boundary casts to fp32.
  Probe model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O2", quiet());
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(amp::forward(model, at::randn({2, 4}).to(at::kHalf)).scalar_type(), at::kFloat);
    EXPECT_EQ(model->seen, ScalarType::Float);
  }
  std::thread([&] {
    EXPECT_EQ(amp::forward(model, at::randn({2, 4}).to(at::kHalf)).scalar_type(), at::kFloat);
    EXPECT_EQ(model->seen, ScalarType::Float);
  }).join();
  {
    disable_casts off;
    EXPECT_EQ(amp::forward(model, at::randn({2, 4})).scalar_type(), at::kFloat);
    EXPECT_EQ(model->seen, ScalarType::Float);
  }
  amp::forward(model, at::randn({2, 4}));
  EXPECT_EQ(model->seen, ScalarType::Half);
}

TEST_F(Initialize, ForwardLeavesModelsInitializeWasNotGivenAlone) {
  Probe model, other;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O3", quiet());
  other->to(at::kHalf);
  EXPECT_EQ(amp::forward(other, at::randn({2, 4}).to(at::kHalf)).scalar_type(), at::kHalf);
  EXPECT_EQ(model->forward(at::randn({2, 4}).to(at::kHalf)).scalar_type(), at::kHalf)
      << "model->forward has no boundary";
  reset();
  EXPECT_EQ(amp::forward(model, at::randn({2, 4}).to(at::kHalf)).scalar_type(), at::kHalf)
      << "nothing is cast once reset";
}

TEST_F(Initialize, ForwardCastsTensorsInsideContainers) {
  Containers model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O5", quiet());
  const std::vector<at::Tensor> xs{at::randn({2, 4}), at::randn({2, 4}).to(at::kDouble)};
  const auto [h, index, list] =
      amp::forward(model, xs, at::arange(2), 0.5, std::optional<at::Tensor>(at::randn({2, 4})));
  EXPECT_EQ(model->seen, (std::vector<ScalarType>{ScalarType::BFloat16, ScalarType::BFloat16,
                                                  ScalarType::Long, ScalarType::BFloat16}));
  EXPECT_EQ(h.scalar_type(), at::kFloat);
  EXPECT_EQ(index.scalar_type(), at::kLong);
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].scalar_type(), at::kFloat);
  EXPECT_EQ(list[1].scalar_type(), at::kFloat);
}

TEST_F(Initialize, GradientsFlowBackThroughTheBoundaryInTheInputsDtype) {
  // A GAN's generator output enters the discriminator through the boundary and must still get
  // its gradient, in its own dtype.
  Probe model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O2", quiet());
  const at::Tensor x = at::randn({2, 4}).requires_grad_();
  amp::forward(model, x).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(x.grad().abs().sum().item<double>() > 0);
  EXPECT_TRUE(model->fc->weight.grad().defined());
  EXPECT_EQ(model->fc->weight.grad().scalar_type(), at::kFloat);
}

TEST_F(Initialize, ForwardAtO2LetsTheLossReadTheReducedOutput) {
  // The widened output keeps the model's fp16 output as its exact companion, so cross_entropy of
  // it (or of a view of all of it) reads fp16 logits as at O1: one op, no fp32 copy of its own
  // (test_fused_casts.cpp's CrossEntropy.AModelsWidenedOutputIsReadReduced has the values).
  Probe model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O2", quiet());
  const at::Tensor out = amp::forward(model, at::randn({2, 4}));
  ASSERT_EQ(out.scalar_type(), at::kFloat);
  const auto read = first_input_dtypes("optamp::widened_log_softmax", [&] {
    at::cross_entropy_loss(out.view({-1, out.size(-1)}), at::zeros({2}, at::kLong)).backward();
  });
  EXPECT_EQ(read, std::vector<at::ScalarType>{at::kHalf});
  EXPECT_TRUE(model->fc->weight.grad().defined());
}

TEST_F(Initialize, O3TrainsAModelThatStartsWithLayerNormOnFp32Inputs) {
  // Without the boundary, fp32 inputs met O3's fp16 LayerNorm weights ("mixed dtype (CPU)").
  at::manual_seed(0);
  torch::nn::Sequential model(torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})),
                              torch::nn::Linear(4, 3));
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O3", quiet());
  const at::Tensor x = at::randn({8, 4});
  const at::Tensor y = at::randint(0, 3, {8});
  const auto before = model->parameters()[2].detach().clone();
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    const at::Tensor logits = amp::forward(model, x);
    ASSERT_EQ(logits.scalar_type(), at::kFloat);
    const at::Tensor loss = at::cross_entropy_loss(logits, y);
    EXPECT_EQ(loss.scalar_type(), at::kFloat) << "the loss runs in fp32, not fp16";
    {
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
    opt.step();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  }
  EXPECT_FALSE(at::equal(before, model->parameters()[2].detach()));
}

}  // namespace
}  // namespace amp
