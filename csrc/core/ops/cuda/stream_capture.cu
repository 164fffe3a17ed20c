// The CUDA half of ops/stream_capture.h: cudaStreamIsCapturing on the device's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "ops/stream_capture.h"

namespace amp::ops::detail {
namespace {

bool cuda_stream_is_capturing(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index() : -1).stream(),
      &status));
  return status != cudaStreamCaptureStatusNone;
}

const bool installed = (set_capture_query(&cuda_stream_is_capturing), true);

}  // namespace
}  // namespace amp::ops::detail
