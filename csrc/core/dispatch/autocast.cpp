// amp::autocast, amp::disable_casts and the thread-state carrier: each opens a frame on its
// thread (dispatch/thread_frames.h), and the thread's mode follows the frames still open.
#include "optamp/autocast.h"
#include "optamp/policy.h"

#include <c10/util/Exception.h>

#include "cache/cast_cache.h"
#include "dispatch/cast_decision.h"
#include "dispatch/registration.h"
#include "dispatch/substitution.h"
#include "dispatch/thread_frames.h"
#include "optamp/cast_cache.h"
#include "optamp/opt_level.h"

namespace amp {
namespace {

using detail::CastFrame;

// Ends frame `id` opened by `owner`: on its own thread now (warning when newer frames are still
// open), from another thread at the owner's next op. Never throws (called by destructors).
void end_frame(std::uint64_t id, std::thread::id owner, const char* what) noexcept {
  try {
    if (owner != std::this_thread::get_id()) {
      detail::abandon_frame(id);
      return;
    }
    const int depth_before = detail::thread_cast_state().region_depth;
    bool out_of_order = false;
    if (!detail::pop_frame(id, &out_of_order)) return;  // a reset ended it already
    if (out_of_order) {
      TORCH_WARN(what,
                 " ended while guards entered after it on this thread were still open (e.g. two "
                 "asyncio tasks interleaving their `with` blocks); optamp ended only this one "
                 "and the thread follows the guards still open");
    }
    // Weights may be updated after the outermost region (and not through their version counter).
    if (depth_before > 0 && detail::thread_cast_state().region_depth == 0) {
      detail::invalidate_cache();
    }
  } catch (...) {
  }
}

}  // namespace

autocast::autocast(bool enabled, c10::ScalarType dtype) : owner_(std::this_thread::get_id()) {
  // A disabled region casts to nothing, so its dtype is not looked at (torch.autocast accepts
  // `dtype=torch.float32, enabled=False` too: code passes the same arguments either way).
  TORCH_CHECK_VALUE(!enabled || dtype == c10::ScalarType::Undefined ||
                        dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16,
                    "amp::autocast dtype must be torch.float16 or torch.bfloat16, got ",
                    dtype_name(dtype));
  CastFrame frame;
  frame.is_autocast = true;
  if (enabled) {
    detail::ensure_registered();  // may throw (key conflict): nothing changed yet
    const c10::ScalarType level = detail::level_low_dtype();
    frame.mode = detail::kRegion;
    frame.dtype = dtype != c10::ScalarType::Undefined   ? dtype
                  : level != c10::ScalarType::Undefined ? level
                                                        : c10::ScalarType::Half;
    frame.sets_key = true;
    frame.key_on = true;
  } else {
    frame.mode = detail::kDisabled;
  }
  frame_ = detail::push_frame(frame);
}

autocast::~autocast() { end_frame(frame_, owner_, "amp::autocast"); }

disable_casts::disable_casts() : owner_(std::this_thread::get_id()) {
  CastFrame frame;
  frame.mode = detail::kDisabled;
  frame_ = detail::push_frame(frame);
}

disable_casts::~disable_casts() { end_frame(frame_, owner_, "amp::disable_casts"); }

ThreadState ThreadState::capture() {
  detail::thread_cast_state();
  const detail::CarriedMode carried = detail::carried_mode();
  return ThreadState{detail::thread_key_on(), detail::substitution_thread_on(), carried.mode,
                     carried.dtype};
}

lift_no_grad_gate::lift_no_grad_gate() : owner_(std::this_thread::get_id()) {
  CastFrame frame;
  frame.ungate = true;
  frame_ = detail::push_frame(frame);
}

lift_no_grad_gate::~lift_no_grad_gate() { end_frame(frame_, owner_, "amp::lift_no_grad_gate"); }

thread_state_guard::thread_state_guard(const ThreadState& state)
    : owner_(std::this_thread::get_id()) {
  if (state.key_on) detail::ensure_registered();  // may throw before anything changed
  CastFrame frame;
  frame.mode = state.mode;
  frame.dtype = state.dtype;
  frame.sets_key = true;
  frame.key_on = state.key_on;
  frame.sets_substitution = true;
  frame.substitution_on = state.substitution_on;
  frame_ = detail::push_frame(frame);
}

thread_state_guard::~thread_state_guard() { end_frame(frame_, owner_, "amp::thread_state_guard"); }

bool is_casting_enabled() { return detail::rules_apply_now(); }

}  // namespace amp
