#include "dispatch/thread_frames.h"

#include <atomic>
#include <iterator>
#include <mutex>
#include <unordered_set>

namespace amp::detail {
namespace {

std::atomic<std::uint64_t> g_epoch{0};
std::atomic<std::uint64_t> g_next_frame{1};

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

}  // namespace amp::detail
