// optamp/policy.h: the policies' names and when each applies, the rules in effect on a thread,
// user registrations and the policy report.
#include "optamp/policy.h"

#include <array>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "dispatch/cast_decision.h"
#include "dispatch/policy_table.h"
#include "dispatch/registration.h"

namespace amp {

const char* to_string(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::kLower:
      return "lower";
    case CastPolicy::kFp32:
      return "fp32";
    case CastPolicy::kFp32Loss:
      return "fp32 (loss)";
    case CastPolicy::kPromote:
      return "promote";
    case CastPolicy::kBanned:
      return "banned";
    case CastPolicy::kFp32Always:
      return "fp32 (always)";
    case CastPolicy::kMatchSelf:
      return "match self";
    case CastPolicy::kOwnAutocast:
      return "own autocast";
  }
  return "?";
}

const char* to_string(PolicyList list) {
  switch (list) {
    case PolicyList::kApex:
      return "apex";
    case PolicyList::kTorchCpu:
      return "torch (CPU)";
    case PolicyList::kTorchOther:
      return "torch (CUDA and other devices)";
    case PolicyList::kApexCpu:
      return "apex (CPU)";
  }
  return "?";
}

const char* to_string(RuleSet rules) {
  switch (rules) {
    case RuleSet::kNone:
      return "none";
    case RuleSet::kFullLists:
      return "full lists";
    case RuleSet::kMasterWeights:
      return "master weights";
    case RuleSet::kPureLow:
      return "pure low";
  }
  return "?";
}

bool policy_applies(CastPolicy policy, RuleSet rules) {
  if (policy == CastPolicy::kFp32Always || policy == CastPolicy::kMatchSelf ||
      policy == CastPolicy::kOwnAutocast) {
    return rules != RuleSet::kNone;
  }
  switch (rules) {
    case RuleSet::kFullLists:
      return true;
    case RuleSet::kMasterWeights:  // everything but the fp32 list (docs/design.md says why)
      return policy != CastPolicy::kFp32;
    case RuleSet::kPureLow:
      return policy == CastPolicy::kLower;
    case RuleSet::kNone:
      break;
  }
  return false;
}

CastRules cast_rules_now(c10::DeviceType device) {
  if (!detail::thread_key_on()) return {};
  const detail::CastDecision decision = detail::decide(device);
  if (decision.native_owns || decision.rules == RuleSet::kNone) return {};
  return {decision.rules, decision.low};
}

void register_half_op(std::string_view name) { detail::register_user_op(name, CastPolicy::kLower); }
void register_float_op(std::string_view name) {
  detail::register_user_op(name, CastPolicy::kFp32Always);
}
void register_promote_op(std::string_view name) {
  detail::register_user_op(name, CastPolicy::kPromote);
}

std::vector<PolicyRow> policy_rows() { return detail::registered_policies().rows; }

namespace {

// One op's policy in each list ("-" where a list has none), for the report's columns.
using PoliciesByList = std::map<std::string, std::array<const char*, detail::kNumListSets>>;

PoliciesByList by_op(const std::vector<PolicyRow>& rows) {
  PoliciesByList ops;
  for (const PolicyRow& row : rows) {
    auto [it, inserted] = ops.try_emplace(row.op);
    if (inserted) it->second.fill("-");
    it->second[static_cast<int>(row.list)] = to_string(row.policy);
  }
  return ops;
}

const char* in(const PoliciesByList::mapped_type& policies, PolicyList list) {
  return policies[static_cast<int>(list)];
}

}  // namespace

std::string policy_report() {
  const detail::RegisteredPolicies registered = detail::registered_policies();
  const PoliciesByList ops = by_op(registered.rows);
  std::ostringstream apex, apex_cpu, torch;
  int n_apex = 0, n_apex_cpu = 0, n_torch = 0;
  for (const auto& [op, policies] : ops) {
    const std::string_view on_apex = in(policies, PolicyList::kApex);
    const std::string_view on_cpu = in(policies, PolicyList::kApexCpu);
    if (on_apex != "-") {
      ++n_apex;
      apex << "  " << op << ": " << on_apex << "\n";
    }
    if (on_cpu != "-" && on_cpu != on_apex) {
      ++n_apex_cpu;
      apex_cpu << "  " << op << ": " << on_cpu << " on CPU\n";
    }
    const std::string_view torch_cpu = in(policies, PolicyList::kTorchCpu);
    const std::string_view torch_other = in(policies, PolicyList::kTorchOther);
    if (torch_cpu != "-" || torch_other != "-") {
      ++n_torch;
      torch << "  " << op << ": " << torch_cpu << " | " << torch_other << "\n";
    }
  }
  std::ostringstream out;
  out << "optamp casting policies (" << n_apex << " operators; op_lists=\"apex\"):\n"
      << apex.str() << "op_lists=\"apex\" on CPU tensors, where it differs (" << n_apex_cpu
      << " operators; no fp16/bf16 CPU kernel):\n"
      << apex_cpu.str() << "torch.autocast's lists (" << n_torch
      << " operators; op_lists=\"torch\"), CPU | CUDA and other devices:\n"
      << torch.str() << "skipped (not in this LibTorch): " << registered.skipped.size() << "\n";
  for (const auto& name : registered.skipped) out << "  " << name << "\n";
  return out.str();
}

}  // namespace amp
