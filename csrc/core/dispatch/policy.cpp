// optamp/policy.h: the policies' names and when each applies, the rules in effect on a thread,
// user registrations and the policy report.
#include "optamp/policy.h"

#include <sstream>
#include <string>

#include "dispatch/cast_decision.h"
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

std::string policy_report() {
  const detail::PolicyRows rows = detail::policy_rows();
  std::ostringstream out;
  out << "optamp casting policies (" << rows.apex.size() << " operators; op_lists=\"apex\"):\n";
  for (const auto& [name, policy] : rows.apex) out << "  " << name << ": " << policy << "\n";
  out << "op_lists=\"apex\" on CPU tensors, where it differs (" << rows.apex_cpu.size()
      << " operators; no fp16/bf16 CPU kernel):\n";
  for (const auto& [name, policy] : rows.apex_cpu) {
    out << "  " << name << ": " << policy << " on CPU\n";
  }
  out << "torch.autocast's lists (" << rows.torch.size()
      << " operators; op_lists=\"torch\"), CPU | CUDA and other devices:\n";
  for (const auto& [name, policies] : rows.torch) out << "  " << name << ": " << policies << "\n";
  out << "skipped (not in this LibTorch): " << rows.skipped.size() << "\n";
  for (const auto& name : rows.skipped) out << "  " << name << "\n";
  return out.str();
}

}  // namespace amp
