// The CUDA-graph recipe of docs/loss_scaling.md ("CUDA graphs") in C++: a whole O2/O5 training
// step (forward, scale_loss, backward, amp::FusedAdamW) captured once with at::cuda::CUDAGraph and
// replayed gives an eager run's parameters and loss scale bit for bit. The captured step makes its
// working copies in one batch (the cast cache's re-cast) from the graph's private pool, and the
// optimizer reads the overflow flag on the device, so no host decision is baked into the graph.
// Python's twin: tests/python/test_device_skip.py::test_cuda_graph_replays_match_eager_steps_...
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#if OPTAMP_TEST_CUDA_GRAPHS  // LibTorch built with CUDA (tests/cpp/CMakeLists.txt)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "mlp_model.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

class CudaGraph : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    OPTAMP_SKIP_WITHOUT_CUDA();
#if !OPTAMP_TEST_CUDA_GRAPHS
    GTEST_SKIP() << "this build's LibTorch has no CUDA";
#endif
    reset();
  }
  void TearDown() override { reset(); }
};

#if OPTAMP_TEST_CUDA_GRAPHS

struct Training {
  testing::Mlp model{nullptr};
  std::unique_ptr<FusedAdamW> optimizer;
};

Training start(const char* level) {
  at::manual_seed(0);
  Training t;
  t.model = testing::Mlp();
  t.model->to(at::kCUDA);
  t.optimizer =
      std::make_unique<FusedAdamW>(t.model->parameters(), torch::optim::AdamWOptions(1e-2));
  initialize(t.model, *t.optimizer, level, testing::quiet());
  return t;
}

// One step as the recipe writes it; the captured one leaves the grads in place (backward writes
// them again on every replay, into the graph's memory).
void train_step(Training& t, const at::Tensor& x, bool zero_grad) {
  {
    auto scaled = scale_loss(t.model->forward(x).to(at::kFloat).pow(2).mean(), *t.optimizer);
    scaled.backward();
  }
  t.optimizer->step();
  if (zero_grad) t.optimizer->zero_grad();
}

std::vector<at::Tensor> batches() {
  std::vector<at::Tensor> out;
  for (int i = 0; i < 7; ++i) {
    at::manual_seed(100 + i);
    out.push_back(at::randn({4, 8}).to(at::kCUDA));
  }
  return out;
}

TEST_P(CudaGraph, ReplaysMatchEagerStepsBitForBit) {
  const std::vector<at::Tensor> xs = batches();
  std::vector<at::Tensor> eager;
  at::Tensor eager_scale;
  {
    Training t = start(GetParam());
    for (const auto& x : xs) train_step(t, x, /*zero_grad=*/true);
    eager = testing::snapshot(t.model->parameters());
    eager_scale = loss_scaler().scale_tensor().clone();
  }
  reset();

  Training t = start(GetParam());
  const at::Tensor static_x = xs[0].clone();  // the graph reads this storage
  at::cuda::CUDAGraph graph;
  c10::cuda::device_synchronize();
  {
    // Warm-up and capture on a side stream (capture refuses the legacy default stream).
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    for (int i = 0; i < 3; ++i) {
      static_x.copy_(xs[i]);
      train_step(t, static_x, /*zero_grad=*/true);
    }
    graph.capture_begin();
    train_step(t, static_x, /*zero_grad=*/false);
    graph.capture_end();
  }
  c10::cuda::device_synchronize();
  for (size_t i = 3; i < xs.size(); ++i) {  // capturing ran nothing: replays make steps 4-7
    static_x.copy_(xs[i]);
    graph.replay();
  }
  c10::cuda::device_synchronize();
  const std::vector<at::Tensor> replayed = testing::snapshot(t.model->parameters());
  ASSERT_EQ(replayed.size(), eager.size());
  for (size_t i = 0; i < eager.size(); ++i) {
    EXPECT_TRUE(at::equal(replayed[i], eager[i])) << "parameter " << i;
  }
  EXPECT_TRUE(at::equal(loss_scaler().scale_tensor(), eager_scale));
}

#else

TEST_P(CudaGraph, ReplaysMatchEagerStepsBitForBit) {}  // SetUp skips it

#endif

INSTANTIATE_TEST_SUITE_P(Levels, CudaGraph, ::testing::Values("O2", "O5"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) + "_CUDA";
                         });

}  // namespace
}  // namespace amp
