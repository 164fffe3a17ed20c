// TorchScript code run while optamp casts: LibTorch programs call scripted functions and loaded
// modules (torch::jit::load) from their training loops. TorchScript's optimizer differentiates a
// profiled graph symbolically, taking each op's output to have the dtypes it recorded, which
// casts made below the graph break; so while casting is on, a thread runs TorchScript
// unoptimized (dispatched and differentiated as eager code), and gets its own setting back when
// casting goes off.
#include <ATen/ATen.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>
#include <torch/jit.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <string>

#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

// A linear layer, a training batch norm and a second linear, as a script function.
constexpr const char* kSource = R"JIT(
def forward(x, w1, b1, gamma, beta, mean, var, w2):
    h = torch.linear(x, w1, b1)
    h = torch.batch_norm(h, gamma, beta, mean, var, True, 0.1, 1e-5, False)
    return torch.linear(torch.relu(h), w2)
)JIT";

struct NetImpl : torch::nn::Module {
  at::Tensor w1, b1, gamma, beta, mean, var, w2;
  NetImpl() {
    at::manual_seed(0);
    w1 = register_parameter("w1", at::randn({32, 16}) * 0.2);
    b1 = register_parameter("b1", at::zeros({32}));
    gamma = register_parameter("gamma", at::ones({32}));
    beta = register_parameter("beta", at::zeros({32}));
    mean = register_buffer("mean", at::zeros({32}));
    var = register_buffer("var", at::ones({32}));
    w2 = register_parameter("w2", at::randn({4, 32}) * 0.2);
  }
  std::vector<c10::IValue> inputs(const at::Tensor& x) const {
    return {x, w1, b1, gamma, beta, mean, var, w2};
  }
};
TORCH_MODULE(Net);

at::Tensor run(torch::jit::CompilationUnit& unit, std::vector<c10::IValue> inputs) {
  return unit.get_function("forward")(std::move(inputs)).toTensor();
}

at::Tensor batch(int step) {
  at::manual_seed(100 + step);
  return at::randn({8, 16});
}

// One training step through a scale_loss guard.
void scaled_step(const at::Tensor& loss, torch::optim::Optimizer& opt) {
  {
    auto scaled = scale_loss(loss, opt);
    scaled.backward();
  }
  opt.step();
}

// One step of the fp32 reference: the script function on the reference's tensors, casts off.
at::Tensor reference_step(torch::jit::CompilationUnit& unit, Net& reference,
                          torch::optim::Optimizer& opt, const at::Tensor& x) {
  disable_casts off;
  opt.zero_grad();
  const auto loss = run(unit, reference->inputs(x)).pow(2).mean();
  loss.backward();
  opt.step();
  return loss.detach();
}

class TorchScript : public ::testing::Test {
 protected:
  void TearDown() override {
    reset();
    torch::jit::setGraphExecutorOptimize(true);
  }
};

TEST_F(TorchScript, AScriptedFunctionTrainsUnderCastingAsItsEagerSelf) {
  auto unit = torch::jit::compile(kSource);
  Net net;
  Net reference;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  Options quiet;
  quiet.verbosity = 0;
  initialize(net, opt, "O1", quiet);
  ASSERT_FALSE(torch::jit::getGraphExecutorOptimize());
  // Several steps: the first runs are profiled, later ones would run the optimized graph.
  for (int step = 0; step < 4; ++step) {
    const auto x = batch(step);
    opt.zero_grad();
    const auto loss = run(*unit, net->inputs(x)).to(at::kFloat).pow(2).mean();
    scaled_step(loss, opt);
    const auto ref_loss = reference_step(*unit, reference, ref_opt, x);
    EXPECT_TRUE(all_close(loss.detach(), ref_loss, testing::tolerance("train_float16")))
        << "step " << step;
  }
  EXPECT_TRUE(all_close(net->mean, reference->mean, testing::tolerance("train_float16")));
  reset();
  EXPECT_TRUE(torch::jit::getGraphExecutorOptimize());
}

// A torch::jit::Module (what torch::jit::load returns for a model exported from Python) is no
// torch::nn::Module: docs/cpp.md's recipe registers its parameters and buffers in a holder module
// for amp::initialize. The holder's tensors are the scripted module's own, so O2's working copies
// are what its forward sees, and its optimizer steps the scripted module's weights.
struct TensorHolderImpl : torch::nn::Module {};  // a child holder: the batch norm's tensors
TORCH_MODULE(TensorHolder);

struct ScriptedHolderImpl : torch::nn::Module {
  // Tensors whose name starts with one of `fp32_prefixes` go to the child `fp32`, which
  // keep_in_fp32 marks: the holder cannot find the scripted module's batch norms by type.
  ScriptedHolderImpl(const torch::jit::Module& scripted, const std::vector<std::string>& fp32_names)
      : fp32(register_module("fp32", TensorHolder())) {
    const auto owner = [&](const std::string& name) -> torch::nn::Module& {
      const bool keep = std::find(fp32_names.begin(), fp32_names.end(), name) != fp32_names.end();
      return keep ? static_cast<torch::nn::Module&>(*fp32) : *this;
    };
    for (const auto& p : scripted.named_parameters()) {
      owner(p.name).register_parameter(holder_name(p.name), p.value);
    }
    for (const auto& b : scripted.named_buffers()) {
      owner(b.name).register_buffer(holder_name(b.name), b.value);
    }
  }
  static std::string holder_name(std::string name) {  // "fc.weight" is no valid name here
    std::replace(name.begin(), name.end(), '.', '_');
    return name;
  }
  TensorHolder fp32;
};
TORCH_MODULE(ScriptedHolder);

torch::jit::Module scripted_linear_norm() {
  Net net;  // the same weights as Net's, as a scripted module
  torch::jit::Module scripted("ScriptedNet");
  scripted.register_parameter("w1", net->w1.detach().clone(), false);
  scripted.register_parameter("b1", net->b1.detach().clone(), false);
  scripted.register_parameter("gamma", net->gamma.detach().clone(), false);
  scripted.register_parameter("beta", net->beta.detach().clone(), false);
  scripted.register_buffer("mean", net->mean.detach().clone());
  scripted.register_buffer("var", net->var.detach().clone());
  scripted.register_parameter("w2", net->w2.detach().clone(), false);
  scripted.define(R"JIT(
def forward(self, x):
    h = torch.linear(x, self.w1, self.b1)
    h = torch.batch_norm(h, self.gamma, self.beta, self.mean, self.var, True, 0.1, 1e-5,
                         False)
    return torch.linear(torch.relu(h), self.w2)
)JIT");
  return scripted;
}

TEST_F(TorchScript, AJitModuleFineTunesThroughAHolderModuleAtO2) {
  auto scripted = scripted_linear_norm();
  ScriptedHolder holder(scripted, std::vector<std::string>{"gamma", "beta", "mean", "var"});
  keep_in_fp32(*holder->fp32);
  torch::optim::SGD opt(holder->parameters(), torch::optim::SGDOptions(0.1));
  auto unit = torch::jit::compile(kSource);
  Net reference;
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  Options quiet;
  quiet.verbosity = 0;
  initialize(holder, opt, "O2", quiet);
  const auto has_working_copy = [&](const char* name) {
    return scripted.attr(name).toTensor().key_set().has(c10::DispatchKey::AutocastXLA);
  };
  EXPECT_TRUE(has_working_copy("w1"));
  EXPECT_FALSE(has_working_copy("gamma")) << "kept fp32 through the marked child holder";
  for (int step = 0; step < 4; ++step) {
    const auto x = batch(step);
    opt.zero_grad();
    // The holder has no boundary: inputs in the model dtype, as amp::forward would pass them.
    const auto out = scripted.forward({x.to(at::kHalf)}).toTensor();
    EXPECT_EQ(out.scalar_type(), at::kHalf) << "the forward saw the working copies";
    const auto loss = out.to(at::kFloat).pow(2).mean();
    scaled_step(loss, opt);
    const auto ref_loss = reference_step(*unit, reference, ref_opt, x);
    EXPECT_TRUE(all_close(loss.detach(), ref_loss, testing::tolerance("train_float16")))
        << "step " << step;
  }
  EXPECT_EQ(scripted.attr("w1").toTensor().scalar_type(), at::kFloat) << "fp32 masters";
  // The batch norm ran on fp32 tensors (kept) and its running statistics moved as fp32's.
  EXPECT_TRUE(all_close(scripted.attr("mean").toTensor(), reference->mean,
                        testing::tolerance("train_float16")));
  EXPECT_TRUE(all_close(scripted.attr("w1").toTensor(), reference->w1,
                        testing::tolerance("train_float16")));
}

TEST_F(TorchScript, TheUsersOwnSettingComesBackWhenCastingGoesOff) {
  torch::jit::setGraphExecutorOptimize(false);
  Net net;
  Options quiet;
  quiet.verbosity = 0;
  initialize(net, "O1", quiet);
  {
    disable_casts off;  // the key stays on inside disable_casts: still unoptimized
    EXPECT_FALSE(torch::jit::getGraphExecutorOptimize());
  }
  reset();
  EXPECT_FALSE(torch::jit::getGraphExecutorOptimize());  // it was off before initialize
  torch::jit::setGraphExecutorOptimize(true);
  initialize(net, "O1", quiet);
  EXPECT_FALSE(torch::jit::getGraphExecutorOptimize());
  reset();
  EXPECT_TRUE(torch::jit::getGraphExecutorOptimize());
}

}  // namespace
}  // namespace amp
