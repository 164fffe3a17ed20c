#include "dispatch/cast_state.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

#include "dispatch/substitution.h"
#include "optamp/autocast.h"
#include "session.h"

namespace amp::detail {
namespace {

std::atomic<std::uint64_t> g_epoch{0};
std::atomic<std::uint64_t> g_next_frame{1};

// Tags of the level modes in the PrivateUse1 autocast dtype slot (region dtypes are float16 or
// bfloat16, so these never collide with one).
constexpr c10::ScalarType kFollowLevelTag = c10::ScalarType::Float;
constexpr c10::ScalarType kUngatedTag = c10::ScalarType::Double;
// Disabled keeps the keys as they are (the kernels then only redispatch): a thread must still
// reach thread_cast_state() at its next op to drop a disable_casts ended on another thread.
constexpr c10::ScalarType kDisabledTag = c10::ScalarType::Bool;

bool is_region_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

// Writes the effective mode where at::ThreadLocalState carries it.
void write_carried(std::int32_t mode, c10::ScalarType dtype, bool key, bool substitution) {
  if (key != thread_key_on()) set_thread_key(key);
  if (substitution != substitution_thread_on()) activate_substitution_thread(substitution);
  const c10::ScalarType tag = mode == kRegion               ? dtype
                              : mode == kFollowLevelUngated ? kUngatedTag
                              : mode == kDisabled           ? kDisabledTag
                                                            : kFollowLevelTag;
  at::autocast::set_autocast_dtype(c10::DeviceType::PrivateUse1, tag);
}

// Recomputes the region depth and the thread's carried state from the frames left open.
void apply_frames(ThreadCastState& state) {
  std::int32_t mode = state.base_mode;
  c10::ScalarType dtype = state.base_dtype;
  state.region_depth = 0;
  bool key = state.base_key_on, substitution = state.base_substitution_on;
  for (const CastFrame& f : state.frames) {
    state.region_depth += f.is_autocast ? 1 : 0;
    if (f.ungate) {
      if (mode == kFollowLevel) mode = kFollowLevelUngated;
      continue;
    }
    mode = f.mode;
    dtype = f.dtype;
    if (f.sets_key) key = f.key_on;
    if (f.sets_substitution) substitution = f.substitution_on;
  }
  write_carried(mode, dtype, key, substitution);
}

// Every frame of this thread ends; key, substitution and mode go back to their initial values.
void end_all_frames(ThreadCastState& state) {
  state.frames.clear();
  state.base_key_on = false;
  state.base_substitution_on = false;
  state.base_mode = kFollowLevel;
  state.base_dtype = c10::ScalarType::Undefined;
  apply_frames(state);
}

// Bumped whenever some thread must look at its frames again: by every reset and by every frame
// abandoned on another thread. thread_cast_state() compares it with the thread's last look (one
// relaxed load per kernel call).
std::atomic<std::uint64_t> g_generation{0};
std::mutex g_abandoned_mutex;
std::unordered_set<std::uint64_t> g_abandoned;  // frames whose guard ended on another thread

void sync_with_other_threads(ThreadCastState& state) {
  const std::uint64_t epoch = g_epoch.load(std::memory_order_acquire);
  if (state.epoch != epoch) {
    state.epoch = epoch;
    // Only guards this thread opened end here. A thread without any (a pool thread running with
    // a caller's at::ThreadLocalState, say) keeps the state it was handed.
    if (!state.frames.empty()) end_all_frames(state);
    return;
  }
  if (state.frames.empty()) return;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(g_abandoned_mutex);
    for (auto it = state.frames.begin(); it != state.frames.end();) {
      if (g_abandoned.erase(it->id)) {
        it = state.frames.erase(it);
        changed = true;
      } else {
        ++it;
      }
    }
  }
  if (changed) apply_frames(state);
}

}  // namespace

ThreadCastState& thread_cast_state() {
  thread_local ThreadCastState state;
  const std::uint64_t generation = g_generation.load(std::memory_order_acquire);
  if (C10_UNLIKELY(state.generation != generation)) {
    state.generation = generation;
    sync_with_other_threads(state);
  }
  return state;
}

void abandon_frame(std::uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(g_abandoned_mutex);
    g_abandoned.insert(id);
  }
  g_generation.fetch_add(1, std::memory_order_acq_rel);
}

std::uint64_t push_frame(CastFrame frame) {
  ThreadCastState& state = thread_cast_state();
  if (state.frames.empty()) {  // the base may have come from elsewhere (at::ThreadLocalState)
    state.base_key_on = thread_key_on();
    state.base_substitution_on = substitution_thread_on();
    const CarriedMode carried = carried_mode();
    state.base_mode = carried.mode == kDisabled ? kFollowLevel : carried.mode;
    state.base_dtype = carried.dtype;
  }
  frame.id = g_next_frame.fetch_add(1, std::memory_order_relaxed);
  state.frames.push_back(frame);
  apply_frames(state);
  return frame.id;
}

bool pop_frame(std::uint64_t id, bool* out_of_order) {
  ThreadCastState& state = thread_cast_state();
  *out_of_order = false;
  for (auto it = state.frames.begin(); it != state.frames.end(); ++it) {
    if (it->id != id) continue;
    *out_of_order = std::next(it) != state.frames.end();
    state.frames.erase(it);
    apply_frames(state);
    return true;
  }
  return false;
}

void reset_all_thread_states() {
  {
    std::lock_guard<std::mutex> lock(g_abandoned_mutex);
    g_abandoned.clear();  // every frame ends anyway
  }
  g_epoch.fetch_add(1, std::memory_order_acq_rel);
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  end_all_frames(thread_cast_state());  // the caller: now, whether or not it has frames
}

void set_level_rules(const Properties& properties) {
  edit_session([&](Session& s) { s.rules = level_rules_for(properties); });
}

void clear_level_rules() {
  edit_session([](Session& s) { s.rules = LevelRules{}; });
}

OpLists level_op_lists() { return current_level_rules().op_lists; }

c10::ScalarType level_low_dtype() { return current_level_rules().low; }
int verbosity() { return current_level_rules().verbosity; }

void set_thread_key(bool on) {
  const bool was_on = thread_key_on();
  c10::impl::tls_set_dispatch_key_included(kCastKey, on);
  c10::impl::tls_set_dispatch_key_excluded(kCastKey, !on);
  // Turned on from off: the level's mode, whatever the slot held (its default is a dtype).
  if (on && !was_on)
    at::autocast::set_autocast_dtype(c10::DeviceType::PrivateUse1, kFollowLevelTag);
}

bool thread_key_on() { return c10::impl::tls_is_dispatch_key_included(kCastKey); }

CarriedMode carried_mode() {
  if (!thread_key_on()) return {kDisabled, c10::ScalarType::Undefined};
  const c10::ScalarType tag = at::autocast::get_autocast_dtype(c10::DeviceType::PrivateUse1);
  if (is_region_dtype(tag)) return {kRegion, tag};
  if (tag == kDisabledTag) return {kDisabled, c10::ScalarType::Undefined};
  return {tag == kUngatedTag ? kFollowLevelUngated : kFollowLevel, c10::ScalarType::Undefined};
}

namespace {

// The level's rules (not a region's) for this call, with the no_grad gate.
CastDecision level_decision(const LevelRules& level, const CarriedMode& carried) {
  if (level.rules == RuleSet::kNone) return {};
  const bool gated =
      !level.ungated && carried.mode != kFollowLevelUngated && !level.rules_under_no_grad;
  if (gated && !c10::GradMode::is_enabled()) return {};
  return {level.rules, level.low};
}

}  // namespace

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

RuleSet level_decision_rules() {
  return level_decision(current_level_rules(), carried_mode()).rules;
}

bool rules_apply_now() {
  thread_cast_state();
  const CarriedMode carried = carried_mode();
  if (carried.mode == kDisabled) return false;
  if (carried.mode == kRegion) return true;
  return level_decision(current_level_rules(), carried).rules != RuleSet::kNone;
}

}  // namespace amp::detail
