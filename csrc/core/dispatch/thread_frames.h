#pragma once
// The guards open on each thread, as frames (docs/design.md, "Per-thread guards are frames, not
// saved values"), and the resets that end them on every thread.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "dispatch/carried_state.h"

namespace amp::detail {

// One open guard on a thread: amp::autocast, amp::disable_casts or amp::thread_state_guard.
struct CastFrame {
  std::uint64_t id = 0;
  std::int32_t mode = kFollowLevel;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool is_autocast = false;  // counts for the cache drop at the outermost autocast exit
  bool sets_key = false;     // turns the casting key on/off (autocast, thread_state_guard)
  bool key_on = false;
  bool sets_substitution = false;  // thread_state_guard: O2/O5 substitution on/off
  bool substitution_on = false;
  // Lifts the no_grad gate without changing the mode otherwise (kFollowLevel becomes
  // kFollowLevelUngated; regions and disabled stay).
  bool ungate = false;
};

// The guards open on a thread, in entry order, and what they add up to. Guards may exit in any
// order (two asyncio tasks on one thread interleave their `with` blocks): an exit removes its own
// frame wherever it is and the state is recomputed from the frames left, so a mismatched exit
// cannot leave the thread in a mode no open guard asked for. reset() and initialize() end every
// thread's frames (lazily, through `epoch`, for threads other than the caller).
struct ThreadCastState {
  // The mode itself is not kept here: apply_frames writes it where at::ThreadLocalState carries
  // it (carried_mode()), which is what the kernels read.
  int region_depth = 0;  // open amp::autocast frames on this thread
  std::vector<CastFrame> frames;
  bool base_key_on = false;               // the key before the first frame opened
  bool base_substitution_on = false;      // likewise for O2/O5 substitution
  std::int32_t base_mode = kFollowLevel;  // and the mode (a carried region, say)
  c10::ScalarType base_dtype = c10::ScalarType::Undefined;
  std::uint64_t epoch = 0;       // the last reset this thread has seen
  std::uint64_t generation = 0;  // the last reset or abandoned frame it has looked at
};
// This thread's state (brought back to its initial value first if a reset happened since).
ThreadCastState& thread_cast_state();

// Opens a frame on this thread (taking the key/substitution base when it is the first) and
// applies it. Returns its id.
std::uint64_t push_frame(CastFrame frame);
// Closes frame `id` on this thread. Returns false when it was not open any more (a reset ended
// it), true otherwise; `out_of_order` tells whether newer frames were still open above it.
bool pop_frame(std::uint64_t id, bool* out_of_order);
// A guard that ends on another thread than the one it opened its frame on: the frame is closed
// on its own thread at that thread's next kernel call or guard (a thread can't touch another's
// thread-local state).
void abandon_frame(std::uint64_t id);
// Ends every open frame of every thread and brings each thread's mode, key and substitution
// back to their initial values: now for the calling thread, for other threads at their next
// kernel call or guard.
void reset_all_thread_states();

}  // namespace amp::detail
