#pragma once
// The Fashion-MNIST CNN of the A/B trainer (train_fashion_mnist.cpp), in a header of its own so
// benchmarks (benchmarks/dispatch_icount.cpp) measure the same model. The Python trainer
// (examples/python/train_fashion_mnist.py) defines the same layout.
#include <torch/nn.h>

namespace fashion_mnist {

struct NetImpl : torch::nn::Module {
  NetImpl()
      // Sized for CPU runs: fp16 convolutions have only reference kernels on CPUs, so the
      // channel counts set the cost of the O1/O2 runs (16/32 is 4x cheaper than 32/64).
      : conv1(torch::nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)),
        bn1(16),
        conv2(torch::nn::Conv2dOptions(16, 32, 3).padding(1).bias(false)),
        bn2(32),
        fc1(32 * 7 * 7, 128),
        fc2(128, 10) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);  // 16 x 14 x 14
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);  // 32 x 7 x 7
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

}  // namespace fashion_mnist
