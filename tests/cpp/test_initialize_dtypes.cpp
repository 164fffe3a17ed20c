// The dtypes after amp::initialize, per level and Apex override (keep_batchnorm_fp32,
// master_weights, cast_model_type): inside forward (conv, batch-norm, linear, layer-norm), of the
// model output and the loss, of the model's own tensors and their grads; and modules marked
// keep_in_fp32 at O2.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <ostream>
#include <string>
#include <tuple>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

// What one training forward/backward produces at a level, as docs/opt_levels.md and
// docs/casting.md say: `lower` ops (conv, linear) in the low dtype at O1-O5; layer_norm in the
// fp32 list at O1/O4 only; batch-norm (listed nowhere) runs on what it gets, i.e. the low-dtype
// conv output with its fp32 parameters at O1/O2/O4/O5, so its output is low (fp32 statistics
// inside, as cuDNN in Apex); losses fp32 at O1/O2/O4/O5 and plain fp16 at O3 (no fp32 list).
struct ForwardCase {
  const char* name;
  const char* level;
  std::optional<bool> keep_batchnorm_fp32;
  ScalarType conv, bn, fc, ln, out, loss;             // activations, the model output, the loss
  ScalarType param, bn_param;                         // the model's own tensors (masters at O2/O5)
  std::optional<bool> master_weights = std::nullopt;  // Apex's overrides of what happens to
  std::optional<ScalarType> cast_model_type = std::nullopt;  // the model (ModelCast)
};

void PrintTo(const ForwardCase& c, std::ostream* os) { *os << c.name; }

constexpr auto F = at::kFloat;
constexpr auto H = at::kHalf;
constexpr auto B = at::kBFloat16;

const ForwardCase kForwardCases[] = {
    //      conv bn  fc  ln  out loss param bn_param
    {"O0", "O0", std::nullopt, F, F, F, F, F, F, F, F},
    {"O1", "O1", std::nullopt, H, H, H, F, H, F, F, F},
    {"O2", "O2", std::nullopt, H, H, H, H, H, F, F, F},
    {"O3", "O3", std::nullopt, H, H, H, H, H, H, H, H},
    {"O3_KeepBatchnormFp32", "O3", true, H, H, H, H, H, H, H, F},
    {"O4", "O4", std::nullopt, B, B, B, F, B, F, F, F},
    {"O5", "O5", std::nullopt, B, B, B, B, B, F, F, F},
    {"O2_NoKeepBatchnormFp32", "O2", false, H, H, H, H, H, F, F, F},
    // Apex's overrides: O2 without masters casts the model in place (batch-norm kept fp32) and
    // keeps O2's fp32 losses; O3 with masters keeps the fp32 model and runs O3's working
    // copies; cast_model_type None/fp32 at a model level casts nothing; O0 with fp16 casts
    // the model (batch-norm too: keep_batchnorm_fp32 is None at O0) and its lower ops.
    {"O2_NoMasterWeights", "O2", std::nullopt, H, H, H, H, H, F, H, F, false},
    {"O3_MasterWeights", "O3", std::nullopt, H, H, H, H, H, H, F, F, true},
    {"O2_CastModelTypeNone", "O2", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt,
     ScalarType::Undefined},
    {"O3_CastModelTypeFp32", "O3", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt, F},
    {"O5_CastModelTypeNone", "O5", std::nullopt, F, F, F, F, F, F, F, F, std::nullopt,
     ScalarType::Undefined},
    {"O0_CastModelTypeFp16", "O0", std::nullopt, H, H, H, H, H, H, H, H, std::nullopt, H},
};

void expect_forward_dtypes(const ForwardCase& c, at::Device device) {
  const auto b = batches_on(device, 1).front();
  Net net = make_net_on(device);
  auto opt = make_optimizer(net, Opt::kSgd);
  Options o = quiet();
  o.keep_batchnorm_fp32 = c.keep_batchnorm_fp32;
  o.master_weights = c.master_weights;
  o.cast_model_type = c.cast_model_type;
  initialize(net, *opt, c.level, o);
  opt->zero_grad();
  const auto out = net->forward(b.x, b.tag);
  const auto loss = at::cross_entropy_loss(out, b.y);
  EXPECT_EQ(net->conv_out, c.conv) << "conv output";
  EXPECT_EQ(net->bn_out, c.bn) << "batch-norm output";
  EXPECT_EQ(net->fc_out, c.fc) << "linear output";
  EXPECT_EQ(net->ln_out, c.ln) << "layer-norm output";
  EXPECT_EQ(out.scalar_type(), c.out) << "model output";
  EXPECT_EQ(loss.scalar_type(), c.loss) << "loss";
  EXPECT_EQ(out.device().type(), device.type());
  {
    auto scaled = scale_loss(loss, *opt);
    scaled.backward();
  }
  // The model's own tensors (what the optimizer steps and checkpoints hold) and their grads.
  for (const auto& p : net->named_parameters()) {
    const bool is_bn = p.key().rfind("bn.", 0) == 0;
    EXPECT_EQ(p.value().scalar_type(), is_bn ? c.bn_param : c.param) << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), p.value().scalar_type()) << p.key() << " grad";
    EXPECT_TRUE(p.value().grad().isfinite().all().item<bool>()) << p.key() << " grad";
  }
  EXPECT_EQ(net->bn->running_mean.scalar_type(), c.bn_param);
  EXPECT_EQ(net->bn->running_var.scalar_type(), c.bn_param);
  // ... and the step goes through.
  const auto before = fp32_cpu_params(net);
  opt->step();
  EXPECT_FALSE(at::equal(fp32_cpu_params(net)[0], before[0])) << "conv.weight was not stepped";
}

class InitializeForward : public testing::OnDevices<Initialize, ForwardCase> {};

TEST_P(InitializeForward, DtypesAsTheTableSays) { expect_forward_dtypes(param(), device()); }

std::string forward_case_name(
    const ::testing::TestParamInfo<std::tuple<ForwardCase, at::DeviceType>>& info) {
  return std::get<0>(info.param).name + testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeForward,
                         ::testing::Combine(::testing::ValuesIn(kForwardCases), testing::kDevices),
                         forward_case_name);

TEST_F(Initialize, UserMarkedModulesKeepFp32AtO2) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  keep_in_fp32(*net->fc1);
  initialize(net, *opt, "O2", quiet());
  // A plain (non-`lower`) op shows whether a tensor is substituted by its working copy.
  EXPECT_EQ(at::add(net->fc1->weight, 1.0).scalar_type(), at::kFloat);  // kept
  EXPECT_EQ(at::add(net->bn->weight, 1.0).scalar_type(), at::kFloat);   // batch-norm
  EXPECT_EQ(at::add(net->fc2->weight, 1.0).scalar_type(), at::kHalf);   // working copy
}

// A trainable float64 parameter (a learned physical constant kept in double, which torch.amp
// trains) is taken at every level that keeps fp32 weights: ops read it as it is (never cast, no
// working copy at O2/O5), its gradient is unscaled in float64 bit for bit as an unscaled
// backward's, and the step keeps it float64. Refused until 2026-12-07.
struct WithConstantImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  at::Tensor k;
  WithConstantImpl()
      : fc(register_module("fc", torch::nn::Linear(4, 3))),
        k(register_parameter("k", at::tensor({0.5, 1.0 + 1e-12, 2.0}, at::kDouble))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x).to(at::kDouble) * k; }
};
TORCH_MODULE(WithConstant);

TEST_F(Initialize, Float64ParametersAreTakenAndStepInFloat64) {
  for (const char* level : {"O1", "O2", "O4", "O5"}) {
    at::manual_seed(0);
    WithConstant net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5));
    initialize(net, opt, level, quiet());
    const at::Tensor x = at::randn({8, 4});
    auto loss_of = [&] { return net->forward(x).pow(2).mean(); };
    // 1 + 1e-12 survives: k is read as it is, not through a reduced copy.
    EXPECT_EQ((net->k * 1).scalar_type(), at::kDouble) << level;
    EXPECT_EQ((net->k * 1)[1].item<double>(), 1.0 + 1e-12) << level;
    loss_of().backward();
    const at::Tensor reference = net->k.grad().clone();
    opt.zero_grad();
    {
      auto scaled = scale_loss(loss_of(), opt);
      scaled.backward();
    }
    ASSERT_FALSE(loss_scaler().last_step_skipped()) << level;
    EXPECT_TRUE(at::equal(net->k.grad(), reference)) << level;  // a power-of-two scale: exact
    const at::Tensor expected = net->k.detach() - 0.5 * reference;
    opt.step();
    EXPECT_EQ(net->k.scalar_type(), at::kDouble) << level;
    EXPECT_TRUE(at::equal(net->k.detach(), expected)) << level;
    EXPECT_EQ(net->fc->weight.scalar_type(), at::kFloat) << level;
    reset();
  }
}

}  // namespace
}  // namespace amp
