// The op-case table (tests/op_cases.txt, shared with the Python tests): every lower / fp32 /
// promote entry of the policy table runs in the dtype its policy gives, at O1 and O4, on the CPU
// and on CUDA; the table covers exactly the policy table's entries. Also the policies each rule
// set applies (docs/casting.md).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "casting_test.h"
#include "dispatch/policy_table.h"
#include "op_cases.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the casting fixtures

// A promote case on mixed low/fp32 inputs: the result is fp32 (or the op's own result type).
// optamp widened the low inputs, except for the ops that promote by themselves exactly as a cast
// would (detail::promotes_natively; tests/python/test_casting.py compares them with a cast):
// those run uncast, saving a cast and its autograd node per call.
void expect_promoted(const OpCase& c, ScalarType low, at::Device device) {
  const auto before = cast_count();
  const at::Tensor out = run_case(c, low, device);
  EXPECT_EQ(out.scalar_type(), c.result == ScalarType::Undefined ? at::kFloat : c.result);
  const auto dot = c.name.find('.');
  const std::string name = "aten::" + c.name.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : c.name.substr(dot + 1);
  if (detail::promotes_natively(name.c_str(), overload.c_str())) {
    EXPECT_EQ(cast_count() - before, 0) << "torch promotes this op itself";
  } else {
    EXPECT_GT(cast_count() - before, 0) << "no input was cast";
  }
}

// (level, device): each test once per level on the CPU and, where a GPU is visible, on CUDA.
class CastingTable : public OnDevices<Casting, std::string> {
 protected:
  const char* level() const { return param().c_str(); }
};

TEST_P(CastingTable, LowerOpsRunInTheLevelsLowDtype) {
  enable(level());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : op_cases("lower")) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(run_case(c, at::kFloat, device()).scalar_type(), low);
    EXPECT_EQ(run_case(c, low, device()).scalar_type(), low);
  }
}

TEST_P(CastingTable, Fp32OpsRunInFp32) {
  enable(level());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : op_cases("fp32")) {
    SCOPED_TRACE(c.name);
    const ScalarType fp32 = c.result == ScalarType::Undefined ? at::kFloat : c.result;
    EXPECT_EQ(run_case(c, low, device()).scalar_type(), fp32);
    EXPECT_EQ(run_case(c, at::kFloat, device()).scalar_type(), fp32);
  }
}

TEST_P(CastingTable, PromoteOpsWidenMixedInputs) {
  enable(level());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : op_cases("promote")) {
    SCOPED_TRACE(c.name);
    expect_promoted(c, low, device());
  }
  // Same widths: left alone.
  auto a = at::randn({3}, at::dtype(low).device(device()));
  const auto before = cast_count();
  EXPECT_EQ(at::add(a, a).scalar_type(), low);
  EXPECT_EQ(at::cat({a, a}).scalar_type(), low);
  EXPECT_EQ(at::eq(a, a).scalar_type(), at::kBool);
  EXPECT_EQ(cast_count(), before);
}

TEST_P(CastingTable, BannedOpSaysWhatToUseInstead) {
  enable(level());
  auto p = at::rand({4}, at::device(device())).clamp(0.1, 0.9);
  OPTAMP_EXPECT_THROW_WITH(at::binary_cross_entropy(p, p), c10::Error, "binary_cross_entropy",
                           "binary_cross_entropy_with_logits", "BCEWithLogitsLoss",
                           "Refused at O1/O4", "at O2/O5 it runs as an fp32 loss");
}

std::string level_on_device(
    const ::testing::TestParamInfo<std::tuple<std::string, at::DeviceType>>& info) {
  return std::get<0>(info.param) + device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, CastingTable,
                         ::testing::Combine(::testing::Values("O1", "O4"), kDevices),
                         level_on_device);

// The one vocabulary: which policies each rule set applies (docs/design.md, "Policies per level").
TEST(CastPolicies, EachRuleSetAppliesItsPolicies) {
  const CastPolicy all[] = {CastPolicy::kLower,     CastPolicy::kFp32,
                            CastPolicy::kFp32Loss,  CastPolicy::kPromote,
                            CastPolicy::kBanned,    CastPolicy::kFp32Always,
                            CastPolicy::kMatchSelf, CastPolicy::kOwnAutocast};
  auto applied = [&](RuleSet rules) {
    std::string out;
    for (const CastPolicy p : all) {
      if (policy_applies(p, rules)) out += std::string(out.empty() ? "" : ", ") + to_string(p);
    }
    return out;
  };
  EXPECT_EQ(applied(RuleSet::kNone), "");
  // The last three apply wherever anything is cast: registered fp32 ops, ops that need their
  // source in self's dtype, other libraries' ops with their own autocast kernels.
  const std::string everywhere = "fp32 (always), match self, own autocast";
  EXPECT_EQ(applied(RuleSet::kFullLists),
            "lower, fp32, fp32 (loss), promote, banned, " + everywhere);
  EXPECT_EQ(applied(RuleSet::kMasterWeights), "lower, fp32 (loss), promote, banned, " + everywhere);
  EXPECT_EQ(applied(RuleSet::kPureLow), "lower, " + everywhere);
  EXPECT_STREQ(to_string(RuleSet::kMasterWeights), "master weights");
  // Only the banned entries carry a message, and each of them does.
  for (const auto& entry : detail::builtin_table()) {
    EXPECT_EQ(entry.message != nullptr, entry.policy == CastPolicy::kBanned) << entry.name;
  }
}

// The mechanical cross-check of tests/op_cases.txt against the policy table: every entry (except
// the banned one, BannedOpSaysWhatToUseInstead) has a case of its name under its policy, that
// case really dispatches that overload, and no case names something not in the table.
TEST_F(Casting, EveryTableEntryHasACaseThatCallsIt) {
  enable("O1");
  const std::vector<std::pair<const char*, std::vector<OpCase>>> lists = {
      {"lower", op_cases("lower")}, {"fp32", op_cases("fp32")}, {"promote", op_cases("promote")}};
  auto list_of = [](CastPolicy c) -> const char* {
    switch (c) {
      case CastPolicy::kLower:
        return "lower";
      case CastPolicy::kFp32:
      case CastPolicy::kFp32Loss:
      case CastPolicy::kFp32Always:  // built-in entries only: the FFTs
        return "fp32";
      case CastPolicy::kPromote:
        return "promote";
      case CastPolicy::kBanned:
        break;
    }
    return nullptr;
  };
  std::vector<std::string> entries;
  for (const auto& entry : detail::builtin_table()) {
    const char* list = list_of(entry.policy);
    if (list == nullptr) continue;
    std::string name = std::string(entry.name).substr(std::strlen("aten::"));
    if (*entry.overload != '\0') name += std::string(".") + entry.overload;
    entries.push_back(std::string(list) + " " + name);
    const auto& cases = std::find_if(lists.begin(), lists.end(), [&](const auto& l) {
                          return std::strcmp(l.first, list) == 0;
                        })->second;
    const auto found =
        std::find_if(cases.begin(), cases.end(), [&](const OpCase& c) { return name == c.name; });
    if (found == cases.end()) {
      ADD_FAILURE() << "aten::" << name << " (" << list << ") has no " << list
                    << " case in tests/op_cases.txt";
      continue;
    }
    const auto called =
        top_level_ops([&] { run_case(*found, detail::level_low_dtype(), at::kCPU); });
    std::string seen;
    for (const auto& op : called) seen += " " + op;
    EXPECT_NE(std::find(called.begin(), called.end(), "aten::" + name), called.end())
        << "the case \"" << name << "\" does not call aten::" << name << "; it calls:" << seen;
  }
  for (const auto& [list, cases] : lists) {
    for (const auto& c : cases) {
      EXPECT_NE(std::find(entries.begin(), entries.end(), std::string(list) + " " + c.name),
                entries.end())
          << "tests/op_cases.txt has the " << list << " case \"" << c.name << "\", which is no "
          << list << " entry of builtin_table()";
    }
  }
}

}  // namespace
}  // namespace amp
