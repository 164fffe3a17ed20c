// StepStatusQueue: queued device->host copies of loss-scaler step results (see step_status.h).
#include "scaler/step_status.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace amp::detail {

void StepStatusQueue::push(const at::Tensor& status, bool wait_now) {
  Entry entry;
  const c10::Device device = status.device();
  if (device.is_cpu()) {
    entry.host = status;  // already host memory; nothing to wait for
  } else if (device.is_cuda() && !wait_now) {
    // Pinned memory makes the copy truly asynchronous; the event says when it has landed.
    entry.source = status;
    entry.host = at::empty({2}, at::TensorOptions(at::kFloat).pinned_memory(true));
    entry.host.copy_(status, /*non_blocking=*/true);
    c10::Event copied(device.type());
    copied.record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
    entry.copied.emplace(std::move(copied));
  } else {
    entry.host = status.to(at::kCPU);  // a waiting copy (or a backend without events)
  }
  entries_.push_back(std::move(entry));
}

std::optional<StepStatus> StepStatusQueue::pop(bool wait) {
  if (entries_.empty()) return std::nullopt;
  Entry& front = entries_.front();
  if (front.copied && !front.copied->query()) {
    if (!wait) return std::nullopt;
    front.host = front.source.to(at::kCPU);  // the wait: one blocking device->host copy
  }
  const float* values = front.host.const_data_ptr<float>();
  const StepStatus status{values[0], values[1]};
  entries_.pop_front();
  return status;
}

}  // namespace amp::detail
