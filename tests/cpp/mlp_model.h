#pragma once
// The small model of the device-skip and CUDA-graph tests: two linears around a layer norm, so a
// step casts listed ops' weights (O1/O4) or every parameter (O2/O5) and keeps layer_norm's own.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace amp::testing {

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{8, 16};
  torch::nn::LayerNorm ln{torch::nn::LayerNormOptions({16})};
  torch::nn::Linear fc2{16, 4};
  MlpImpl() {
    register_module("fc1", fc1);
    register_module("ln", ln);
    register_module("fc2", fc2);
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(ln(fc1(x)))); }
};
TORCH_MODULE(Mlp);

}  // namespace amp::testing
