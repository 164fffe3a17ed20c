#pragma once
// Internal: whether the current stream of a device is being captured into a CUDA graph, and which
// capture. A step under capture must not wait for the device, query events or allocate pinned
// memory (CUDA refuses all three while capturing): the loss scaler asks here. A tensor made
// outside a capture is baked into the graph by address, and one made inside holds nothing until
// the first replay: the cast cache serves a copy only in the capture it was made in (0: none).
// The CUDA build installs the query (ops/cuda/stream_capture.cu); elsewhere nothing is ever
// captured.

#include <c10/core/Device.h>

#include <cstdint>

namespace amp::ops {

// The id of the capture the device's current stream takes part in; 0 when it is not capturing.
std::uint64_t stream_capture_id(const c10::Device& device);
inline bool stream_is_capturing(const c10::Device& device) {
  return stream_capture_id(device) != 0;
}

namespace detail {
using CaptureQuery = std::uint64_t (*)(const c10::Device& device);
// Installs `query` (nullptr: nothing is captured); returns the one it replaces.
CaptureQuery set_capture_query(CaptureQuery query);
}  // namespace detail

}  // namespace amp::ops
