#pragma once
// A CUDA graph capture simulated on the CPU: while one of these lives, the capture query
// (ops/stream_capture.h) reports capture `id` for every device. What asks (the loss scaler, the
// cast cache) behaves the same for any device; the CUDA query only answers the question.
#include <atomic>
#include <cstdint>

#include "ops/stream_capture.h"

namespace amp::testing {

class SimulatedCapture {
 public:
  explicit SimulatedCapture(std::uint64_t id = 1)
      : previous_id_(current().exchange(id)),
        previous_query_(ops::detail::set_capture_query(&query)) {}
  ~SimulatedCapture() {
    ops::detail::set_capture_query(previous_query_);
    current().store(previous_id_);
  }
  SimulatedCapture(const SimulatedCapture&) = delete;
  SimulatedCapture& operator=(const SimulatedCapture&) = delete;

 private:
  static std::atomic<std::uint64_t>& current() {
    static std::atomic<std::uint64_t> id{0};
    return id;
  }
  static std::uint64_t query(const c10::Device&) { return current().load(); }

  std::uint64_t previous_id_;
  ops::detail::CaptureQuery previous_query_;
};

}  // namespace amp::testing
