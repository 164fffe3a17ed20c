#pragma once
// Process-wide rules of the initialized level and per-thread casting state (ARCHITECTURE §1).
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "optamp/opt_level.h"

namespace amp::detail {

// The key optamp's casting kernels live on: above AutocastCUDA/CPU, free in CPU/CUDA builds.
constexpr c10::DispatchKey kCastKey = c10::DispatchKey::AutocastPrivateUse1;

// Which table categories apply (set by the opt level, or by an explicit amp::autocast region).
enum class RuleSet : std::uint8_t {
  kNone,           // O0, disabled, not initialized
  kFullLists,      // O1/O4 and amp::autocast regions: lower, fp32, promote, banned
  kMasterWeights,  // O2/O5: lower and losses-in-fp32; everything else follows type promotion
  kPureLow,        // O3: lower only, always (the model has no fp32 weights to protect)
};

// Per-thread mode, saved/restored by the RAII guards.
enum ThreadMode : std::int32_t { kFollowLevel = 0, kRegion = 1, kDisabled = 2 };

struct ThreadCastState {
  std::int32_t mode = kFollowLevel;
  c10::ScalarType region_dtype = c10::ScalarType::Undefined;
  int region_depth = 0;  // nesting of amp::autocast on this thread
};
ThreadCastState& thread_cast_state();

// Level rules, read by every kernel call (atomics: set once per initialize).
void set_level_rules(const Properties& properties);
void clear_level_rules();
c10::ScalarType level_low_dtype();
int verbosity();

// This thread's key: TLS include + un-exclude (new threads start with it off).
void set_thread_key(bool on);
bool thread_key_on();

// What one kernel call should do.
struct CastDecision {
  RuleSet rules = RuleSet::kNone;
  c10::ScalarType low = c10::ScalarType::Undefined;
  // Native autocast is on for the device: optamp only redispatches, and must stay out of the
  // native kernel's inner calls too (native autocast excludes its own key while it recurses,
  // which would otherwise look like "native autocast off" to us).
  bool native_owns = false;
};
// The gate: rules apply while GradMode is on, inside an amp::autocast region, or always at O3;
// never under disable_casts, and never while native autocast is on for `device` (we defer).
CastDecision decide(c10::DeviceType device);

}  // namespace amp::detail
