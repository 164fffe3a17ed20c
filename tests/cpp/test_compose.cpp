// optamp's per-thread state travels where at::ThreadLocalState travels (the autograd engine's
// device threads, at::launch), and a recompute-style custom autograd Function sees the same
// rules in its no_grad forward and its recompute.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <thread>
#include <type_traits>

#include "optamp/amp.h"
#include "optamp/autocast.h"
#include "optamp/core.h"
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
    lift_no_grad_gate ungated;
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
// does) and keeps no activations; backward recomputes with grad on. With lift_no_grad_gate the
// two runs cast alike; without it the forward would run fp32 and the recompute fp16.
struct Recompute : torch::autograd::Function<Recompute> {
  static at::ScalarType forward_dtype;
  static at::ScalarType recompute_dtype;

  static at::Tensor block(const at::Tensor& x, const at::Tensor& w) { return at::mm(x, w).tanh(); }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    lift_no_grad_gate same_rules_as_the_recompute;
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

// ---- the spellings LibTorch programs use (issue 16, items 1-2) ----------------------------------

struct TwoLayerImpl : torch::nn::Module {
  at::Tensor w1, w2;
  explicit TwoLayerImpl(int seed = 0) {
    at::manual_seed(seed);
    w1 = register_parameter("w1", at::randn({8, 8}) * 0.3);
    w2 = register_parameter("w2", at::randn({8, 2}) * 0.3);
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(at::mm(x, w1)).mm(w2); }
};
TORCH_MODULE(TwoLayer);

class Spellings : public ::testing::Test {
 protected:
  void TearDown() override { reset(); }
  static Options quiet() {
    Options o;
    o.verbosity = 0;
    return o;
  }
};

// The official MNIST example declares `Net model;`: a module on the stack, not owned by a
// shared_ptr (shared_from_this threw std::bad_weak_ptr and ended the program).
TEST_F(Spellings, ModuleOnTheStackInitializesAndTrains) {
  TwoLayerImpl model(1);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  initialize(model, opt, "O1", quiet());
  const at::Tensor before = model.w1.detach().clone();
  const at::Tensor x = at::randn({4, 8});
  EXPECT_EQ(model.forward(x).scalar_type(), at::kHalf);
  {
    auto scaled = scale_loss(model.forward(x).to(at::kFloat).pow(2).mean(), opt);
    scaled.backward();
  }
  opt.step();
  EXPECT_FALSE(at::equal(model.w1, before));
  reset();
  TwoLayerImpl other(2);  // O2 registers the stack module's parameters for substitution
  torch::optim::SGD opt2(other.parameters(), torch::optim::SGDOptions(0.1));
  initialize(other, opt2, "O2", quiet());
  EXPECT_EQ(at::add(other.w1, 1.0).scalar_type(), at::kHalf);
  reset();
  initialize(other, "O4", quiet());  // and without an optimizer
  EXPECT_EQ(other.forward(x).scalar_type(), at::kBFloat16);
}

// The DCGAN example: two holders, two optimizers by reference, a loss id.
TEST_F(Spellings, ListFormsTakeHoldersReferencesAndLossIds) {
  TwoLayer generator(1), discriminator(2);
  torch::optim::Adam g_opt(generator->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam d_opt(discriminator->parameters(), torch::optim::AdamOptions(1e-3));
  Options o = quiet();
  o.num_losses = 2;
  initialize({generator, discriminator}, {g_opt, d_opt}, "O1", o);
  const at::Tensor x = at::randn({4, 8});
  {
    auto scaled = scale_loss(discriminator->forward(x).to(at::kFloat).mean(), d_opt, 1);
    scaled.backward();
  }
  EXPECT_TRUE(step(d_opt));
  {
    auto scaled = scale_loss((generator->forward(x).to(at::kFloat).mean() +
                              discriminator->forward(x).to(at::kFloat).mean()),
                             {g_opt, d_opt});
    scaled.backward();
  }
  EXPECT_TRUE(step({g_opt, d_opt}));
  reset();
  // Pointers, shared_ptrs and a module reference mix in one list.
  TwoLayerImpl stack_model(3);
  torch::optim::SGD s_opt(stack_model.parameters(), torch::optim::SGDOptions(0.1));
  initialize({generator.ptr(), stack_model}, {&g_opt, &s_opt}, OptLevel::O5, quiet());
  EXPECT_EQ(at::add(stack_model.w1, 1.0).scalar_type(), at::kBFloat16);
  {
    auto scaled = scale_loss(stack_model.forward(x).to(at::kFloat).mean(), s_opt, 0, true);
    scaled.backward();
  }
  {
    auto scaled = scale_loss(stack_model.forward(x).to(at::kFloat).mean(), {s_opt});
    scaled.backward();
  }
  EXPECT_TRUE(step({&s_opt}));
}

// initialize on a worker thread left the main thread silently in fp32 (issue 16, item 5).
TEST_F(Spellings, ScaleLossWarnsOnceOnAThreadWhereCastingIsOff) {
  TwoLayer net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  std::thread([&] { initialize(net, opt, "O1", quiet()); }).join();
  EXPECT_TRUE(is_initialized());
  const at::Tensor x = at::randn({4, 8});
  EXPECT_EQ(net->forward(x).scalar_type(), at::kFloat) << "this thread was never turned on";
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 2; ++i) {
    auto scaled = scale_loss(net->forward(x).pow(2).mean(), opt);
    scaled.backward();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  const std::string needle = "scale_loss runs on a thread where optamp's casting is off";
  ASSERT_NE(err.find(needle), std::string::npos) << err;
  EXPECT_EQ(err.find(needle), err.rfind(needle)) << "once";
}

// Module::to(device / dtype) replaces every parameter's data through set_data, which keeps the
// TensorImpl and its version: an O2 working copy of the old data must not be served after it
// (issue 16 item 4, the cache half).
TEST_F(Spellings, O2WorkingCopyFollowsSetDataAsModuleToDoes) {
  TwoLayer net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O2", quiet());
  const at::Tensor x = at::randn({4, 8});
  const at::Tensor before = net->forward(x);
  const auto version = net->w1._version();
  {
    at::NoGradGuard no_grad;
    net->w1.set_data(net->w1.detach() * 2);  // what Module::to does to each parameter
  }
  ASSERT_EQ(net->w1._version(), version)
      << "set_data keeps the version: the cache must look further";
  EXPECT_TRUE(at::equal(at::add(net->w1, 0.0), (net->w1.detach() * 1).to(at::kHalf)));
  EXPECT_FALSE(at::equal(net->forward(x), before));
  net->to(at::Device(at::kCPU));  // a device move on CPU: CPU -> CPU keeps training
  {
    auto scaled = scale_loss(net->forward(x).to(at::kFloat).pow(2).mean(), opt);
    scaled.backward();
  }
  EXPECT_TRUE(step(opt));
}

// model->to(dtype) after initialize failed later with torch's "mixed dtype" errors; now the next
// scale_loss says what happened and what to do, and changes nothing (issue 16 item 4).
TEST_F(Spellings, CastingTheModelAfterInitializeIsRefusedWithWhatToDo) {
  for (const char* level : {"O1", "O5"}) {
    TwoLayer net(1);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    initialize(net, opt, level, quiet());
    net->to(at::kDouble);
    const at::Tensor x = at::randn({4, 8}, at::kDouble);
    if (std::string(level) == "O1") {  // the forward runs; the next scale_loss says why not
      const at::Tensor loss = at::mm(x, net->w1).sum();
      OPTAMP_EXPECT_THROW_WITH(scale_loss(loss, opt), c10::ValueError,
                               "must still be torch.float32", "got torch.float64", "amp::reset()",
                               "cast the model");
    } else {  // O5: the first op that sees the cast master says it (not torch's mixed dtypes)
      OPTAMP_EXPECT_THROW_WITH(at::mm(x, net->w1), c10::ValueError, "must still be torch.float32",
                               "got torch.float64", "amp::reset()", "cast the model");
    }
    EXPECT_FALSE(net->w1.grad().defined());
    reset();  // what the message says: reset, cast (back to fp32 here), initialize again
    net->to(at::kFloat);
    initialize(net, opt, level, quiet());
    {
      auto scaled = scale_loss(at::mm(x.to(at::kFloat), net->w1).to(at::kFloat).mean(), opt);
      scaled.backward();
    }
    EXPECT_TRUE(net->w1.grad().defined());
    reset();
  }
}

// A device move after initialize keeps training: the working copies follow (storage check), the
// scaler's tensors follow the loss. (The CPU half is O2WorkingCopyFollowsSetDataAsModuleToDoes.)
TEST_F(Spellings, DeviceMoveAfterInitializeKeepsTraining_CUDA) {
  OPTAMP_SKIP_WITHOUT_CUDA();
  TwoLayer net(1);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  initialize(net, opt, "O2", quiet());
  const at::Tensor x = at::randn({4, 8});
  {
    auto scaled = scale_loss(net->forward(x).to(at::kFloat).mean(), opt);
    scaled.backward();
  }
  opt.step();
  net->to(at::kCUDA);
  const at::Tensor before = net->w1.detach().clone();
  const at::Tensor out = net->forward(x.cuda());
  EXPECT_TRUE(out.is_cuda());
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  opt.zero_grad();
  {
    auto scaled = scale_loss(out.to(at::kFloat).pow(2).mean(), opt);
    scaled.backward();
  }
  EXPECT_TRUE(step(opt));
  EXPECT_FALSE(at::equal(net->w1, before));
}

// Renamed names keep working as deprecated aliases: the guards (one name per idea, named like the
// other guards and like Python's) and core::initialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<ThreadStateGuard, thread_state_guard>);
static_assert(std::is_same_v<rules_under_no_grad, lift_no_grad_gate>);
TEST_F(Spellings, RenamedNamesKeepTheirOldSpellingsAsDeprecatedAliases) {
  EXPECT_FALSE(core::initialized());
  torch::nn::Linear net(2, 2);
  torch::optim::SGD opt(net->parameters(), 0.1);
  initialize(net, opt, "O1", quiet());
  EXPECT_TRUE(core::initialized());
  EXPECT_EQ(core::initialized(), core::is_initialized());
}
#pragma GCC diagnostic pop

}  // namespace
}  // namespace amp
