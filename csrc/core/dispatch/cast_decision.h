#pragma once
// What one kernel call decides, from this thread's carried mode (carried_state.h) and the
// session's level rules (session.h; docs/casting.md, "The no_grad gate").
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "dispatch/carried_state.h"
#include "dispatch/policy_table.h"
#include "optamp/opt_level.h"
#include "optamp/policy.h"
#include "session.h"

namespace amp::detail {

// The rule sets are public (optamp/policy.h): Python's function wrappers apply them too.
using amp::RuleSet;

// The level rules of the session (session.h), read by every kernel call. initialize publishes
// them with the rest of the session; these edit only the rules (tests of the casting tables).
void set_level_rules(const Properties& properties);
void clear_level_rules();
c10::ScalarType level_low_dtype();
int verbosity();
// The op lists initialize chose (Apex's when none is initialized).
OpLists level_op_lists();

// What one kernel call should do.
struct CastDecision {
  RuleSet rules = RuleSet::kNone;
  c10::ScalarType low = c10::ScalarType::Undefined;
  // Native autocast is on for the device: optamp only redispatches, and must stay out of the
  // native kernel's inner calls too (native autocast excludes its own key while it recurses,
  // which would otherwise look like "native autocast off" to us).
  bool native_owns = false;
  // The table the call follows: Apex's, or torch's for the call's device (op_lists).
  ListSet lists = ListSet::kApex;
  // The level's rules that the no_grad gate holds back (rules is kNone then): the calls they would
  // cast still widen inputs of mixed widths, which they could not run as given (cast_kernel.h).
  RuleSet gated = RuleSet::kNone;
};
// The gate: rules apply while GradMode is on, inside an amp::autocast region, or always when the
// model is cast in place (O3);
// never under disable_casts, and never while native autocast is on for `device` (we defer).
CastDecision decide(c10::DeviceType device);
// Whether optamp's rules apply to ops on this thread now: the key is on, no disable_casts or
// autocast(enabled=false) is innermost, and a level or an autocast region says so (with the
// grad-mode gate). Native torch.autocast, where it is on, takes precedence over this.
bool rules_apply_now();
// The rules of `level` for a call on a thread in `carried` mode (not a region), after the no_grad
// gate: kNone when gated off (`gated` then names them) or when the level has none.
CastDecision level_decision(const LevelRules& level, const CarriedMode& carried);

}  // namespace amp::detail
