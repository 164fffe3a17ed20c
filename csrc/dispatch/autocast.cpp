// amp::autocast, amp::disable_casts and the thread-state carrier.
#include "optamp/autocast.h"

#include <c10/util/Exception.h>

#include "dispatch/cast_state.h"
#include "dispatch/registration.h"
#include "dispatch/substitution.h"
#include "optamp/cast_cache.h"
#include "optamp/opt_level.h"

namespace amp {

using detail::thread_cast_state;

autocast::autocast(bool enabled, c10::ScalarType dtype)
    : prev_key_on_(detail::thread_key_on()),
      prev_mode_(thread_cast_state().mode),
      prev_dtype_(thread_cast_state().region_dtype) {
  TORCH_CHECK_VALUE(dtype == c10::ScalarType::Undefined || dtype == c10::ScalarType::Half ||
                        dtype == c10::ScalarType::BFloat16,
                    "amp::autocast dtype must be torch.float16 or torch.bfloat16, got ",
                    dtype_name(dtype));
  auto& state = thread_cast_state();
  if (enabled) {
    detail::activate_thread(true);  // may throw (key conflict): nothing changed yet
    const c10::ScalarType level = detail::level_low_dtype();
    state.region_dtype = dtype != c10::ScalarType::Undefined   ? dtype
                         : level != c10::ScalarType::Undefined ? level
                                                               : c10::ScalarType::Half;
    state.mode = detail::kRegion;
  } else {
    state.mode = detail::kDisabled;
  }
  ++state.region_depth;
}

autocast::~autocast() {
  auto& state = thread_cast_state();
  state.mode = prev_mode_;
  state.region_dtype = prev_dtype_;
  detail::set_thread_key(prev_key_on_);
  // Weights may be updated after the region (and not through their version counter).
  if (--state.region_depth == 0) clear_cache();
}

disable_casts::disable_casts() : prev_mode_(thread_cast_state().mode) {
  thread_cast_state().mode = detail::kDisabled;
}

disable_casts::~disable_casts() { thread_cast_state().mode = prev_mode_; }

ThreadState ThreadState::capture() {
  const auto& state = thread_cast_state();
  return ThreadState{detail::thread_key_on(), detail::substitution_thread_on(), state.mode,
                     state.region_dtype};
}

namespace {

void apply(const ThreadState& state) {
  if (state.key_on)
    detail::activate_thread(true);  // may throw (key conflict) before anything changed
  else
    detail::set_thread_key(false);
  detail::activate_substitution_thread(state.substitution_on);
  thread_cast_state().mode = state.mode;
  thread_cast_state().region_dtype = state.dtype;
}

}  // namespace

ThreadStateGuard::ThreadStateGuard(const ThreadState& state) : previous_(ThreadState::capture()) {
  apply(state);
}

ThreadStateGuard::~ThreadStateGuard() {
  detail::set_thread_key(previous_.key_on);
  detail::activate_substitution_thread(previous_.substitution_on);
  thread_cast_state().mode = previous_.mode;
  thread_cast_state().region_dtype = previous_.dtype;
}

bool is_casting_enabled() { return detail::thread_key_on(); }

}  // namespace amp
