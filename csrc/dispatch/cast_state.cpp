#include "dispatch/cast_state.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>

#include "optamp/autocast.h"

namespace amp::detail {
namespace {

std::atomic<RuleSet> g_rules{RuleSet::kNone};
std::atomic<c10::ScalarType> g_low{c10::ScalarType::Undefined};
std::atomic<int> g_verbosity{1};

RuleSet rules_for(const Properties& p) {
  if (!p.enabled) return RuleSet::kNone;
  switch (p.opt_level) {
    case OptLevel::O1:
    case OptLevel::O4:
      return p.patch_torch_functions ? RuleSet::kFullLists : RuleSet::kNone;
    case OptLevel::O2:
    case OptLevel::O5:
      return RuleSet::kMasterWeights;
    case OptLevel::O3:
      return RuleSet::kPureLow;
    default:
      return RuleSet::kNone;
  }
}

}  // namespace

ThreadCastState& thread_cast_state() {
  thread_local ThreadCastState state;
  return state;
}

void set_level_rules(const Properties& properties) {
  g_low.store(properties.low_dtype());
  g_verbosity.store(properties.verbosity);
  g_rules.store(rules_for(properties));
}

void clear_level_rules() {
  g_rules.store(RuleSet::kNone);
  g_low.store(c10::ScalarType::Undefined);
  g_verbosity.store(1);
}

c10::ScalarType level_low_dtype() { return g_low.load(std::memory_order_relaxed); }
int verbosity() { return g_verbosity.load(std::memory_order_relaxed); }

void set_thread_key(bool on) {
  c10::impl::tls_set_dispatch_key_included(kCastKey, on);
  c10::impl::tls_set_dispatch_key_excluded(kCastKey, !on);
}

bool thread_key_on() { return c10::impl::tls_is_dispatch_key_included(kCastKey); }

CastDecision decide(c10::DeviceType device) {
  const ThreadCastState& state = thread_cast_state();
  if (state.mode == kDisabled) return {};
  // Coexistence rule: inside native torch.autocast / at::autocast for this device, native
  // autocast owns the casting and optamp only redispatches.
  if (at::autocast::is_autocast_enabled(device)) {
    CastDecision defer;
    defer.native_owns = true;
    return defer;
  }
  if (state.mode == kRegion) return {RuleSet::kFullLists, state.region_dtype};
  const RuleSet rules = g_rules.load(std::memory_order_relaxed);
  if (rules == RuleSet::kNone) return {};
  if (rules != RuleSet::kPureLow && !c10::GradMode::is_enabled()) return {};
  return {rules, g_low.load(std::memory_order_relaxed)};
}

}  // namespace amp::detail
