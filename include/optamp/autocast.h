#pragma once
// Per-thread control of optamp's casting.
//
// Casting rules apply on threads where optamp is on (amp::initialize turns it on for the calling
// thread) while autograd records (GradMode on), or inside an explicit amp::autocast region. So
// optimizer steps, EMA updates and validation under no_grad run in the dtypes they are given.

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace amp {

// RAII: an explicit casting region on this thread, also under no_grad (reduced-precision
// inference). `dtype` Undefined = the initialized level's low dtype, or float16 if none.
// enabled=false: rules off inside the region (like disable_casts). Nestable.
// The outermost exit drops the cast cache (weights may change after the region).
class autocast {  // NOLINT(readability-identifier-naming): mirrors torch.autocast
 public:
  explicit autocast(bool enabled = true, c10::ScalarType dtype = c10::ScalarType::Undefined);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  bool prev_key_on_;
  std::int32_t prev_mode_;
  c10::ScalarType prev_dtype_;
};

// RAII: no casting rules on this thread inside the scope (Apex's amp.disable_casts()).
class disable_casts {  // NOLINT(readability-identifier-naming): mirrors apex.amp.disable_casts
 public:
  disable_casts();
  ~disable_casts();
  disable_casts(const disable_casts&) = delete;
  disable_casts& operator=(const disable_casts&) = delete;

 private:
  std::int32_t prev_mode_;
};

// Carrying optamp's per-thread state into worker threads:
//   auto state = amp::ThreadState::capture();           // on the thread that initialized
//   std::thread t([state] { amp::ThreadStateGuard g(state); /* ops here follow the rules */ });
// (at::ThreadLocalStateGuard carries the dispatch-key part but not optamp's region state.)
struct ThreadState {
  bool key_on = false;
  bool substitution_on = false;  // O2/O5: ops see model tensors as their working copies
  std::int32_t mode = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  static ThreadState capture();
};

class ThreadStateGuard {
 public:
  explicit ThreadStateGuard(const ThreadState& state);
  ~ThreadStateGuard();
  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;

 private:
  ThreadState previous_;
};

// True when optamp's casting is on for this thread (initialized, or inside amp::autocast).
bool is_casting_enabled();

}  // namespace amp
