#pragma once
// Per-thread casting state and what each kernel call decides from it and from the session's level
// rules (session.h; docs/casting.md, "The no_grad gate").
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "dispatch/policy_table.h"
#include "optamp/opt_level.h"
#include "optamp/policy.h"

namespace amp::detail {

// The key optamp's casting kernels live on: above AutocastCUDA/CPU, free in CPU/CUDA builds.
constexpr c10::DispatchKey kCastKey = c10::DispatchKey::AutocastPrivateUse1;

// The rule sets are public (optamp/policy.h): Python's function wrappers apply them too.
using amp::RuleSet;

// Per-thread mode, derived from the guards open on the thread (see ThreadCastState::frames).
//  kFollowLevel         the level's rules, while autograd records (the no_grad gate)
//  kRegion              an amp::autocast region: the full lists in its dtype, also under no_grad
//  kDisabled            no rules (disable_casts, autocast(enabled=false))
//  kFollowLevelUngated  the level's rules also under no_grad (amp::lift_no_grad_gate; the
//                       forward of a reentrant checkpoint)
enum ThreadMode : std::int32_t {
  kFollowLevel = 0,
  kRegion = 1,
  kDisabled = 2,
  kFollowLevelUngated = 3
};

// The effective mode lives in state that at::ThreadLocalState carries to other threads (the
// autograd engine's device threads, at::launch, torch.jit.fork): the dispatch-key TLS (casting
// and substitution keys) and the autocast dtype slot of PrivateUse1, the
// device type our key belongs to, which no backend uses in CPU/CUDA builds. The slot holds the
// region dtype (float16/bfloat16), or a tag for the other modes (see carried_mode()).
struct CarriedMode {
  std::int32_t mode = kFollowLevel;
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // the region dtype
};
CarriedMode carried_mode();

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

// The level rules of the session (session.h), read by every kernel call. initialize publishes
// them with the rest of the session; these edit only the rules (tests of the casting tables).
void set_level_rules(const Properties& properties);
void clear_level_rules();
c10::ScalarType level_low_dtype();
int verbosity();
// The op lists initialize chose (Apex's when none is initialized).
OpLists level_op_lists();

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
  // The table the call follows: Apex's, or torch's for the call's device (op_lists).
  ListSet lists = ListSet::kApex;
};
// The gate: rules apply while GradMode is on, inside an amp::autocast region, or always when the
// model is cast in place (O3);
// never under disable_casts, and never while native autocast is on for `device` (we defer).
CastDecision decide(c10::DeviceType device);
// Whether optamp's rules apply to ops on this thread now: the key is on, no disable_casts or
// autocast(enabled=false) is innermost, and a level or an autocast region says so (with the
// grad-mode gate). Native torch.autocast, where it is on, takes precedence over this.
bool rules_apply_now();
// The level's rule set for a call now, after the no_grad gate (kNone when gated off).
RuleSet level_decision_rules();

}  // namespace amp::detail
