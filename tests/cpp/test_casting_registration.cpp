// Registering policies: user ops (register_half_op and friends, the out= overloads they skip),
// other libraries' ops with their own autocast kernels (found at registration and initialize),
// the errors naming the op, the policy report, every table entry registered on this LibTorch,
// the key conflict with another backend, and the argument walker on a Tensor?[] custom op.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "casting_test.h"
#include "dispatch/policy_table.h"
#include "dispatch/registration.h"
#include "optamp/amp.h"
#include "test_util.h"

// A custom op library for the registration tests: a pure function and an in-place one.
TORCH_LIBRARY(optamp_test, m) {
  m.def("twice(Tensor x) -> Tensor");
  m.def("twice.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("accumulate_(Tensor(a!) self, Tensor other) -> Tensor(a!)");
  m.def("first_defined(Tensor?[] xs) -> Tensor");  // a Tensor?[] argument, for the walker
}
TORCH_LIBRARY_IMPL(optamp_test, CompositeExplicitAutograd, m) {
  m.impl("twice", [](const at::Tensor& x) { return x * 2; });
  m.impl("twice.out", [](const at::Tensor& x, at::Tensor& out) -> at::Tensor& {
    return at::mul_out(out, x, 2);
  });
  m.impl("accumulate_", [](at::Tensor& self, const at::Tensor& other) -> at::Tensor& {
    return self.add_(other.to(self.scalar_type()));
  });
  m.impl("first_defined", [](const c10::List<std::optional<at::Tensor>>& xs) {
    for (const std::optional<at::Tensor>& x : xs) {
      if (x && x->defined()) return x->clone();
    }
    return at::Tensor();
  });
}

// "Another library" with its own autocast kernels, as torchvision registers them for nms and
// roi_align: `pair_sum`'s CPU kernel refuses inputs of two dtypes or in fp16 (torchvision's nms:
// "dets should have the same type as scores", "nms_kernel not implemented for 'Half'"), and its
// autocast kernel casts both to fp32; `low_mm`'s autocast kernel casts to native autocast's
// lower-precision dtype (an extension's matmul-like op). `kept` (any dtypes, the first one's
// result) has one too, for a registration to override.
namespace own_autocast {

at::Tensor call(const char* name, const at::Tensor& a, const at::Tensor& b) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>()
      .call(a, b);
}

at::Tensor pair_sum_cpu(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "pair_sum: a and b must have the same dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat, "pair_sum not implemented for ", a.scalar_type());
  return a + b;
}

// What torchvision's autocast kernels do: exclude the key, cast, call the op again.
template <bool kToLow>
at::Tensor autocast_kernel_of(const char* name, const at::Tensor& a, const at::Tensor& b) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const at::ScalarType to =
      kToLow ? at::autocast::get_lower_precision_fp_from_device_type(at::kCPU) : at::kFloat;
  return call(name, at::autocast::cached_cast(to, a, at::kCPU),
              at::autocast::cached_cast(to, b, at::kCPU));
}

}  // namespace own_autocast

TORCH_LIBRARY(optamp_test_own, m) {
  m.def("pair_sum(Tensor a, Tensor b) -> Tensor");
  m.def("low_mm(Tensor a, Tensor b) -> Tensor");
  m.def("kept(Tensor a, Tensor b) -> Tensor");
  m.def("weighted(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(optamp_test_own, CPU, m) {
  m.impl("pair_sum", &own_autocast::pair_sum_cpu);
  m.impl("low_mm", [](const at::Tensor& a, const at::Tensor& b) { return at::mm(a, b); });
  m.impl("kept", [](const at::Tensor& a, const at::Tensor& b) { return a + b.to(a.dtype()); });
}
// Differentiable through its decomposition (as a deformable convolution is through its own
// backward): the weight's gradient reaches the master.
TORCH_LIBRARY_IMPL(optamp_test_own, CompositeImplicitAutograd, m) {
  m.impl("weighted", [](const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(x.scalar_type() == w.scalar_type(), "weighted: x and w must have the same dtype");
    return at::mm(x, w);
  });
}
TORCH_LIBRARY_IMPL(optamp_test_own, AutocastCPU, m) {
  m.impl("pair_sum", [](const at::Tensor& a, const at::Tensor& b) {
    return own_autocast::autocast_kernel_of<false>("optamp_test_own::pair_sum", a, b);
  });
  m.impl("low_mm", [](const at::Tensor& a, const at::Tensor& b) {
    return own_autocast::autocast_kernel_of<true>("optamp_test_own::low_mm", a, b);
  });
  m.impl("kept", [](const at::Tensor& a, const at::Tensor& b) {
    return own_autocast::autocast_kernel_of<false>("optamp_test_own::kept", a, b);
  });
  m.impl("weighted", [](const at::Tensor& x, const at::Tensor& w) {
    return own_autocast::autocast_kernel_of<false>("optamp_test_own::weighted", x, w);
  });
}

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the casting fixtures

at::Tensor call_twice(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::twice", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor call_first_defined(const c10::List<std::optional<at::Tensor>>& xs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::first_defined", "")
                       .typed<at::Tensor(const c10::List<std::optional<at::Tensor>>&)>();
  return op.call(xs);
}

TEST_F(Casting, WrittenArgumentsAreNeverCast) {
  register_half_op("optamp_test::accumulate_");
  enable("O1");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::accumulate_", "")
                       .typed<at::Tensor&(at::Tensor&, const at::Tensor&)>();
  auto self = at::zeros({3});
  auto other = at::full({3}, 1.00048828125);  // 1 + 2^-11: exact in fp32, rounds to 1 in fp16
  const auto before = cast_count();
  auto& result = op.call(self, other);
  EXPECT_EQ(cast_count() - before, 1);  // only `other`
  EXPECT_EQ(self.scalar_type(), at::kFloat);
  EXPECT_TRUE(result.is_same(self));
  EXPECT_TRUE(at::equal(self, at::full({3}, 1.0)));  // `other` went through fp16
}

TEST_F(Casting, UserRegisteredCustomOps) {
  enable("O1");
  auto x = randn({3});
  EXPECT_EQ(call_twice(x).scalar_type(), at::kFloat);  // no policy yet
  register_half_op("optamp_test::twice");
  EXPECT_EQ(call_twice(x).scalar_type(), at::kHalf);
  register_float_op("optamp_test::twice");  // the newest registration wins
  EXPECT_EQ(call_twice(x.to(at::kHalf)).scalar_type(), at::kFloat);
}

TEST_F(Casting, BaseNameRegistrationSkipsOutOverloads) {
  // A lowered input with an fp32 `out=` would be a dtype error in the kernel: "ns::op" covers
  // the overloads that write no argument (all of them only when every overload writes).
  register_half_op("optamp_test::twice");
  const std::string report = policy_report();
  EXPECT_NE(report.find("optamp_test::twice: lower"), std::string::npos) << report;
  EXPECT_EQ(report.find("optamp_test::twice.out"), std::string::npos) << report;
  enable("O1");
  static auto out_op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("optamp_test::twice", "out")
                           .typed<at::Tensor&(const at::Tensor&, at::Tensor&)>();
  auto out = at::empty({3});
  const auto x = at::full({3}, 1.00048828125);  // not representable in fp16
  out_op.call(x, out);
  EXPECT_TRUE(at::equal(out, x * 2)) << "the out= overload must run uncast";
  register_half_op("optamp_test::twice.out");  // named explicitly: honored
  EXPECT_NE(policy_report().find("optamp_test::twice.out: lower"), std::string::npos);
}

TEST_F(Casting, RegistrationErrorsNameTheOp) {
  OPTAMP_EXPECT_THROW_WITH(register_half_op("optamp_test::nope"), c10::ValueError,
                           "optamp_test::nope", "TORCH_LIBRARY");
  OPTAMP_EXPECT_THROW_WITH(register_float_op("twice"), c10::ValueError, "namespace::op",
                           "\"twice\"");
  OPTAMP_EXPECT_THROW_WITH(register_promote_op("aten::mm.no_such_overload"), c10::ValueError,
                           "aten::mm.no_such_overload");
}

TEST_F(Casting, PolicyReportListsEntriesAndSkippedOverloads) {
  const std::string report = policy_report();
  EXPECT_NE(report.find("aten::mm: lower"), std::string::npos);
  EXPECT_NE(report.find("aten::softmax.int: fp32 (loss)"), std::string::npos);
  EXPECT_NE(report.find("aten::cat: promote"), std::string::npos);
  EXPECT_NE(report.find("aten::binary_cross_entropy: banned"), std::string::npos);
  EXPECT_NE(report.find("skipped (not in this LibTorch)"), std::string::npos);
}

// The rows are the report's data: programs read them instead of parsing the report's text.
TEST_F(Casting, PolicyRowsHoldEachListsPolicyAsTheReportPrintsIt) {
  register_float_op("optamp_test::twice");
  const std::vector<PolicyRow> rows = policy_rows();
  const auto policy_of = [&](const std::string& op, PolicyList list) -> std::optional<CastPolicy> {
    for (const PolicyRow& row : rows) {
      if (row.op == op && row.list == list) return row.policy;
    }
    return std::nullopt;
  };
  EXPECT_EQ(policy_of("aten::mm", PolicyList::kApex), CastPolicy::kLower);
  EXPECT_EQ(policy_of("aten::mm", PolicyList::kTorchCpu), CastPolicy::kLower);
  EXPECT_EQ(policy_of("aten::cat", PolicyList::kApex), CastPolicy::kPromote);
  EXPECT_EQ(policy_of("aten::fft_rfft", PolicyList::kApex), CastPolicy::kFp32Always);
  // No fp16/bf16 CPU kernel: fp32 (always) on CPU tensors only.
  EXPECT_EQ(policy_of("aten::avg_pool3d", PolicyList::kApexCpu), CastPolicy::kFp32Always);
  EXPECT_NE(policy_of("aten::avg_pool3d", PolicyList::kApex), CastPolicy::kFp32Always);
  for (const PolicyList list : detail::kListSets) {
    EXPECT_EQ(policy_of("optamp_test::twice", list), CastPolicy::kFp32Always) << to_string(list);
  }
  const std::string report = policy_report();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i > 0) {
      EXPECT_LT(std::tie(rows[i - 1].op, rows[i - 1].list), std::tie(rows[i].op, rows[i].list));
    }
    if (rows[i].list != PolicyList::kApex) continue;
    const std::string line = "  " + rows[i].op + ": " + to_string(rows[i].policy) + "\n";
    EXPECT_NE(report.find(line), std::string::npos) << line << report;
  }
}

TEST_F(Casting, EveryTableEntryIsRegisteredOnThisLibTorch) {
  // Drift guard: an op renamed or removed by a LibTorch upgrade would silently lose its policy
  // (it lands in "skipped"); this fails instead, naming the entry.
  const std::string report = policy_report();
  for (const auto& entry : detail::builtin_table()) {
    std::string name = entry.name;
    if (*entry.overload != '\0') name += std::string(".") + entry.overload;
    const std::string line = "  " + name + ": " + to_string(entry.policy) + "\n";
    EXPECT_NE(report.find(line), std::string::npos)
        << name << " is in the policy table but not registered with its category; report:\n"
        << report;
  }
  EXPECT_NE(report.find("skipped (not in this LibTorch): 0\n"), std::string::npos) << report;
}

// Found 2026-12-05: torchvision's detection models failed at every casting level (nms given fp16
// scores and fp32 boxes at O1, fp16 both at O2/O3/O5, which its CPU kernel lacks), where
// torch.autocast runs them: torchvision's own autocast kernels cast them to fp32. optamp now
// calls such a kernel where native autocast would (CastPolicy::kOwnAutocast).
TEST_F(Casting, AnotherLibrarysAutocastKernelsCastItsOps) {
  const auto a = randn({4}, at::kHalf);
  const auto b = randn({4});
  enable("O0");
  OPTAMP_EXPECT_THROW_WITH(own_autocast::call("optamp_test_own::pair_sum", a, b), c10::Error,
                           "same dtype");  // as given: what the op refuses
  for (const char* level : {"O1", "O2", "O3", "O4", "O5"}) {
    SCOPED_TRACE(level);
    enable(level);
    const auto sum = own_autocast::call("optamp_test_own::pair_sum", a, b);
    EXPECT_EQ(sum.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(sum, a.to(at::kFloat) + b));
    const auto both_low = own_autocast::call("optamp_test_own::pair_sum", a, b.to(at::kHalf));
    EXPECT_EQ(both_low.scalar_type(), at::kFloat) << "fp16 alone, which the kernel lacks";
    // A kernel that casts to native autocast's lower-precision dtype gets the level's.
    const auto product =
        own_autocast::call("optamp_test_own::low_mm", randn({2, 3}), randn({3, 2}));
    EXPECT_EQ(product.scalar_type(), resolve(level).low_dtype());
  }
  // Native autocast's own settings on this thread are left as they were.
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), at::kBFloat16);
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  EXPECT_NE(policy_report().find("optamp_test_own::pair_sum: own autocast"), std::string::npos);
}

TEST_F(Casting, AnOwnAutocastKernelSeesAWeightsNewValuesAfterAnInPlaceStep) {
  // Native autocast caches casts of leaf weights until its region ends, and optamp never enters
  // one: with the cache on, the second call would read the weight from before the step.
  enable("O1");
  const auto w = at::full({2, 2}, 1.0).requires_grad_();
  const auto x = at::eye(2);
  EXPECT_TRUE(at::equal(own_autocast::call("optamp_test_own::low_mm", x, w).to(at::kFloat),
                        at::full({2, 2}, 1.0)));
  {
    at::NoGradGuard no_grad;
    w.add_(1.0);  // an optimizer step
  }
  EXPECT_TRUE(at::equal(own_autocast::call("optamp_test_own::low_mm", x, w).to(at::kFloat),
                        at::full({2, 2}, 2.0)));
}

TEST_F(Casting, ARegistrationOverridesAnOpsOwnAutocast) {
  register_half_op("optamp_test_own::kept");
  enable("O1");
  const auto report = policy_report();
  EXPECT_NE(report.find("optamp_test_own::kept: lower"), std::string::npos) << report;
  EXPECT_EQ(own_autocast::call("optamp_test_own::kept", randn({2}), randn({2})).scalar_type(),
            at::kHalf)
      << "lowered by the registration, then summed as given, not widened by its own kernel";
}

TEST_F(CastingInitialized, AnOwnAutocastOpGivenAModelWeightAtO2O5GetsItsMaster) {
  // torchvision's deform_conv2d takes its layer's weight: at O2/O5 the kernel casts the master
  // like its other inputs; substitution below it handed the op the fp16 working copy instead,
  // beside the fp32 input ("must have the same dtype").
  for (const char* level : {"O2", "O5"}) {
    SCOPED_TRACE(level);
    auto model = std::make_shared<OneWeight>();
    torch::optim::SGD opt(model->parameters(), 0.1);
    initialize(model, opt, level, quiet());
    const auto x = randn({2, 4});
    const auto y = own_autocast::call("optamp_test_own::weighted", x, model->w);
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    y.sum().backward();
    at::NoGradGuard fp32;  // the gate: the references are plain fp32 products
    EXPECT_TRUE(at::equal(y, at::mm(x, model->w)));
    ASSERT_TRUE(model->w.grad().defined());
    EXPECT_TRUE(at::equal(model->w.grad(), at::mm(x.t(), at::ones({2, 3}))));
    reset();
  }
}

TEST_F(CastingInitialized, InitializeFindsTheAutocastKernelsOfLibrariesLoadedSince) {
  enable("O1");  // optamp's kernels are registered: a later library is not seen yet
  static torch::Library late(torch::Library::DEF, "optamp_test_late", std::nullopt, __FILE__,
                             __LINE__);
  late.def("pair_sum(Tensor a, Tensor b) -> Tensor");
  static torch::Library late_cpu(torch::Library::IMPL, "optamp_test_late", c10::DispatchKey::CPU,
                                 __FILE__, __LINE__);
  late_cpu.impl("pair_sum", &own_autocast::pair_sum_cpu);
  static torch::Library late_autocast(torch::Library::IMPL, "optamp_test_late",
                                      c10::DispatchKey::AutocastCPU, __FILE__, __LINE__);
  late_autocast.impl("pair_sum", [](const at::Tensor& a, const at::Tensor& b) {
    return own_autocast::autocast_kernel_of<false>("optamp_test_late::pair_sum", a, b);
  });
  // An autocast kernel whose op is not defined (yet): no schema to read, so it is left alone.
  static torch::Library pending(torch::Library::IMPL, "optamp_test_late",
                                c10::DispatchKey::AutocastCPU, __FILE__, __LINE__);
  pending.impl("undefined_yet", [](const at::Tensor& a) { return a; });
  EXPECT_EQ(policy_report().find("optamp_test_late::pair_sum"), std::string::npos);
  auto model = std::make_shared<OneWeight>();
  torch::optim::SGD opt(model->parameters(), 0.1);
  initialize(model, opt, "O1", quiet());
  const auto report = policy_report();
  EXPECT_NE(report.find("optamp_test_late::pair_sum: own autocast"), std::string::npos) << report;
  EXPECT_EQ(report.find("undefined_yet"), std::string::npos) << report;
  const auto sum =
      own_autocast::call("optamp_test_late::pair_sum", randn({2}, at::kHalf), randn({2}));
  EXPECT_EQ(sum.scalar_type(), at::kFloat);
}

// The casting kernel and the O2/O5 substitution share one walker over tensor arguments; the
// substitution's own copy used to skip Tensor?[] (index, index_put, custom ops).
TEST(SubstitutionWalker, OptionalTensorListArgumentsSeeWorkingCopiesAtO2O5) {
  for (const char* level : {"O2", "O5"}) {
    SCOPED_TRACE(level);
    torch::nn::Linear lin(3, 2);
    torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
    Options o;
    o.verbosity = 0;
    initialize(lin, opt, level, o);
    const ScalarType low = resolve(level).low_dtype();
    const at::Tensor& w = lin->weight;
    c10::List<std::optional<at::Tensor>> xs;
    xs.push_back(std::nullopt);
    xs.push_back(w);
    EXPECT_EQ(call_first_defined(xs).scalar_type(), low);
    const at::Tensor mask = w.detach() > 0;  // a parameter-derived index list
    EXPECT_EQ(w.index({mask}).scalar_type(), low);
    EXPECT_EQ(at::index(w, c10::List<std::optional<at::Tensor>>({mask})).scalar_type(), low);
    reset();
  }
}

// A device backend that owns the key (simulated by a fallback registered first) makes the first
// activation fail with a message naming the conflict. Runs in a fresh child process
// ("threadsafe" death tests re-execute the binary), where optamp has registered nothing yet.
TEST(CastingKeyConflictDeathTest, ActivationNamesTheConflict) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        static torch::Library other(torch::Library::IMPL, "_", detail::kCastKey, __FILE__,
                                    __LINE__);
        other.fallback(torch::CppFunction::makeFallthrough());
        try {
          detail::activate_thread(true);
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "%s\n", e.what_without_backtrace());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(3), "another library already registered a fallback");
}

// Apex's way to keep a loss in fp32, register_float_function, as an op: a BCE of a sigmoid
// output, registered as fp32, trains at every level (O0-O5), whether the model gives it fp32 or
// reduced-precision values, forward and backward. In a child process: the registration is
// process-wide, and the other tests expect BCE refused at O1/O4.
namespace {

// Returns an empty string when one step at `level` ran the loss in fp32 and stepped finite weights.
std::string bce_step(const char* level, bool low_input) {
  reset();
  torch::manual_seed(0);
  torch::nn::Linear net(4, 1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  initialize(net, opt, level, testing::quiet());
  const at::Tensor before = net->weight.detach().clone();
  const at::Tensor x = at::randn({8, 4});
  const at::Tensor y = at::randint(0, 2, {8, 1}).to(at::kFloat);
  at::Tensor out = at::sigmoid(net->forward(x));
  if (low_input) out = out.to(resolve(level).low_dtype());
  const at::Tensor loss = at::binary_cross_entropy(out, y);
  if (loss.scalar_type() != at::kFloat)
    return std::string("loss dtype ") + dtype_name(loss.scalar_type());
  {
    auto scaled = scale_loss(loss, opt);
    scaled.backward();
  }
  opt.step();
  const at::Tensor w = net->weight.detach().to(at::kFloat);
  if (!w.isfinite().all().item<bool>()) return "non-finite weights";
  if (at::equal(w, before.to(at::kFloat))) return "the step changed nothing";
  return "";
}

}  // namespace

TEST(RegisteredFp32LossDeathTest, TrainsAtEveryLevelWithFp32OrReducedInputs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        register_float_op("aten::binary_cross_entropy");
        for (const char* level : {"O0", "O1", "O2", "O3", "O4", "O5"}) {
          for (const bool low_input : {false, true}) {
            if (low_input && std::string(level) == "O0") continue;  // O0 casts nothing
            std::string failure;
            try {
              failure = bce_step(level, low_input);
            } catch (const c10::Error& e) {
              failure = e.what_without_backtrace();
            }
            if (!failure.empty()) {
              std::fprintf(stderr, "%s%s: %s\n", level, low_input ? " (reduced input)" : "",
                           failure.c_str());
              std::exit(1);
            }
          }
        }
        reset();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// Without the registration, BCE's refusal says how to register it.
TEST_F(Casting, BceRefusalPointsToRegisterFloatOp) {
  enable("O1");
  const at::Tensor p = at::rand({4}).to(at::kHalf);
  OPTAMP_EXPECT_THROW_WITH(at::binary_cross_entropy(p, at::rand({4}).to(at::kHalf)), c10::Error,
                           "amp::register_float_op(\"aten::binary_cross_entropy\")");
}

}  // namespace
}  // namespace amp
