#pragma once
// Per-thread control of optamp's casting.
//
// Casting rules apply on threads where optamp is on (amp::initialize turns it on for the calling
// thread) while autograd records (GradMode on), or inside an explicit amp::autocast region. So
// optimizer steps, EMA updates and validation under no_grad run in the dtypes they are given.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <thread>

#include "optamp/export.h"

namespace amp {

// RAII: an explicit casting region on this thread, also under no_grad (reduced-precision
// inference). `dtype` Undefined = the initialized level's low dtype, or float16 if none.
// enabled=false: rules off inside the region (like disable_casts). Nestable.
// The outermost exit drops the cast cache (weights may change after the region).
//
// Guards may end in any order (two coroutines on one thread interleaving their regions): each
// end removes only its own region, warns when newer ones are still open, and the thread then
// follows the guards still open. A guard ended on another thread closes its region on its own
// thread at that thread's next op. amp::reset() and amp::initialize() end every open region of
// every thread.
class OPTAMP_API autocast {  // NOLINT(readability-identifier-naming): mirrors torch.autocast
 public:
  explicit autocast(bool enabled = true, c10::ScalarType dtype = c10::ScalarType::Undefined);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  std::uint64_t frame_;
  std::thread::id owner_;
};

// RAII: no casting rules on this thread inside the scope (Apex's amp.disable_casts()). Ends like
// autocast does (any order, any thread).
class OPTAMP_API
    disable_casts {  // NOLINT(readability-identifier-naming): mirrors apex.amp.disable_casts
 public:
  disable_casts();
  ~disable_casts();
  disable_casts(const disable_casts&) = delete;
  disable_casts& operator=(const disable_casts&) = delete;

 private:
  std::uint64_t frame_;
  std::thread::id owner_;
};

// RAII: the initialized level's rules apply on this thread also under no_grad / inference mode
// inside the scope (as Apex's and torch.amp's always do). For a forward that runs under no_grad
// but must match a later recompute with grad on: the reentrant checkpoint (optamp wraps
// torch.utils.checkpoint for Python itself), or a hand-written torch::autograd::Function. A
// region or disable_casts in effect stays in effect. Ends like autocast does.
// (Options::rules_under_no_grad does the same process-wide; docs/casting.md, "The no_grad gate".)
class OPTAMP_API
    lift_no_grad_gate {  // NOLINT(readability-identifier-naming): a guard, like autocast
 public:
  lift_no_grad_gate();
  ~lift_no_grad_gate();
  lift_no_grad_gate(const lift_no_grad_gate&) = delete;
  lift_no_grad_gate& operator=(const lift_no_grad_gate&) = delete;

 private:
  std::uint64_t frame_;
  std::thread::id owner_;
};
// The guard's old name, which was also the name of the process-wide option.
using rules_under_no_grad [[deprecated("renamed amp::lift_no_grad_gate")]] = lift_no_grad_gate;

// optamp's per-thread state lives in the dispatcher's thread-local state, so whatever carries
// at::ThreadLocalState (the autograd engine's device threads, at::launch, torch.jit.fork,
// at::ThreadLocalStateGuard) carries it too. For threads you start yourself:
//   auto state = amp::ThreadState::capture();           // on the thread that initialized
//   std::thread t([state] { amp::thread_state_guard g(state); /* ops follow the rules */ });
// (equivalent to capturing and restoring at::ThreadLocalState; this carries only optamp's part.)
struct OPTAMP_API ThreadState {
  bool key_on = false;
  bool substitution_on = false;  // O2/O5: ops see model tensors as their working copies
  std::int32_t mode = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  static ThreadState capture();
};

// A guard, named like the others (and like Python's optamp.thread_state_guard).
class OPTAMP_API
    thread_state_guard {  // NOLINT(readability-identifier-naming): a guard, like autocast
 public:
  explicit thread_state_guard(const ThreadState& state);
  ~thread_state_guard();
  thread_state_guard(const thread_state_guard&) = delete;
  thread_state_guard& operator=(const thread_state_guard&) = delete;

 private:
  std::uint64_t frame_;
  std::thread::id owner_;
};
using ThreadStateGuard [[deprecated("renamed amp::thread_state_guard")]] = thread_state_guard;

// True when optamp's rules apply to ops on this thread now: it was initialized (O1-O5) or is in
// an amp::autocast region, no disable_casts / autocast(false) is innermost, and grad mode is on
// (or the region or O3 casts under no_grad too). Native torch.autocast, where it is on, takes
// precedence over optamp and is not reported here.
OPTAMP_API bool is_casting_enabled();

}  // namespace amp
