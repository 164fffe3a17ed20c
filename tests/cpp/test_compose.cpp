// optamp's per-thread state travels where at::ThreadLocalState travels (the autograd engine's
// device threads, at::launch), and a recompute-style custom autograd Function sees the same
// rules in its no_grad forward and its recompute.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <thread>

#include "optamp/amp.h"
#include "optamp/autocast.h"
#include "test_util.h"

namespace amp {
namespace {

struct LinearNetImpl : torch::nn::Module {
  at::Tensor w;
  LinearNetImpl() {
    at::manual_seed(0);
    w = register_parameter("w", at::randn({8, 8}) * 0.3);
  }
};
TORCH_MODULE(LinearNet);

class Compose : public ::testing::Test {
 protected:
  void SetUp() override {
    Options o;
    o.verbosity = 0;
    initialize(net_, opt_, "O1", o);
  }
  void TearDown() override { reset(); }
  LinearNet net_;
  torch::optim::SGD opt_{net_->parameters(), torch::optim::SGDOptions(0.1)};
};

at::ScalarType mm_dtype() {
  const at::Tensor a = at::randn({4, 4}, at::requires_grad());
  return at::mm(a, a).scalar_type();
}

// What the autograd engine does on its device threads, and at::launch on the inter-op pool.
at::ScalarType mm_dtype_on_another_thread_with(const at::ThreadLocalState& state) {
  at::ScalarType out = at::kByte;
  std::thread([&] {
    at::ThreadLocalStateGuard guard(state);
    out = mm_dtype();
  }).join();
  return out;
}

TEST_F(Compose, ThreadLocalStateCarriesTheLevelRegionsAndDisableCasts) {
  EXPECT_EQ(mm_dtype_on_another_thread_with(at::ThreadLocalState()), at::kHalf);
  {
    autocast region(true, at::kBFloat16);
    EXPECT_EQ(mm_dtype_on_another_thread_with(at::ThreadLocalState()), at::kBFloat16);
  }
  {
    disable_casts off;
    EXPECT_EQ(mm_dtype_on_another_thread_with(at::ThreadLocalState()), at::kFloat);
  }
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(mm_dtype_on_another_thread_with(at::ThreadLocalState()), at::kFloat);
    rules_under_no_grad ungated;
    EXPECT_EQ(mm_dtype_on_another_thread_with(at::ThreadLocalState()), at::kHalf);
  }
  // The receiving thread's own guards stack on top of the carried state and give it back.
  autocast region(true, at::kBFloat16);
  const at::ThreadLocalState carried;
  std::thread([&] {
    at::ThreadLocalStateGuard guard(carried);
    {
      disable_casts off;
      EXPECT_EQ(mm_dtype(), at::kFloat);
    }
    EXPECT_EQ(mm_dtype(), at::kBFloat16);
  }).join();
}

// A hand-written checkpoint: the forward runs under no_grad (autograd::Function::forward always
// does) and keeps no activations; backward recomputes with grad on. With rules_under_no_grad the
// two runs cast alike; without it the forward would run fp32 and the recompute fp16.
struct Recompute : torch::autograd::Function<Recompute> {
  static at::ScalarType forward_dtype;
  static at::ScalarType recompute_dtype;

  static at::Tensor block(const at::Tensor& x, const at::Tensor& w) { return at::mm(x, w).tanh(); }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    rules_under_no_grad same_rules_as_the_recompute;
    at::Tensor out = block(x, w);
    forward_dtype = out.scalar_type();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0].detach().requires_grad_(), w = saved[1].detach().requires_grad_();
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      out = block(x, w);
    }
    recompute_dtype = out.scalar_type();
    auto grads = torch::autograd::grad({out}, {x, w}, {grad_out[0]});
    return {grads[0], grads[1]};
  }
};
at::ScalarType Recompute::forward_dtype = at::kByte;
at::ScalarType Recompute::recompute_dtype = at::kByte;

TEST_F(Compose, RecomputeFunctionCastsItsNoGradForwardLikeItsRecompute) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 8}).requires_grad_();
  const at::Tensor out = Recompute::apply(x, net_->w);
  out.to(at::kFloat).sum().backward();
  EXPECT_EQ(Recompute::forward_dtype, at::kHalf);
  EXPECT_EQ(Recompute::recompute_dtype, at::kHalf);
  // The same gradients as the block run directly (same casts, same fp16 math).
  const at::Tensor x2 = x.detach().clone().requires_grad_();
  const at::Tensor w2 = net_->w.detach().clone().requires_grad_();
  Recompute::block(x2, w2).to(at::kFloat).sum().backward();
  ASSERT_TRUE(x.grad().defined() && net_->w.grad().defined());
  EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
  EXPECT_TRUE(at::equal(net_->w.grad(), w2.grad()));
}

}  // namespace
}  // namespace amp
