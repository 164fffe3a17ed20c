#include "dispatch/cast_decision.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include "dispatch/thread_frames.h"
#include "session.h"

namespace amp::detail {

void set_level_rules(const Properties& properties) {
  edit_session([&](Session& s) { s.rules = level_rules_for(properties); });
}

void clear_level_rules() {
  edit_session([](Session& s) { s.rules = LevelRules{}; });
}

OpLists level_op_lists() { return current_level_rules().op_lists; }

c10::ScalarType level_low_dtype() { return current_level_rules().low; }
int verbosity() { return current_level_rules().verbosity; }

CastDecision level_decision(const LevelRules& level, const CarriedMode& carried) {
  if (level.rules == RuleSet::kNone) return {};
  const bool gated =
      !level.ungated && carried.mode != kFollowLevelUngated && !level.rules_under_no_grad;
  if (gated && !c10::GradMode::is_enabled()) {
    CastDecision held_back;
    held_back.gated = level.rules;
    return held_back;
  }
  return {level.rules, level.low};
}

CastDecision decide(c10::DeviceType device) {
  thread_cast_state();  // catches up with resets and frames ended on other threads
  // Coexistence rule: inside native torch.autocast / at::autocast for this device, native
  // autocast owns the casting and optamp only redispatches.
  if (at::autocast::is_autocast_enabled(device)) {
    CastDecision defer;
    defer.native_owns = true;
    return defer;
  }
  const CarriedMode carried = carried_mode();
  if (carried.mode == kDisabled) return {};
  const LevelRules level = current_level_rules();
  CastDecision decision = carried.mode == kRegion ? CastDecision{RuleSet::kFullLists, carried.dtype}
                                                  : level_decision(level, carried);
  decision.lists = list_set_for(level.op_lists, device);
  return decision;
}

bool rules_apply_now() {
  thread_cast_state();
  const CarriedMode carried = carried_mode();
  if (carried.mode == kDisabled) return false;
  if (carried.mode == kRegion) return true;
  return level_decision(current_level_rules(), carried).rules != RuleSet::kNone;
}

}  // namespace amp::detail
