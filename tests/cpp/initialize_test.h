#pragma once
// What the amp::initialize tests share (test_initialize_{levels,dtypes,overloads,validation,
// messages}.cpp, test_o2_working_copies.cpp, test_o3_cast.cpp, test_thread_state.cpp,
// test_scheduler_clipping.cpp, test_checkpoint.cpp, test_reset.cpp): a small model with dtype
// probes inside forward, its batches and optimizers, one training step through the public API,
// and the fixtures of the Initialize* suites, which reset optamp after each test. Their
// device-parametrized tests run on CUDA too where a GPU is visible.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <vector>

#include "optamp/amp.h"
#include "test_util.h"

namespace amp::testing {

using at::ScalarType;

// conv + batch-norm + linear + layer-norm + embedding, with dtype probes inside forward.
struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(1, 4, 3)};
  torch::nn::BatchNorm2d bn{4};
  torch::nn::Linear fc1{4 * 6 * 6, 16};
  torch::nn::LayerNorm ln{torch::nn::LayerNormOptions({16})};
  torch::nn::Embedding emb{3, 16};
  torch::nn::Linear fc2{16, 4};
  ScalarType conv_out{}, bn_out{}, fc_out{}, ln_out{};

  NetImpl() {
    register_module("conv", conv);
    register_module("bn", bn);
    register_module("fc1", fc1);
    register_module("ln", ln);
    register_module("emb", emb);
    register_module("fc2", fc2);
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& tag) {
    auto h = conv(x);
    conv_out = h.scalar_type();
    h = bn(h);
    bn_out = h.scalar_type();
    h = fc1(at::relu(h).flatten(1));
    fc_out = h.scalar_type();
    h = ln(h);
    ln_out = h.scalar_type();
    h = h + emb(tag);
    return fc2(at::relu(h));
  }
};
TORCH_MODULE(Net);

struct Batch {
  at::Tensor x, tag, y;
};

inline std::vector<Batch> make_batches(int n) {
  at::manual_seed(123);
  std::vector<Batch> batches;
  for (int i = 0; i < n; ++i) {
    batches.push_back({at::randn({8, 1, 8, 8}), at::randint(0, 3, {8}), at::randint(0, 4, {8})});
  }
  return batches;
}

inline std::vector<Batch> batches_on(at::Device device, int n = 4) {
  auto batches = make_batches(n);
  for (auto& b : batches) b = {b.x.to(device), b.tag.to(device), b.y.to(device)};
  return batches;
}

inline Net make_net() {
  at::manual_seed(7);
  return Net();
}

// The same initial weights on `device` (moved before any optimizer sees them).
inline Net make_net_on(at::Device device) {
  Net net = make_net();
  net->to(device);
  return net;
}

enum class Opt { kSgd, kAdam };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Net& net, Opt kind,
                                                               double adam_eps = 1e-8) {
  if (kind == Opt::kSgd) {
    return std::make_unique<torch::optim::SGD>(net->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(net->parameters(),
                                              torch::optim::AdamOptions(1e-3).eps(adam_eps));
}

// One training step through the public API; returns the loss.
inline double train_step(Net& net, torch::optim::Optimizer& opt, const Batch& b) {
  opt.zero_grad();
  auto loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  {
    auto scaled = scale_loss(loss, opt);
    scaled.backward();
  }
  opt.step();
  return loss.item<double>();
}

// The parameters as fp32 CPU tensors (comparable across levels and devices).
inline std::vector<at::Tensor> fp32_cpu_params(Net& net) {
  std::vector<at::Tensor> params;
  for (const auto& p : net->parameters()) {
    params.push_back(p.detach().to(at::kCPU, at::kFloat).clone());
  }
  return params;
}

// Resets optamp after each test (the other Initialize* fixtures derive from it).
class Initialize : public ::testing::Test {
 protected:
  void TearDown() override { reset(); }
};

// Single tests on the CPU and on CUDA (skipped where no GPU is visible). Instantiated once, as
// Devices/InitializeOnDevice, in test_o2_working_copies.cpp: that covers the TEST_Ps of every file.
class InitializeOnDevice : public Initialize, public ::testing::WithParamInterface<at::DeviceType> {
 protected:
  void SetUp() override { OPTAMP_SKIP_UNLESS_VISIBLE(GetParam()); }
};

}  // namespace amp::testing
