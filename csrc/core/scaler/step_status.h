#pragma once
// Internal: the results of loss-scaler steps on their way from the device to the host.
//
// A step's result (overflow flag and new scale, computed on the scale's device) is needed on the
// host only for the counters, the log line and the host-side skip. Reading it at once costs a
// device->host synchronization per step, which is what keeps a GPU step host-bound. So each step
// queues its result: a non-blocking copy into pinned host memory plus an event recorded after
// it. Later steps take what has arrived without waiting (pop(false)); a caller that needs a value
// now waits for it (pop(true)). Every wait is a plain blocking device->host copy, the kind of sync
// torch.cuda.set_sync_debug_mode reports, so a step's syncs stay countable.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <deque>
#include <optional>

namespace amp::detail {

struct StepStatus {
  float found_inf;  // > 0: the step overflowed
  float scale;      // the scale after the step's update
};

class StepStatusQueue {
 public:
  // Starts moving `status` (float32 [found_inf, scale], on any device) to the host: without
  // waiting, or (wait_now) with the blocking copy a caller about to read it would make anyway.
  void push(const at::Tensor& status, bool wait_now);
  // The oldest queued status: only once its copy has arrived when `wait` is false (nullopt
  // otherwise), else waiting for it. nullopt when the queue is empty.
  std::optional<StepStatus> pop(bool wait);
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    at::Tensor source;                 // the device tensor, for a waiting read
    at::Tensor host;                   // CPU float32 [2] (pinned when copied asynchronously)
    std::optional<c10::Event> copied;  // recorded after the copy; none: the values are there
  };
  std::deque<Entry> entries_;
};

}  // namespace amp::detail
