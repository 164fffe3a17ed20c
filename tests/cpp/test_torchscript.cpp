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
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
    {
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
    opt.step();
    ref_opt.zero_grad();
    at::Tensor ref_loss;
    {
      disable_casts off;
      ref_loss = run(*unit, reference->inputs(x)).pow(2).mean();
      ref_loss.backward();
    }
    ref_opt.step();
    EXPECT_TRUE(all_close(loss.detach(), ref_loss.detach(), testing::tolerance("train_float16")))
        << "step " << step;
  }
  EXPECT_TRUE(all_close(net->mean, reference->mean, testing::tolerance("train_float16")));
  reset();
  EXPECT_TRUE(torch::jit::getGraphExecutorOptimize());
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
