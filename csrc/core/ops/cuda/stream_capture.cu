// The CUDA half of ops/stream_capture.h: cudaStreamGetCaptureInfo on the device's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "ops/stream_capture.h"

namespace amp::ops::detail {
namespace {

std::uint64_t cuda_stream_capture_id(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;  // NOLINT(google-runtime-int): the CUDA API's type
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(
      c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index() : -1).stream(), &status,
      &id));
  // An invalidated capture (a refused call broke it) is still one: the cache must not serve it
  // eager tensors either. CUDA's ids start at 1; never report 0 for a capture.
  if (status == cudaStreamCaptureStatusNone) return 0;
  return id != 0 ? static_cast<std::uint64_t>(id) : ~std::uint64_t{0};
}

const bool installed = (set_capture_query(&cuda_stream_capture_id), true);

}  // namespace
}  // namespace amp::ops::detail
