#pragma once
// Casting policies and user registration of operators (docs/casting.md).
//
// Policies are applied by kernels on optamp's dispatch key, so they hold for every ATen call,
// from C++ or Python. Names are "namespace::op" or "namespace::op.overload"; without an
// overload, every overload of the op gets the policy.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "optamp/cast_cache.h"  // cast_count(), declared here before
#include "optamp/export.h"

namespace amp {

// What a listed op's kernel does with its inputs (the lists: docs/casting.md).
enum class CastPolicy : std::uint8_t {
  kLower,     // cast floating (non-double) inputs to the level's low dtype (fp16 / bf16)
  kFp32,      // cast fp16/bf16 inputs to fp32 (or set the op's dtype argument); O1/O4, regions
  kFp32Loss,  // as kFp32, at every casting level (losses and their softmaxes; O2/O5 included)
  kPromote,   // if floating inputs mix widths, cast all to the widest
  kBanned,    // refuse with the table's message (O1/O4, regions); an fp32 loss at O2/O5
  // As kFp32, at every level that casts (O1-O5, regions), under the no_grad gate too: what
  // register_float_op registers, so a registered op (a loss, say) runs in fp32 whatever the level
  // does to the model; built in for the ops ATen has no fp16/bf16 kernels for (FFTs, linear
  // algebra, cdist, quantile; on the CPU also avg_pool3d, trace and the distributions' samplers).
  kFp32Always,
  // Ops that need their source in self's dtype (in-place `index_add_`, `scatter_add_`, ...):
  // floating inputs of another width are cast to self's, at every level that casts. Where a
  // reduced buffer meets a widened value (an fp32 softmax's product at O2/O5) they failed.
  kMatchSelf,
  // Ops of other libraries that register their own autocast kernel (torchvision's nms,
  // roi_align, ...; `torch.library.register_autocast`): that kernel casts them, as it does under
  // torch.autocast, with the level's low dtype, at every level that casts. Found when amp
  // initializes; a table entry or a registration of the op takes precedence.
  kOwnAutocast,
};

// "lower", "fp32", "fp32 (loss)", "promote", "banned", "fp32 (always)", "match self",
// "own autocast" (as policy_report() prints them).
OPTAMP_API const char* to_string(CastPolicy policy);

// Which policies apply: chosen by the level (or an amp::autocast region), per call after the
// no_grad gate (docs/casting.md, "When ops are cast").
enum class RuleSet : std::uint8_t {
  kNone,           // nothing is cast (O0, disabled, disable_casts, gated off)
  kFullLists,      // O1/O4 and amp::autocast regions: every policy
  kMasterWeights,  // O2/O5: lower, fp32 (loss), promote and banned-as-a-loss
  kPureLow,        // O3 (and O0 with a reduced cast_model_type): lower only
};
OPTAMP_API const char* to_string(RuleSet rules);

OPTAMP_API bool policy_applies(CastPolicy policy, RuleSet rules);

// What a kernel for an op on `device` would apply on this thread now, and the low dtype.
// {kNone, Undefined} where optamp is off, disabled or gated, or native autocast owns `device`.
struct OPTAMP_API CastRules {
  RuleSet rules = RuleSet::kNone;
  c10::ScalarType low = c10::ScalarType::Undefined;
};
OPTAMP_API CastRules cast_rules_now(c10::DeviceType device);

// Apex's register_half_function / register_float_function / register_promote_function for
// dispatcher ops (ATen or custom TORCH_LIBRARY ops). Usable before or after amp::initialize;
// the newest registration of an op wins. Unknown ops: ValueError naming the op.
// register_half_op applies at every level that casts, register_float_op too (CastPolicy::
// kFp32Always: a registered loss runs in fp32 at O1-O5, whatever the model's dtype),
// register_promote_op where the promote list applies (O1, O2, O4, O5, regions).
OPTAMP_API void register_half_op(std::string_view qualified_name);
OPTAMP_API void register_float_op(std::string_view qualified_name);
OPTAMP_API void register_promote_op(std::string_view qualified_name);

// The tables a cast kernel follows: Apex's lists (op_lists "apex") for tensors on any device but
// the CPU and for CPU tensors (where ATen has no fp16/bf16 CPU kernel an op is fp32 (always)),
// and torch.autocast's lists (op_lists "torch") for CPU tensors and for the other devices.
enum class PolicyList : std::uint8_t { kApex = 0, kTorchCpu = 1, kTorchOther = 2, kApexCpu = 3 };
// "apex", "apex (CPU)", "torch (CPU)", "torch (CUDA and other devices)".
OPTAMP_API const char* to_string(PolicyList list);

// One operator overload's policy in one list: "aten::mm" (every overload) or "aten::add.Tensor".
struct PolicyRow {
  std::string op;
  PolicyList list;
  CastPolicy policy;
};

// The registered kernels' policies as data (what policy_report() prints), user registrations and
// other libraries' own autocast kernels included: a row per op and list that gives it a policy,
// ordered by op, then list. For programs that need the lists themselves (the Python front's
// torch.compile mode reads the fp32 (always) rows) rather than a text for people.
OPTAMP_API std::vector<PolicyRow> policy_rows();

// Debug listing: every table entry with its policy, and the overloads this LibTorch lacks.
OPTAMP_API std::string policy_report();

}  // namespace amp
