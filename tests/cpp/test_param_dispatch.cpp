// O2/O5 substitution reaches dispatch through the registered tensors' own key sets: which
// tensors carry the key, which ops get to the substitution kernels (only those with a registered
// tensor argument; never a backward op), the unboxed kernels of the hot ops, and set_data
// (Module::to, `p.data = x`), which would drop the key.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn.h>

#include <thread>

#include "dispatch/substitution.h"
#include "dispatch/substitution_call.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using detail::kSubstituteKey;

bool carries_key(const at::Tensor& t) { return t.key_set().has(kSubstituteKey); }

struct NetImpl : torch::nn::Module {
  NetImpl() {
    register_module("fc", fc);
    register_module("bn", bn);
    register_module("conv", conv);
    register_module("emb", emb);
    register_module("ln", ln);
  }
  torch::nn::Linear fc{4, 4};
  torch::nn::BatchNorm1d bn{4};
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(2, 3, 3).padding(1)};
  torch::nn::Embedding emb{10, 4};
  torch::nn::LayerNorm ln{torch::nn::LayerNormOptions({4})};
};
TORCH_MODULE(Net);

class ParamDispatch : public ::testing::Test {
 protected:
  void init(const char* level) {
    Options quiet;
    quiet.verbosity = 0;
    initialize(net, level, quiet);
  }
  void TearDown() override { reset(); }
  // Substitution calls made on this thread while `fn` runs.
  template <typename Fn>
  static std::uint64_t calls_during(Fn&& fn) {
    const auto before = detail::substitution_calls_on_this_thread();
    fn();
    return detail::substitution_calls_on_this_thread() - before;
  }
  Net net;
};

TEST_F(ParamDispatch, OnlyRegisteredModelTensorsCarryTheKey) {
  EXPECT_FALSE(carries_key(net->fc->weight));
  init("O5");
  EXPECT_TRUE(carries_key(net->fc->weight));
  EXPECT_TRUE(carries_key(net->fc->bias));
  EXPECT_TRUE(carries_key(net->conv->weight));
  // Batch-norm tensors stay fp32 (keep_batchnorm_fp32): not sources, no key.
  EXPECT_FALSE(carries_key(net->bn->weight));
  EXPECT_FALSE(carries_key(net->bn->running_mean));
  EXPECT_FALSE(carries_key(at::randn({4})));
  EXPECT_TRUE(detail::substitution_thread_on());
  reset();
  EXPECT_FALSE(carries_key(net->fc->weight));
  EXPECT_FALSE(detail::substitution_thread_on());
}

TEST_F(ParamDispatch, LevelsWithoutWorkingCopiesPutNoKeyOnTensors) {
  for (const char* level : {"O0", "O1", "O3", "O4"}) {
    SCOPED_TRACE(level);
    net = Net();  // O3 casts the model in place
    init(level);
    EXPECT_FALSE(carries_key(net->fc->weight));
    EXPECT_FALSE(detail::substitution_thread_on());
    reset();
  }
}

TEST_F(ParamDispatch, ReinitializingMovesTheKeyToTheNewModel) {
  init("O5");
  Net other;
  reset();
  Options quiet;
  quiet.verbosity = 0;
  initialize(other, "O2", quiet);
  EXPECT_FALSE(carries_key(net->fc->weight));
  EXPECT_TRUE(carries_key(other->fc->weight));
}

TEST_F(ParamDispatch, OpsWithoutARegisteredTensorNeverReachSubstitution) {
  init("O5");
  const auto x = at::randn({4, 4});
  EXPECT_EQ(calls_during([&] { at::relu(x); }), 0u);
  EXPECT_EQ(calls_during([&] { at::mm(x, x); }), 0u);
  EXPECT_EQ(calls_during([&] { at::add(x, 1.0); }), 0u);
  EXPECT_GT(calls_during([&] { at::mm(x, net->fc->weight); }), 0u);
  EXPECT_EQ(at::mm(x, net->fc->weight).scalar_type(), at::kBFloat16);
}

TEST_F(ParamDispatch, FusedOptimizerStepsNeverReachSubstitution) {
  // torch's fused steps write every list they take: substitution could not apply, and falling
  // through spares boxing the lists of every parameter each step. The step still trains the
  // fp32 masters.
  init("O5");
  FusedAdamW adamw(net->fc->parameters(), torch::optim::AdamWOptions(0.1));
  FusedSGD sgd(net->ln->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto x = at::randn({8, 4});
  auto backward = [&] { net->ln(net->fc(x)).to(at::kFloat).pow(2).mean().backward(); };
  backward();
  adamw.step();  // the first steps make the optimizers' state (zeros_like the parameters)
  sgd.step();
  backward();
  const at::Tensor weight = net->fc->weight.detach().clone();
  const at::Tensor gamma = net->ln->weight.detach().clone();
  EXPECT_EQ(calls_during([&] {
              adamw.step();
              sgd.step();
            }),
            0u);
  EXPECT_EQ(net->fc->weight.scalar_type(), at::kFloat);
  EXPECT_FALSE(at::equal(net->fc->weight, weight));
  EXPECT_FALSE(at::equal(net->ln->weight, gamma));
  // An op that reads a parameter still gets its working copy.
  EXPECT_GT(calls_during([&] { at::mm(x, net->fc->weight); }), 0u);
}

TEST_F(ParamDispatch, LinearOnAThreeDimensionalInputTrainsItsBiasMaster) {
  // LibTorch's Linear: matmul, then `output += bias` (an in-place add reading the parameter).
  init("O5");
  const auto out = net->fc(at::randn({2, 3, 4}));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  out.to(at::kFloat).sum().backward();
  ASSERT_TRUE(net->fc->bias.grad().defined());
  EXPECT_EQ(net->fc->bias.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(net->fc->bias.grad(), at::full({4}, 6.0f)));  // 2 x 3 rows
}

TEST_F(ParamDispatch, BackwardNeverReachesSubstitution) {
  init("O5");
  const auto x = at::randn({8, 4});
  const auto out = net->ln(net->fc(x) + net->emb(at::arange(4)).sum(0));
  const auto loss = out.to(at::kFloat).pow(2).mean();
  EXPECT_EQ(calls_during([&] { loss.backward(); }), 0u);
  ASSERT_TRUE(net->fc->weight.grad().defined());
  EXPECT_EQ(net->fc->weight.grad().scalar_type(), at::kFloat);  // into the fp32 master
}

TEST_F(ParamDispatch, DetachedAliasesCarryTheKeyButAreNotSubstituted) {
  init("O5");
  const auto w = net->fc->weight;
  const auto x = at::randn({4, 4}).to(at::kBFloat16);
  // add is not a rule at O5: the dtype tells whether `w` was seen as its bf16 working copy.
  EXPECT_EQ(at::add(x, w).scalar_type(), at::kBFloat16);
  const auto alias = w.detach();
  EXPECT_TRUE(carries_key(alias));  // torch copies the key set to shallow copies
  EXPECT_EQ(at::add(x, alias).scalar_type(), at::kFloat);
  EXPECT_EQ(w.detach().clone().scalar_type(), at::kFloat);
}

struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {
    inv_freq = register_buffer("inv_freq", torch::rand({4}) / 3);
  }
  torch::nn::Linear fc;
  torch::Tensor inv_freq;
};
TORCH_MODULE(WithBuffer);

// `b.to(at::kFloat)` of an fp32 buffer needs no conversion and used to hand back `b` itself, which
// the next op read as its working copy (Hugging Face's rotary angles); it is a copy of the buffer's
// own values now. A parameter's stays the parameter (Python reassigns it as a Parameter).
TEST_F(ParamDispatch, AConversionToItsOwnDtypeReadsItsValues) {
  WithBuffer model;
  Options quiet;
  quiet.verbosity = 0;
  initialize(model, "O5", quiet);
  const auto b = model->inv_freq;
  const auto x = at::rand({4}) * 4000;
  const auto exact = x * b.detach();
  EXPECT_TRUE(at::equal(x * b.to(at::kFloat), exact));
  EXPECT_TRUE(at::equal(x * b.to(b.device(), at::kFloat), exact));
  EXPECT_TRUE(at::equal(x * b.type_as(x), exact));
  EXPECT_FALSE(at::equal(x * b, exact));  // the buffer itself: its bf16 working copy
  // A parameter's conversion that names only a dtype reads its values too (Mamba's
  // `-exp(A_log.float())` computed in bf16 before); one that names a place stays the parameter.
  const auto& w = model->fc->weight;
  const auto w32 = w.detach();
  EXPECT_FALSE(w.to(at::kFloat).is_same(w));
  EXPECT_TRUE(at::equal(w.to(at::kFloat).exp(), w32.exp()));
  EXPECT_TRUE(at::equal(w.type_as(x).exp(), w32.exp()));
  EXPECT_TRUE(at::equal(w.to(x).exp(), w32.exp()));  // to.other
  EXPECT_EQ(w.to(at::kFloat).exp().scalar_type(), at::kFloat);
  EXPECT_TRUE(w.to(w.device(), at::kFloat).is_same(w));
  EXPECT_TRUE(w.to(at::TensorOptions().device(w.device())).is_same(w));
  EXPECT_EQ(w.exp().scalar_type(), at::kBFloat16);  // the parameter itself: its working copy
}

TEST_F(ParamDispatch, UnboxedKernelsSeeTheSameWorkingCopiesAsTheFallback) {
  init("O5");
  const auto& fc = net->fc;
  const auto x = at::randn({3, 4});
  const auto w16 = fc->weight.to(at::kBFloat16), b16 = fc->bias.to(at::kBFloat16);
  // Each call against the same call with the working copies passed explicitly: bit-identical.
  EXPECT_TRUE(at::equal(at::linear(x, fc->weight, fc->bias), at::linear(x, w16, b16)));
  EXPECT_TRUE(at::equal(at::mm(x, fc->weight.t()), at::mm(x, w16.t())));
  EXPECT_TRUE(at::equal(at::matmul(x, fc->weight), at::matmul(x, w16)));
  EXPECT_TRUE(at::equal(at::addmm(fc->bias, x, fc->weight), at::addmm(b16, x, w16)));
  const auto xb = x.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(at::add(xb, fc->weight.sum(0)), at::add(xb, w16.sum(0))));
  EXPECT_TRUE(at::equal(at::mul(xb, fc->bias), at::mul(xb, b16)));
  at::Tensor in_place = xb.clone();  // written: its own; the bias it reads: the working copy
  EXPECT_TRUE(at::equal(in_place.add_(fc->bias), xb.clone().add_(b16)));
  EXPECT_TRUE(at::equal(fc->weight.view({16}), w16.view({16})));
  EXPECT_TRUE(at::equal(fc->weight.reshape({2, 8}), w16.reshape({2, 8})));
  EXPECT_TRUE(at::equal(fc->weight.transpose(0, 1), w16.transpose(0, 1)));
  const auto& conv = net->conv;
  const auto image = at::randn({1, 2, 5, 5});
  EXPECT_TRUE(at::equal(
      at::conv2d(image, conv->weight, conv->bias, 1, 1),
      at::conv2d(image, conv->weight.to(at::kBFloat16), conv->bias.to(at::kBFloat16), 1, 1)));
  const auto ids = at::arange(5);
  EXPECT_TRUE(at::equal(at::embedding(net->emb->weight, ids),
                        at::embedding(net->emb->weight.to(at::kBFloat16), ids)));
  EXPECT_EQ(at::embedding(net->emb->weight, ids).scalar_type(), at::kBFloat16);
}

// The cast kernels run above substitution: a promote call weighs a model tensor in the dtype its
// op will see (the working copy's), and one it widens reads the fp32 master itself.
TEST_F(ParamDispatch, PromoteCallsWeighModelTensorsAsTheirWorkingCopies) {
  init("O5");
  const auto& bias = net->fc->bias;
  const auto x = at::randn({4});
  const auto xb = x.to(at::kBFloat16);
  const auto same_width = at::vdot(bias, xb);  // bf16 and bf16: the working copy, not promoted
  EXPECT_EQ(same_width.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(same_width, at::vdot(bias.to(at::kBFloat16), xb)));
  const auto widened = at::vdot(bias, x);  // bf16 and fp32: the master
  EXPECT_EQ(widened.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(widened, at::vdot(bias.detach(), x)));
  widened.backward();
  EXPECT_TRUE(at::equal(bias.grad(), x));  // straight into the fp32 master
  // nn::EmbeddingBag with per-sample weights in the model's reduced dtype (the model boundary's
  // cast of an input): the working copy, as at O2 before the promote rules applied there.
  const auto ids = at::arange(6);
  const auto offsets = at::tensor({0, 3}, at::kLong);
  const auto psw = at::rand({6}).to(at::kBFloat16);
  const auto bag = std::get<0>(
      at::embedding_bag(net->emb->weight, ids, offsets, false, 0, false, psw, false, std::nullopt));
  EXPECT_EQ(bag.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(
      at::equal(bag, std::get<0>(at::embedding_bag(net->emb->weight.to(at::kBFloat16), ids, offsets,
                                                   false, 0, false, psw, false, std::nullopt))));
}

TEST_F(ParamDispatch, SetDataKeepsTheKeyOnARegisteredParameter) {
  init("O5");
  auto w = net->fc->weight;
  // What Module::to(device) and `p.data = x` do: the TensorImpl takes the new data's key set.
  w.set_data(w.detach().clone());
  EXPECT_TRUE(carries_key(w));
  EXPECT_EQ(net->fc(at::randn({2, 4})).scalar_type(), at::kBFloat16);
  net->to(at::kCPU);
  EXPECT_TRUE(carries_key(net->fc->weight));
  // A later cast of the model is still caught with its own message.
  net->to(at::kDouble);
  OPTAMP_EXPECT_THROW_WITH(net->fc(at::randn({2, 4}, at::kDouble)), c10::ValueError,
                           "must still be torch.float32", "cast after initialize");
}

TEST_F(ParamDispatch, SetDataOnAThreadWithoutAmpStateKeepsTheKeyToo) {
  init("O5");
  auto w = net->fc->weight;
  // set_data is not dispatched (Tensor::set_data calls autograd's hooks directly), so it is
  // caught whichever thread makes it.
  std::thread([&] { w.set_data(w.detach().clone()); }).join();
  EXPECT_TRUE(carries_key(w));
  EXPECT_EQ(net->fc(at::randn({2, 4})).scalar_type(), at::kBFloat16);
}

TEST_F(ParamDispatch, SetDataOnOtherTensorsLeavesTheirKeySetsAlone) {
  init("O5");
  auto plain = at::randn({4, 4}).requires_grad_();
  plain.set_data(net->fc->weight.detach());  // takes the (keyed) key set of its new data
  EXPECT_TRUE(carries_key(plain));           // as torch copies it; not a source
  EXPECT_EQ(at::add(at::randn({4, 4}).to(at::kBFloat16), plain).scalar_type(), at::kFloat);
  auto other = at::randn({4});
  other.set_data(at::randn({4}));
  EXPECT_FALSE(carries_key(other));
}

TEST_F(ParamDispatch, ThreadsWithoutAmpStateSeeTheMasters) {
  init("O5");
  at::ScalarType seen = at::kBFloat16;
  std::uint64_t calls = 1;
  std::thread([&] {
    const auto before = detail::substitution_calls_on_this_thread();
    seen = net->fc(at::randn({2, 4})).scalar_type();
    calls = detail::substitution_calls_on_this_thread() - before;
  }).join();
  EXPECT_EQ(seen, at::kFloat);
  EXPECT_EQ(calls, 0u);
  // With this thread's state handed over, the other thread substitutes too.
  const ThreadState state = ThreadState::capture();
  std::thread([&] {
    thread_state_guard guard(state);
    seen = net->fc(at::randn({2, 4})).scalar_type();
  }).join();
  EXPECT_EQ(seen, at::kBFloat16);
}

TEST_F(ParamDispatch, NoGradEvaluationSeesTheMasters) {
  init("O5");
  at::NoGradGuard no_grad;
  EXPECT_EQ(net->fc(at::randn({2, 4})).scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace amp
