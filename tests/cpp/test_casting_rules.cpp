// When and how ops are cast (docs/casting.md): the rules per level and region, the no_grad gate,
// off means bitwise fp32 (disable_casts, enabled=False, other threads), what is never cast
// (doubles, integers, complex, written arguments, explicit result dtypes), autograd through the
// casts, native autocast owning its calls, the verbosity-2 cast log, and Apex's fp32 functions
// without an aten op of their own.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/functional/normalization.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "casting_test.h"
#include "common/step_events.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the casting fixtures

TEST_F(Casting, CastRulesNowFollowTheLevelTheGateAndRegions) {
  EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);  // no level yet
  enable("O1");
  EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kFullLists);
  EXPECT_EQ(cast_rules_now(at::kCPU).low, at::kHalf);
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);
    amp::autocast region(true, at::kBFloat16);
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kFullLists);
    EXPECT_EQ(cast_rules_now(at::kCPU).low, at::kBFloat16);
  }
  {
    disable_casts off;
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);
  }
}

TEST_F(Casting, PatchTypeBF16AtO1) {
  Options o;
  o.patch_torch_functions_type = at::kBFloat16;
  enable("O1", o);
  EXPECT_EQ(at::mm(randn({2, 3}), randn({3, 2})).scalar_type(), at::kBFloat16);
}

TEST_F(Casting, DoublesIntegersBoolsAndComplexAreNeverCast) {
  enable("O1");
  const auto before = cast_count();
  EXPECT_EQ(at::mm(randn({2, 3}, at::kDouble), randn({3, 2}, at::kDouble)).scalar_type(),
            at::kDouble);
  auto ints = at::ones({2, 2}, at::kLong);
  EXPECT_EQ(at::mm(ints, ints).scalar_type(), at::kLong);
  EXPECT_EQ(at::sum(at::ones({3}, at::kBool)).scalar_type(), at::kLong);
  // complex64 in a lower, an fp32 and a promote op: never a floating width to cast or count.
  auto c = randn({2, 2}, at::kComplexFloat);
  EXPECT_EQ(at::mm(c, c).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(at::exp(c).scalar_type(), at::kComplexFloat);
  EXPECT_TRUE(at::equal(at::exp(c), [&] {
    disable_casts off;
    return at::exp(c);
  }()));
  EXPECT_EQ(at::add(c, randn({2, 2}, at::kHalf)).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(cast_count(), before);
}

// fp16 meeting a complex scalar, a 0-dim complex tensor or a complex32 tensor is widened in a
// promote call (Apex's lists), so the result is complex64, as torch makes it of bf16: torch's own
// promotion gives complex32, which the CPU cannot exponentiate (an LRU's `1j * exp(theta_log)`
// at O2 failed). A complex64 tensor with dimensions promotes by itself (no cast); torch's lists
// leave the call as native autocast does.
TEST_F(Casting, Fp16MeetingAComplexValueMakesComplex64WithApexsLists) {
  enable("O1");
  const auto h = randn({3}, at::kHalf);
  const c10::Scalar i(c10::complex<double>(0, 1));
  auto before = cast_count();
  const auto by_i = at::mul(h, i);
  EXPECT_EQ(by_i.scalar_type(), at::kComplexFloat);
  EXPECT_TRUE(at::equal(at::imag(by_i), h.to(at::kFloat)));
  EXPECT_EQ(at::exp(by_i).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(at::add(h, at::scalar_tensor(i, at::kComplexFloat)).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(at::mul(h, at::ones({3}, at::kComplexHalf)).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(cast_count(), before + 3);
  before = cast_count();
  EXPECT_EQ(at::add(h, randn({3}, at::kComplexFloat)).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(at::mul(randn({3}, at::kBFloat16), i).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(cast_count(), before);  // torch's promotion gives complex64 there by itself
  Options torch_lists;
  torch_lists.op_lists = OpLists::kTorch;
  enable("O1", torch_lists);
  EXPECT_EQ(at::mul(h, i).scalar_type(), at::kComplexHalf);  // as native autocast
}

// A double in a promote call is placed by torch's promotion, as Apex (which promotes only a mix of
// fp16 and fp32) and torch.autocast (fp64 is not eligible) leave it: a 0-dim fp64 factor (an ODE
// solver's step size or tolerance, torchdiffeq's fp64 time) keeps the state's dtype. Widened to
// fp64 as the widest, the next linear failed on fp64 input beside its fp16 weights.
TEST_F(Casting, PromoteCallsLeaveDoublesToTorchsPromotion) {
  for (const char* level : {"O1", "O4"}) {
    enable(level);
    const at::ScalarType low = std::string(level) == "O1" ? at::kHalf : at::kBFloat16;
    const auto dt = at::scalar_tensor(0.25, at::kDouble);
    const auto before = cast_count();
    EXPECT_EQ(at::mul(dt, randn({3})).scalar_type(), at::kFloat) << level;
    EXPECT_EQ(at::add(randn({3}), dt).scalar_type(), at::kFloat) << level;
    EXPECT_EQ(at::mul(dt, randn({3}, low)).scalar_type(), low) << level;
    EXPECT_EQ(at::cat({randn({2}), randn({2}, at::kDouble)}).scalar_type(), at::kDouble) << level;
    EXPECT_EQ(cast_count(), before) << level;
    // The fp16/fp32 mix beside it is still promoted to fp32, by one cast.
    EXPECT_EQ(at::addcmul(randn({3}), randn({3}, low), dt).scalar_type(), at::kFloat) << level;
    EXPECT_EQ(cast_count(), before + 1) << level;
  }
}

// ---- autograd -------------------------------------------------------------------------------

struct TinyNet {
  at::Tensor w1, b1, w2, b2;
  explicit TinyNet(int seed) {
    at::manual_seed(seed);
    w1 = (at::randn({16, 8}) * 0.3).requires_grad_();
    b1 = at::zeros({16}).requires_grad_();
    w2 = (at::randn({4, 16}) * 0.3).requires_grad_();
    b2 = at::zeros({4}).requires_grad_();
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) const {
    auto h = at::relu(at::linear(x, w1, b1));
    return at::nll_loss(at::log_softmax(at::linear(h, w2, b2), 1), y);
  }
  void sgd_step(double lr) {
    c10::NoGradGuard no_grad;
    for (auto* p : {&w1, &b1, &w2, &b2}) {
      p->sub_(p->grad() * lr);
      p->mutable_grad().reset();
    }
  }
};

TEST_F(Casting, TrainingUnderO1MatchesFp32WithFp32Grads) {
  at::manual_seed(1);
  auto x = at::randn({32, 8});
  auto y = at::randint(0, 4, {32});
  TinyNet reference(7), mixed(7);
  for (int step = 0; step < 5; ++step) {
    reference.loss(x, y).backward();
    reference.sgd_step(0.1);
  }
  enable("O1");
  for (int step = 0; step < 5; ++step) {
    auto loss = mixed.loss(x, y);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);  // losses run in fp32
    loss.backward();
    for (auto* p : {&mixed.w1, &mixed.b1, &mixed.w2, &mixed.b2}) {
      ASSERT_EQ(p->grad().scalar_type(), at::kFloat);  // grads flow back to the fp32 params
    }
    mixed.sgd_step(0.1);
    detail::notify_weights_may_change();  // what scale_loss does after its unscale
  }
  const auto tol = testing::tolerance("train_float16");
  EXPECT_TRUE(testing::all_close(mixed.w1, reference.w1, tol));
  EXPECT_TRUE(testing::all_close(mixed.w2, reference.w2, tol));
}

// The cast of w.t() (a view: not cached) records no node of its own: the mm's edge leads to the
// view's TBackward and on to w's accumulator, and the fp16 gradient is converted on the way.
TEST_F(Casting, CastsKeepTheGraphToTheirSource) {
  enable("O1");
  auto w = randn({3, 4}).requires_grad_();
  auto x = randn({2, 4});
  auto out = at::mm(x, w.t());
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  ASSERT_TRUE(out.grad_fn());
  EXPECT_EQ(c10::Join(" ", testing::graph_node_names(out)),
            "MmBackward0 TBackward0 torch::autograd::AccumulateGrad");
  const auto g = randn({2, 3});
  out.backward(g.to(at::kHalf));
  ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(w.grad(), at::mm(g.to(at::kHalf).t(), x.to(at::kHalf)).to(at::kFloat)));
}

// An activation's cast (and a view of one's, as a loss casts logits.view(...)) keeps its
// ToCopyBackward node: without it the engine converts the gradient inside the consumer's node,
// beside that node's incoming gradient and saved tensors, and a large activation (logits cast to
// fp32 for the loss) raised the backward's peak memory by the converted gradient's size.
TEST_F(Casting, ActivationCastsRecordTheirOwnNode) {
  enable("O1");
  auto w = randn({3, 4}).requires_grad_();
  auto x = randn({2, 4}).requires_grad_();
  for (const bool through_a_view : {false, true}) {
    SCOPED_TRACE(through_a_view ? "a view of an activation" : "an activation");
    x.mutable_grad() = at::Tensor();
    auto h = at::mul(x, 2.0);  // fp32, made by an op: not a leaf
    if (through_a_view) h = h.view({4, 2}).view({2, 4});
    auto out = at::mm(h, w.t());
    EXPECT_EQ(out.scalar_type(), at::kHalf);
    const auto names = testing::graph_node_names(out);
    EXPECT_EQ(std::count(names.begin(), names.end(), "ToCopyBackward0"), 1)
        << c10::Join(" ", names);
    const auto g = randn({2, 3});
    out.backward(g.to(at::kHalf));
    ASSERT_EQ(x.grad().scalar_type(), at::kFloat);
    const auto expected = at::mm(g.to(at::kHalf), w.to(at::kHalf)).to(at::kFloat) * 2;
    EXPECT_TRUE(at::equal(x.grad(), expected));
  }
}

TEST_F(Casting, CompositeOpsCastOnceAndDoNotRecurse) {
  enable("O1");
  auto x = randn({2, 4});
  auto w = randn({3, 4});
  auto b = randn({3});
  const auto before = cast_count();
  auto out = at::linear(x, w, b);  // linear -> addmm/matmul inside: no second cast
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_EQ(cast_count() - before, 3);
  const auto before_einsum = cast_count();
  at::einsum("ij,kj->ik", {x, w});  // einsum -> bmm/permute inside
  EXPECT_EQ(cast_count() - before_einsum, 2);
}

// einsum is not listed: as under torch.autocast, its decomposition decides. A contraction
// reaches bmm (lowered); an outer product, an elementwise product or a sum reaches mul/sum and
// keeps fp32 (lowering einsum itself made a sum past 65504 inf).
TEST_F(Casting, EinsumIsCastOnlyWhereItContracts) {
  enable("O1");
  const auto a = randn({2, 3});
  const auto b = randn({2, 4});
  EXPECT_EQ(at::einsum("bi,bj->ij", {a, b}).scalar_type(), at::kHalf);
  EXPECT_EQ(at::einsum("bi,bj->bij", {a, b}).scalar_type(), at::kFloat);
  EXPECT_EQ(at::einsum("bi,bi->bi", {a, a}).scalar_type(), at::kFloat);
  const auto sum = at::einsum("ij->", {at::full({100, 10}, 100.0)});
  EXPECT_EQ(sum.scalar_type(), at::kFloat);
  EXPECT_EQ(sum.item<float>(), 100000.0F);
}

// ---- off means off --------------------------------------------------------------------------

TEST_F(Casting, OffMeansBitwiseFp32) {
  auto x = randn({8, 16});
  auto w = randn({4, 16});
  auto reference = at::log_softmax(at::linear(x, w), 1);
  detail::set_level_rules(resolve("O1"));  // rules set, but this thread never turned on
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  enable("O1");
  {
    disable_casts off;
    auto out = at::log_softmax(at::linear(x, w), 1);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(out, reference));
  }
  EXPECT_EQ(at::linear(x, w).scalar_type(), at::kHalf);  // back on after the scope
  detail::set_level_rules(resolve("O0"));
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  // The enabled=false override: the thread is on, but a disabled level has no rules.
  Options disabled;
  disabled.enabled = false;
  enable("O1", disabled);
  const auto before = cast_count();
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  EXPECT_EQ(at::mm(x, w.t()).scalar_type(), at::kFloat);
  EXPECT_EQ(cast_count(), before);
}

TEST_F(Casting, ThreadsWithoutAmpSeeFp32) {
  enable("O1");
  auto a = randn({2, 3});
  auto b = randn({3, 2});
  ScalarType other_thread = ScalarType::Undefined;
  std::thread([&] { other_thread = at::mm(a, b).scalar_type(); }).join();
  EXPECT_EQ(other_thread, at::kFloat);
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);
  // The documented way to carry the state into a worker.
  const auto state = ThreadState::capture();
  ScalarType carried = ScalarType::Undefined;
  std::thread([&] {
    thread_state_guard guard(state);
    carried = at::mm(a, b).scalar_type();
  }).join();
  EXPECT_EQ(carried, at::kHalf);
}

TEST_F(CastingInitialized, EnabledFalseIsBitwiseFp32AtEveryLevel) {
  const auto x = randn({8, 3});
  for (const char* level : {"O1", "O2", "O3", "O4", "O5"}) {
    SCOPED_TRACE(level);
    auto model = std::make_shared<OneWeight>();
    const auto reference = at::log_softmax(at::linear(x, model->w), 1);
    Options o = quiet();
    o.enabled = false;
    const Handle handle = initialize(model, level, o);
    EXPECT_FALSE(handle.properties().enabled);
    EXPECT_FALSE(is_casting_enabled());
    EXPECT_EQ(model->w.scalar_type(), at::kFloat);  // O3 does not cast the model either
    const auto before = cast_count();
    const auto out = at::log_softmax(at::linear(x, model->w), 1);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(out, reference));
    EXPECT_EQ((model->w * 2).scalar_type(), at::kFloat);  // no O2/O5 working copy
    EXPECT_EQ(cast_count(), before);
    reset();
  }
}

// ---- gate, regions, O3 ----------------------------------------------------------------------

TEST_F(Casting, NoGradRunsInGivenDtypesUnlessInAnAutocastRegion) {
  enable("O1");
  auto a = randn({2, 3});
  auto b = randn({3, 2});
  c10::NoGradGuard no_grad;
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);  // validation stays fp32
  {
    autocast region;
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);  // explicit reduced-precision inference
    autocast bf16(true, at::kBFloat16);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

// Under the gate the fp32 lists' rule still widens reduced input (a tensor made while autograd
// recorded), as Apex and native autocast cast there: SwAV's Sinkhorn takes the exp of detached
// fp16 scores over 0.05 under no_grad, which overflowed. fp32 input is left alone (nothing is
// cast), and `lower` ops run as given.
TEST_F(Casting, UnderTheGateTheFp32ListsWidenReducedInput) {
  for (const char* level : {"O1", "O4"}) {
    SCOPED_TRACE(level);
    enable(level);
    const ScalarType low = level[1] == '1' ? at::kHalf : at::kBFloat16;
    const auto scores = at::full({2, 3}, 0.9).to(low);
    c10::NoGradGuard no_grad;
    auto before = cast_count();
    const auto q = at::exp(scores / 0.05);
    EXPECT_EQ(q.scalar_type(), at::kFloat);
    EXPECT_TRUE(q.isfinite().all().item<bool>());                  // exp(18) overflows fp16
    EXPECT_EQ(at::softmax(scores, -1).scalar_type(), at::kFloat);  // through its dtype argument
    EXPECT_GT(cast_count(), before);
    before = cast_count();
    const auto f = randn({2, 3});
    EXPECT_EQ(at::exp(f).scalar_type(), at::kFloat);
    EXPECT_EQ(at::mm(f, f.t()).scalar_type(), at::kFloat);     // validation stays fp32
    EXPECT_EQ(at::mm(scores, scores.t()).scalar_type(), low);  // lower: as given
    EXPECT_EQ(cast_count(), before);
  }
  // At O2/O5 the fp32 list does not apply (Apex's O2 patches no functions); the fp32 losses do.
  enable("O2");
  const auto logits = randn({4, 3}).to(at::kHalf);
  c10::NoGradGuard no_grad;
  EXPECT_EQ(at::exp(logits).scalar_type(), at::kHalf);
  EXPECT_EQ(at::cross_entropy_loss(logits, at::zeros({4}, at::kLong)).scalar_type(), at::kFloat);
}

// Under the gate an in-place op that needs its source in the dtype of the tensor it writes (match
// self) still gets it: a memory bank takes detached fp16 features into its fp32 rows by
// `index_copy_` under no_grad, which torch refuses on the mix. Out of place the call is widened
// instead, as before (match self would narrow an fp32 source).
TEST_F(Casting, UnderTheGateInPlaceOpsTakeASourceOfAnotherWidth) {
  for (const char* level : {"O1", "O4"}) {
    SCOPED_TRACE(level);
    enable(level);
    const ScalarType low = level[1] == '1' ? at::kHalf : at::kBFloat16;
    const auto features = randn({3, 4}).to(low);
    const auto rows = at::tensor({0, 2, 5}, at::kLong);
    c10::NoGradGuard no_grad;
    const auto wide = features.to(at::kFloat);
    auto bank = at::zeros({6, 4});
    bank.index_copy_(0, rows, features);
    EXPECT_TRUE(at::equal(bank, at::zeros({6, 4}).index_copy_(0, rows, wide)));
    bank.index_add_(0, rows, features);
    bank.index_put_({rows}, features, /*accumulate=*/true);
    bank.scatter_add_(0, rows.unsqueeze(1).expand({3, 4}), features);
    bank.lerp_(at::zeros({6, 4}).to(low), 0.5);
    EXPECT_EQ(bank.scalar_type(), at::kFloat);
    const auto out_of_place =
        at::index_add(features, 0, at::tensor({0, 1}, at::kLong), randn({2, 4}));
    EXPECT_EQ(out_of_place.scalar_type(), at::kFloat);  // widened, not narrowed
  }
}

// Under the gate a call runs in the dtypes it is given, except one that could not run them: a
// listed op torch does not promote itself (lower, promote, fp32) given a reduced tensor made
// while autograd recorded and an fp32 one (spectral_norm's power iteration at O2/O5), or a 0-dim
// fp32 one (a scalar slope, a scalar target).
TEST_F(Casting, UnderTheGateMixedWidthsThatCannotRunAreWidened) {
  for (const char* level : {"O1", "O2", "O4", "O5"}) {
    SCOPED_TRACE(level);
    enable(level);
    const ScalarType low = level[1] == '1' || level[1] == '2' ? at::kHalf : at::kBFloat16;
    auto a = randn({2, 3}).to(low);
    auto b = randn({3, 2});
    c10::NoGradGuard no_grad;
    auto before = cast_count();
    auto widened = at::mm(a, b);  // unboxed kernel (a hot op)
    EXPECT_EQ(widened.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(widened, at::mm(a.to(at::kFloat), b)));
    EXPECT_EQ(cast_count(), before + 1);
    auto v = randn({3});
    EXPECT_EQ(at::mv(a, v).scalar_type(), at::kFloat);           // boxed kernel
    EXPECT_EQ(at::dot(v.to(low), v).scalar_type(), at::kFloat);  // promote, not native
    // fp32 list: CUDA's layer norm takes no weights of another width than its input
    EXPECT_EQ(at::layer_norm(a, {3}, v, v).scalar_type(), at::kFloat);
    before = cast_count();
    EXPECT_EQ(at::mm(a, b.to(low)).scalar_type(), low);                // one width: as given
    EXPECT_EQ(at::add(a, b.t()).scalar_type(), at::kFloat);            // torch promotes it
    EXPECT_EQ(at::mul(a, at::scalar_tensor(2.0)).scalar_type(), low);  // a 0-dim fp32: torch's
    EXPECT_EQ(cast_count(), before);
    // A 0-dim tensor of another width takes the dimensioned tensors' (torch's promotion's
    // dtype) where the op does not promote: prelu refused "Type promoting" until 2026-12-07.
    const auto slope = at::scalar_tensor(0.25);
    const auto prelu = at::prelu(a, slope);
    EXPECT_EQ(prelu.scalar_type(), low);
    EXPECT_TRUE(at::equal(prelu, at::prelu(a, slope.to(low))));
    EXPECT_EQ(cast_count(), before + 1);
    // Among 0-dim tensors alone, the widest: a scalar prediction and its fp32 target.
    const auto p = at::scalar_tensor(0.75).to(low);
    EXPECT_EQ(at::binary_cross_entropy(p, at::scalar_tensor(1.0)).scalar_type(), at::kFloat);
    {
      disable_casts off;  // nothing at all
      EXPECT_THROW(at::mm(a, b), c10::Error);
      EXPECT_THROW(at::prelu(a, slope), c10::Error);
    }
    TearDown();
  }
}

// O2/O3/O5 leave the fp32 list out, so an fp32 activation (a positional encoding made in the
// forward and added to fp16 embeddings) reached a layer norm with fp16 weights and failed
// ("mixed dtype (CPU): expect parameter to have scalar type of Float"; on CUDA "expected scalar
// type"), where torch.autocast runs layer norms in fp32. Such a call now runs widened.
TEST_F(Casting, LevelsWithoutTheFp32ListWidenMixedCallsThatCannotRun) {
  for (const char* level : {"O2", "O3", "O5"}) {
    SCOPED_TRACE(level);
    enable(level);
    const ScalarType low = level[1] == '5' ? at::kBFloat16 : at::kHalf;
    auto x = randn({2, 3, 8});
    auto w = randn({8}).to(low);
    auto b = randn({8}).to(low);
    auto before = cast_count();
    auto widened = at::layer_norm(x, {8}, w, b);  // unboxed kernel (a hot op)
    EXPECT_EQ(widened.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(widened, at::layer_norm(x, {8}, w.to(at::kFloat), b.to(at::kFloat))));
    EXPECT_EQ(cast_count(), before + 2);
    auto grouped = at::group_norm(x.transpose(1, 2), 1, w, b);  // boxed kernel
    EXPECT_EQ(grouped.scalar_type(), at::kFloat);
    before = cast_count();
    EXPECT_EQ(at::layer_norm(x.to(low), {8}, w, b).scalar_type(), low);  // one width: as given
    EXPECT_EQ(at::exp(x.to(low)).scalar_type(), low);                    // one tensor: as given
    EXPECT_EQ(cast_count(), before);
    {
      disable_casts off;  // nothing at all
      EXPECT_THROW(at::layer_norm(x, {8}, w, b), c10::Error);
    }
    TearDown();
  }
}

TEST_F(Casting, AutocastRegionWorksWithoutInitialize) {
  auto a = randn({2, 3});
  EXPECT_FALSE(is_casting_enabled());
  {
    autocast region(true, at::kBFloat16);
    EXPECT_TRUE(is_casting_enabled());
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kBFloat16);
    EXPECT_EQ(at::softmax(a.to(at::kBFloat16), 1).scalar_type(), at::kFloat);
    autocast off(false);
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(is_casting_enabled());
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kFloat);
  OPTAMP_EXPECT_THROW_WITH(autocast(true, at::kDouble), c10::ValueError, "torch.float64");
}

TEST_F(Casting, O3LowersAlwaysAndLeavesTheRestAlone) {
  enable("O3");
  auto a = randn({2, 3});
  {
    c10::NoGradGuard no_grad;
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(at::softmax(a.to(at::kHalf), 1).scalar_type(), at::kHalf);  // no fp32 list at O3
}

TEST_F(Casting, O2AppliesLowerLossesAndPromote) {
  enable("O2");
  auto h = randn({4, 3}, at::kHalf);
  EXPECT_EQ(at::mm(randn({2, 3}), randn({3, 2})).scalar_type(), at::kHalf);
  // promote: a working copy's result meets an fp32 buffer seen through clone (docs/design.md)
  auto v = randn({3});
  EXPECT_EQ(at::vdot(v.to(at::kHalf), v).scalar_type(), at::kFloat);
  EXPECT_EQ(at::vdot(v.to(at::kHalf), v.to(at::kHalf)).scalar_type(), at::kHalf);
  EXPECT_EQ(at::exp(h).scalar_type(), at::kHalf);  // plain fp32-list op: normal promotion
  EXPECT_EQ(at::log_softmax(h, 1).scalar_type(), at::kFloat);
  EXPECT_EQ(at::nll_loss(at::log_softmax(h, 1), at::tensor({0, 1, 2, 0}, at::kLong)).scalar_type(),
            at::kFloat);
  // binary_cross_entropy is not banned at O2: it runs as an fp32 loss.
  auto p = at::rand({4}, at::kHalf).clamp(0.1, 0.9);
  EXPECT_EQ(at::binary_cross_entropy(p, p).scalar_type(), at::kFloat);
}

// ---- coexistence with native autocast --------------------------------------------------------

TEST_F(Casting, NativeAutocastOwnsTheCallWhenEnabled) {
  enable("O1");  // optamp would pick fp16
  auto a = randn({2, 3});
  const bool was = at::autocast::is_autocast_enabled(at::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);  // native CPU autocast: bf16
  const auto before = cast_count();
  const auto dtype = at::mm(a, a.t()).scalar_type();
  at::autocast::set_autocast_enabled(at::kCPU, was);
  at::autocast::clear_cache();
  EXPECT_EQ(dtype, at::autocast::get_autocast_dtype(at::kCPU));
  EXPECT_EQ(cast_count(), before);  // optamp deferred
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kHalf);
}

// ---- verbosity ------------------------------------------------------------------------------

TEST_F(Casting, Verbosity2LogsEachDistinctCastOnce) {
  Options o;
  o.verbosity = 2;
  enable("O1", o);
  ::testing::internal::CaptureStderr();
  auto a = randn({2, 3});
  at::mm(a, a.t());
  at::mm(a, a.t());
  const std::string log = ::testing::internal::GetCapturedStderr();
  const std::string line = "Float->Half aten::mm";
  ASSERT_NE(log.find(line), std::string::npos) << log;
  EXPECT_EQ(log.find(line), log.rfind(line)) << "logged more than once:\n" << log;
}

// ---- Apex's fp32 Python functions without an aten op of their own ---------------------------

TEST_F(Casting, LocalResponseNormRunsInFp32) {
  // local_response_norm squares its input, pools the squares (avg_pool2d for 3-D input,
  // avg_pool3d otherwise), then pow and a division. avg_pool3d is in the fp32 list (CPU has no
  // fp16/bf16 kernel for it); pow is, and the final division promotes, so every rank ends fp32.
  namespace F = torch::nn::functional;
  enable("O1");
  const auto options = F::LocalResponseNormFuncOptions(3);
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{2, 4, 5}, {2, 4, 3, 3}, {1, 4, 2, 3, 3}}) {
    SCOPED_TRACE(shape.size());
    for (const ScalarType low : {at::kHalf, at::kBFloat16}) {
      SCOPED_TRACE(c10::toString(low));
      const auto x = (at::rand(shape) + 0.5).to(low);
      const auto reference = [&] {
        disable_casts off;
        return F::local_response_norm(x.to(at::kFloat), options);
      }();
      const auto out = F::local_response_norm(x, options);
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_TRUE(testing::all_close(out, reference, testing::tolerance(low)));
    }
  }
}

// An fp32-list op given a result dtype runs as called: casting its inputs to fp32 would make
// linalg_vector_norm / norm refuse the narrowing back to the dtype the caller asked for.
TEST_F(Casting, AnExplicitResultDtypeIsLeftAlone) {
  enable("O1");
  const auto h = randn({2, 3}, at::kHalf);
  const auto before = cast_count();
  EXPECT_EQ(at::sum(h, at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(cast_count(), before) << "nothing cast for a call that names its result dtype";
  EXPECT_EQ(at::sum(h).scalar_type(), at::kFloat) << "without a dtype: fp32";
  EXPECT_EQ(at::linalg_vector_norm(h, 2, std::nullopt, false, at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(at::norm(h, std::optional<at::Scalar>(2), at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(
      at::norm(h, std::optional<at::Scalar>(2), at::IntArrayRef{1}, false, at::kHalf).scalar_type(),
      at::kHalf);
}

TEST_F(Casting, OpsThatNeedTheSourceInSelfsDtypeGetIt) {
  // A mixture-of-experts router at O2: `out = zeros_like(x)` (fp16, the model's input), an fp32
  // softmax weight times an expert's fp16 output (fp32), then out.index_add_(0, tokens, y):
  // "index_add_(): self (Half) and source (Float) must have the same scalar type".
  for (const char* level : {"O1", "O2", "O3", "O4", "O5"}) {
    SCOPED_TRACE(level);
    enable(level);
    const ScalarType low = (level[1] == '4' || level[1] == '5') ? at::kBFloat16 : at::kHalf;
    const auto idx = at::tensor({0, 2, 2}, at::kLong);
    const auto src = randn({3, 4});
    auto out = at::zeros({3, 4}, low);
    auto before = cast_count();
    out.index_add_(0, idx, src);
    EXPECT_EQ(cast_count(), before + 1);
    EXPECT_EQ(out.scalar_type(), low);
    EXPECT_TRUE(at::equal(out, at::zeros({3, 4}, low).index_add_(0, idx, src.to(low))));
    auto wide = at::zeros({3, 4});  // a reduced source into an fp32 buffer
    wide.scatter_add_(0, idx.unsqueeze(1).expand({3, 4}).contiguous(), src.to(low));
    EXPECT_EQ(wide.scalar_type(), at::kFloat);
    EXPECT_EQ(at::index_add(out, 0, idx, src).scalar_type(), low);  // out of place: self's too
    const auto rows = at::tensor({0, 2}, at::kLong);
    const auto copied = at::index_copy(at::zeros({3, 4}), 0, rows, src.slice(0, 0, 2).to(low));
    EXPECT_EQ(copied.scalar_type(), at::kFloat);  // failed until 2026-12-07: "same dtype"
    EXPECT_TRUE(at::equal(
        copied, at::zeros({3, 4}).index_copy(0, rows, src.slice(0, 0, 2).to(low).to(at::kFloat))));
    EXPECT_EQ(at::index_copy(out, 0, rows, src.slice(0, 0, 2)).scalar_type(), low);
    before = cast_count();
    out.index_add_(0, idx, src.to(low));  // one width: as given
    EXPECT_EQ(cast_count(), before);
    {
      disable_casts off;  // nothing at all: torch's error
      EXPECT_THROW(out.index_add_(0, idx, src), c10::Error);
    }
    TearDown();
  }
}

}  // namespace
}  // namespace amp
