#pragma once
// The built-in op lists as data: operator name + overload -> CastPolicy (docs/casting.md).
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <vector>

#include "optamp/opt_level.h"
#include "optamp/policy.h"

namespace amp::detail {

struct TableEntry {
  const char* name;      // "aten::mm"
  const char* overload;  // "" = the default overload
  CastPolicy policy;
  const char* message;  // kBanned: the error, naming what to use instead; else nullptr
};

// The tables a cast kernel can follow: Apex's lists, or torch.autocast's for CPU tensors or for
// tensors of any other device (AutocastCUDA's, which XPU and the rest share). Apex's lists for
// CPU tensors (kApexCpu) and torch's CPU table also put the ops ATen has no fp16/bf16 CPU kernel
// for, where CUDA has one, in fp32 (always).
// (The public amp::PolicyList: policy_rows() names them.)
using ListSet = PolicyList;
constexpr int kNumListSets = 4;
// Every table, in the enum's order (its values index the per-table arrays).
constexpr ListSet kListSets[kNumListSets] = {ListSet::kApex, ListSet::kTorchCpu,
                                             ListSet::kTorchOther, ListSet::kApexCpu};
ListSet list_set_for(OpLists lists, c10::DeviceType device);

// Every entry of one table, in policy order (lower, fp32, fp32 (loss), promote, banned). In
// torch's tables, losses and softmaxes (the ops Apex's table marks fp32 (loss)) are fp32 (loss)
// too, so they stay fp32 at O2/O5 whichever lists are chosen.
const std::vector<TableEntry>& table_of(ListSet set);
// Apex's table (table_of(ListSet::kApex), the one for tensors not on the CPU).
const std::vector<TableEntry>& builtin_table();

// Promote ops whose kernels already compute mixed floating dtypes in the promoted type, with the
// result and the gradients of an explicit cast (TensorIterator ops and cat/stack): where torch's
// promotion picks the same dtype as the promote policy, the cast kernel leaves the promotion to
// them instead of casting first. `name` "aten::add", `overload` "Tensor".
bool promotes_natively(const char* name, const char* overload);

// The ops that need their source in self's dtype (CastPolicy::kMatchSelf), the same whichever
// lists are in use: torch errs on a mix ("index_add_(): self (Half) and source (Float) must have
// the same scalar type") where no table casts, and a reduced buffer meets an fp32 value at
// O2/O5 (the fp32 softmax's product). Entries are {"aten::index_add_", ""}-style names.
const std::vector<TableEntry>& match_self_ops();

}  // namespace amp::detail
