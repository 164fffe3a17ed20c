#pragma once
// Internal: whether the current stream of a device is being captured into a CUDA graph. A step
// under capture must not wait for the device, query events or allocate pinned memory (CUDA
// refuses all three while capturing); the loss scaler asks here. The CUDA build installs the query
// (ops/cuda/stream_capture.cu); elsewhere nothing is ever captured.

#include <c10/core/Device.h>

namespace amp::ops {

bool stream_is_capturing(const c10::Device& device);

namespace detail {
using CaptureQuery = bool (*)(const c10::Device& device);
// Installs `query` (nullptr: nothing is captured); returns the one it replaces.
CaptureQuery set_capture_query(CaptureQuery query);
}  // namespace detail

}  // namespace amp::ops
