// op_lists: the torch tables hold exactly the operators this LibTorch registers native autocast
// kernels for (drift guard across LibTorch upgrades), the kernel picks the table by the level's
// op lists and the tensor's device, and user registrations apply whichever lists are in use.
// Native autocast's output dtypes, op for op, are compared in tests/python/test_op_lists.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dispatch/cast_decision.h"
#include "dispatch/policy_table.h"
#include "dispatch/registration.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using detail::ListSet;

std::set<std::string> names_in(ListSet set) {
  std::set<std::string> names;
  for (const auto& entry : detail::table_of(set)) {
    names.insert(detail::qualified({entry.name, entry.overload}));
  }
  return names;
}

// aten operators with a kernel of their own on `key` in the running LibTorch.
std::set<std::string> registered_on(c10::DispatchKey key) {
  std::set<std::string> names;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findSchema(name);
    if (op && op->hasKernelForDispatchKey(key)) names.insert(detail::qualified(name));
  }
  return names;
}

// torch's rows plus the ops every table keeps fp32 at every level (FFTs, linear algebra, cdist,
// quantile: ATen has no fp16/bf16 kernels for them): the Apex table's fp32 (always) entries.
std::set<std::string> with_fp32_always(std::set<std::string> names) {
  for (const auto& entry : detail::table_of(ListSet::kApex)) {
    if (entry.policy == CastPolicy::kFp32Always) {
      names.insert(detail::qualified({entry.name, entry.overload}));
    }
  }
  return names;
}

// Plus the ops the CPU's tables alone keep fp32 at every level (no fp16/bf16 CPU kernel; CUDA has
// one): Apex's CPU table's fp32 (always) entries.
std::set<std::string> with_cpu_fp32_always(std::set<std::string> names) {
  for (const auto& entry : detail::table_of(ListSet::kApexCpu)) {
    if (entry.policy == CastPolicy::kFp32Always) {
      names.insert(detail::qualified({entry.name, entry.overload}));
    }
  }
  return names;
}

void expect_same_ops(const std::set<std::string>& table, const std::set<std::string>& torch,
                     const char* what) {
  for (const auto& name : torch) {
    EXPECT_TRUE(table.count(name))
        << name << " has a native " << what << " kernel but no row in optamp's table";
  }
  for (const auto& name : table) {
    EXPECT_TRUE(torch.count(name))
        << name << " is in optamp's " << what << " table but this LibTorch has no such kernel";
  }
}

TEST(OpLists, TorchCpuTableIsExactlyAutocastCpusKernels) {
  expect_same_ops(names_in(ListSet::kTorchCpu),
                  with_cpu_fp32_always(registered_on(c10::DispatchKey::AutocastCPU)),
                  "AutocastCPU");
}

TEST(OpLists, TorchOtherTableIsExactlyAutocastCudasKernels) {
  expect_same_ops(names_in(ListSet::kTorchOther),
                  with_fp32_always(registered_on(c10::DispatchKey::AutocastCUDA)), "AutocastCUDA");
}

TEST(OpLists, LossesAndSoftmaxesAreFp32LossInEveryTable) {
  // So O2/O5 keep them fp32 whichever lists are chosen; fp32 (always), which O3 applies too, for
  // those without fp16/bf16 kernels (CTC on every device, the margin losses on the CPU).
  for (const ListSet set : {ListSet::kApex, ListSet::kTorchCpu, ListSet::kTorchOther}) {
    for (const auto& entry : detail::table_of(set)) {
      const std::string name = entry.name;
      const bool loss = name.find("loss") != std::string::npos || name == "aten::softmax" ||
                        name == "aten::log_softmax" || name == "aten::kl_div" ||
                        name.find("binary_cross_entropy") != std::string::npos;
      if (!loss) continue;
      const bool no_reduced_kernel = name == "aten::ctc_loss" ||
                                     name == "aten::multi_margin_loss" ||
                                     name == "aten::multilabel_margin_loss";
      EXPECT_TRUE(entry.policy == CastPolicy::kFp32Loss || entry.policy == CastPolicy::kBanned ||
                  (no_reduced_kernel && entry.policy == CastPolicy::kFp32Always))
          << name << " in " << amp::to_string(set) << " is " << to_string(entry.policy);
    }
  }
}

TEST(OpLists, OpsWithoutReducedKernelsAreFp32AlwaysInEveryTable) {
  // So an FFT, a decomposition or a cdist of a reduced tensor runs widened at every level,
  // whichever lists are chosen.
  const std::set<std::string> always = with_fp32_always({});
  EXPECT_EQ(always.size(), 150u);
  for (const char* op :
       {"aten::fft_rfft", "aten::stft.center", "aten::linalg_slogdet",
        "aten::linalg_householder_product", "aten::matrix_exp", "aten::cdist", "aten::quantile"}) {
    EXPECT_TRUE(always.count(op)) << op;
  }
  for (const ListSet set : {ListSet::kTorchCpu, ListSet::kTorchOther}) {
    std::set<std::string> found;
    for (const auto& entry : detail::table_of(set)) {
      const std::string name = detail::qualified({entry.name, entry.overload});
      if (!always.count(name)) continue;
      found.insert(name);
      EXPECT_EQ(entry.policy, CastPolicy::kFp32Always)
          << name << " in " << amp::to_string(set) << " is " << to_string(entry.policy);
    }
    EXPECT_EQ(found, always) << amp::to_string(set);
  }
}

// The CPU-only entries: fp32 (always) in both tables for CPU tensors (Apex's, torch's), as they
// were in the others (avg_pool3d: Apex's fp32 row, applied at O1/O4 only; the rest unlisted), and
// each still refused by this LibTorch on the CPU in fp16 and bf16: a drift guard, failing when a
// LibTorch gains such a kernel, so the entry is reviewed.
TEST(OpLists, CpuOnlyFp32AlwaysEntriesAreOpsWithoutReducedCpuKernels) {
  const std::set<std::string> cpu_only = [] {
    std::set<std::string> names = with_cpu_fp32_always({});
    for (const auto& name : with_fp32_always({})) names.erase(name);
    return names;
  }();
  const std::set<std::string> apex_fp32_rows = {
      "aten::avg_pool3d", "aten::_upsample_bilinear2d_aa", "aten::_upsample_bilinear2d_aa.vec",
      "aten::_upsample_bicubic2d_aa", "aten::_upsample_bicubic2d_aa.vec"};
  const std::set<std::string> apex_loss_rows = {"aten::multi_margin_loss",
                                                "aten::multilabel_margin_loss"};
  std::set<std::string> expected = {"aten::_dirichlet_grad",
                                    "aten::_sample_dirichlet",
                                    "aten::_standard_gamma",
                                    "aten::_standard_gamma_grad",
                                    "aten::binomial",
                                    "aten::polar",
                                    "aten::trace"};
  expected.insert(apex_fp32_rows.begin(), apex_fp32_rows.end());
  expected.insert(apex_loss_rows.begin(), apex_loss_rows.end());
  EXPECT_EQ(cpu_only, expected);
  for (const ListSet set : {ListSet::kApexCpu, ListSet::kTorchCpu}) {
    for (const auto& entry : detail::table_of(set)) {
      if (cpu_only.count(detail::qualified({entry.name, entry.overload}))) {
        EXPECT_EQ(entry.policy, CastPolicy::kFp32Always) << entry.name << amp::to_string(set);
      }
    }
  }
  for (const auto& entry : detail::table_of(ListSet::kApex)) {
    const std::string name = detail::qualified({entry.name, entry.overload});
    if (cpu_only.count(name)) {
      EXPECT_TRUE(apex_fp32_rows.count(name) || apex_loss_rows.count(name)) << name;
      EXPECT_EQ(entry.policy,
                apex_loss_rows.count(name) ? CastPolicy::kFp32Loss : CastPolicy::kFp32);
    }
  }
  for (const auto low : {at::kHalf, at::kBFloat16}) {
    const auto x = at::rand({1, 2, 4, 4, 4}).add(1).to(low);
    const auto m = at::rand({3, 3}).add(1).to(low);
    const std::vector<std::pair<const char*, std::function<void()>>> calls = {
        {"avg_pool3d",
         [&] {
           at::avg_pool3d(x, {2, 2, 2});
         }},
        {"_upsample_bilinear2d_aa",
         [&] {
           at::_upsample_bilinear2d_aa(x[0], {6, 6}, /*align_corners=*/false);
         }},
        {"_upsample_bicubic2d_aa",
         [&] {
           at::_upsample_bicubic2d_aa(x[0], {6, 6}, /*align_corners=*/false);
         }},
        {"trace", [&] { at::trace(m); }},
        {"polar", [&] { at::polar(m, m); }},
        {"_standard_gamma", [&] { at::_standard_gamma(m); }},
        {"_standard_gamma_grad", [&] { at::_standard_gamma_grad(m, m); }},
        {"_sample_dirichlet", [&] { at::_sample_dirichlet(m); }},
        {"_dirichlet_grad", [&] { at::_dirichlet_grad(m, m, m); }},
        {"binomial", [&] { at::binomial(m, m.div(4)); }},
        {"multi_margin_loss", [&] { at::multi_margin_loss(m, at::arange(3)); }},
        {"multilabel_margin_loss",
         [&] {
           at::multilabel_margin_loss(m, at::zeros({3, 3}, at::kLong));
         }},
    };
    for (const auto& [name, call] : calls) {
      EXPECT_ANY_THROW(call()) << name << " runs " << c10::toString(low) << " on the CPU now";
    }
  }
}

TEST(OpLists, ParsedAndShownByName) {
  EXPECT_EQ(parse_op_lists("torch"), OpLists::kTorch);
  EXPECT_EQ(parse_op_lists("apex"), OpLists::kApex);
  OPTAMP_EXPECT_THROW_WITH(parse_op_lists("Torch"), c10::ValueError, "op_lists must be", "\"apex\"",
                           "\"torch\"", "got \"Torch\"");
  EXPECT_EQ(resolve("O1").op_lists, OpLists::kApex);
  Options options;
  options.op_lists = OpLists::kTorch;
  const Properties p = resolve("O4", options);
  EXPECT_EQ(p.op_lists, OpLists::kTorch);
  EXPECT_NE(p.describe().find("op_lists=torch"), std::string::npos) << p.describe();
}

class OpListsInUse : public ::testing::Test {
 protected:
  void init(OpLists lists, const char* level = "O4") {
    Options options;
    options.verbosity = 0;
    options.op_lists = lists;
    initialize(model, level, options);
  }
  void TearDown() override { reset(); }
  torch::nn::Linear model{2, 2};
};

TEST_F(OpListsInUse, TheKernelFollowsTheChosenTableOnTheTensorsDevice) {
  const auto x = at::randn({4, 4}, at::kBFloat16);
  init(OpLists::kApex);
  EXPECT_EQ(at::gelu(x).scalar_type(), at::kFloat);  // Apex: fp32 list
  EXPECT_EQ(at::mm(x.to(at::kFloat), x.to(at::kFloat)).scalar_type(), at::kBFloat16);
  reset();
  init(OpLists::kTorch);
  EXPECT_EQ(at::gelu(x).scalar_type(), at::kBFloat16);  // CPU's autocast list: unlisted
  EXPECT_EQ(at::mm(x.to(at::kFloat), x.to(at::kFloat)).scalar_type(), at::kBFloat16);
  EXPECT_EQ(at::trace(x).scalar_type(), at::kFloat);  // CPU's fp32 list, not Apex's
  EXPECT_EQ(detail::level_op_lists(), OpLists::kTorch);
  reset();
  EXPECT_EQ(detail::level_op_lists(), OpLists::kApex);  // back to the default
}

// At O2/O3/O5 a reduced model tensor meets fp32 tensors whichever lists cast (a LayerNorm of
// embeddings plus an fp32 positional encoding made in the forward): torch's lists have no row for
// layer_norm on the CPU, and the call failed ("mixed dtype (CPU)") until 2026-12-07. It is
// widened, as under Apex's lists; O4 keeps torch's lists' call as native autocast runs it.
TEST_F(OpListsInUse, AtO2O3O5EitherListsWidenMixedCallsThatCannotRun) {
  const auto x = at::randn({2, 3, 8});
  init(OpLists::kTorch, "O4");
  EXPECT_ANY_THROW(at::layer_norm(x, {8}, at::randn({8}).to(at::kBFloat16)));
  reset();
  for (const char* level : {"O2", "O5", "O3"}) {  // O3 last: it casts the model in place
    const auto low = level[1] == '5' ? at::kBFloat16 : at::kHalf;
    const auto w = at::randn({8}).to(low);
    const auto b = at::randn({8}).to(low);
    for (const OpLists lists : {OpLists::kApex, OpLists::kTorch}) {
      init(lists, level);
      const auto out = at::layer_norm(x, {8}, w, b);
      EXPECT_EQ(out.scalar_type(), at::kFloat) << level << to_string(lists);
      EXPECT_TRUE(at::equal(out, at::layer_norm(x, {8}, w.to(at::kFloat), b.to(at::kFloat))));
      reset();
    }
  }
}

TEST_F(OpListsInUse, UserRegistrationsApplyWithEitherLists) {
  register_float_op("aten::hardswish");
  const auto x = at::randn({4}, at::kBFloat16);
  for (const OpLists lists : {OpLists::kApex, OpLists::kTorch}) {
    init(lists);
    EXPECT_EQ(at::hardswish(x).scalar_type(), at::kFloat) << to_string(lists);
    reset();
  }
}

}  // namespace
}  // namespace amp
