// The capture query's slot (ops/stream_capture.h); the CUDA build fills it at load time.
#include "ops/stream_capture.h"

#include <atomic>

namespace amp::ops {
namespace {

std::atomic<detail::CaptureQuery> query{nullptr};

}  // namespace

std::uint64_t stream_capture_id(const c10::Device& device) {
  const detail::CaptureQuery q = query.load(std::memory_order_acquire);
  return q != nullptr ? q(device) : 0;
}

detail::CaptureQuery detail::set_capture_query(CaptureQuery q) {
  return query.exchange(q, std::memory_order_acq_rel);
}

}  // namespace amp::ops
