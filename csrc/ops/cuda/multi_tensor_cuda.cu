// CUDA kernels of the optamp multi-tensor ops.
//
// A chunked multi-tensor launcher (as Apex's multi_tensor_apply): the tensors of a call are cut
// into chunks of kChunk elements, and one launch handles up to kMaxTensors tensors / kMaxBlocks
// chunks, described by a by-value kernel argument (< 4 KiB). Each block does one chunk; aligned
// chunks use 16-byte vector loads/stores. The per-element math is shared with the CPU kernels
// (ops/unscale_math.h). Launches go to the current stream and are checked.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

#include "ops/multi_tensor.h"
#include "ops/register_kernels.h"
#include "ops/unscale_math.h"
#include "ops/update_scale_math.h"

namespace amp::ops::detail {
namespace {

constexpr int kMaxTensors = 48;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;

template <int Depth>
struct TensorListMeta {
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta<3>) < 4096, "kernel argument too large");

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Fills the metadata for `lists` (Depth lists of the same length) and calls launch(meta, blocks)
// whenever it is full, and once at the end.
template <int Depth, typename Launch>
void multi_tensor_apply(const std::vector<at::Tensor>* const (&lists)[Depth], Launch&& launch) {
  TensorListMeta<Depth> meta;
  int loc_tensor = 0;
  int loc_block = 0;
  const size_t count = lists[0]->size();
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = (*lists[0])[t].numel();
    if (n == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][loc_tensor] = (*lists[d])[t].data_ptr();
    meta.sizes[loc_tensor] = n;
    ++loc_tensor;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[loc_block] = static_cast<unsigned char>(loc_tensor - 1);
      meta.block_to_chunk[loc_block] = static_cast<int>(c);
      ++loc_block;
      const bool last_chunk = c == chunks - 1;
      if (loc_block == kMaxBlocks || (loc_tensor == kMaxTensors && last_chunk)) {
        launch(meta, loc_block);
        loc_block = 0;
        if (last_chunk) {
          loc_tensor = 0;
        } else {  // carry the unfinished tensor over as tensor 0
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][loc_tensor - 1];
          meta.sizes[0] = meta.sizes[loc_tensor - 1];
          loc_tensor = 1;
        }
      }
    }
  }
  if (loc_block > 0) launch(meta, loc_block);
}

template <typename T>
__global__ void unscale_kernel(TensorListMeta<1> meta, float* found_inf, const float* inv_scale) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t n = min(meta.sizes[t] - begin, kChunk);
  T* p = static_cast<T*>(meta.addresses[0][t]) + begin;
  const float s = *inv_scale;
  const bool check_only = unscale_is_check(s);
  bool bad = false;
  constexpr int V = 16 / sizeof(T);
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    const int64_t nv = n / V;
    auto* pv = reinterpret_cast<Vec<T, V>*>(p);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      Vec<T, V> x = pv[i];
      if (check_only) {
#pragma unroll
        for (int k = 0; k < V; ++k) check_element(x.v[k], bad);
        continue;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) x.v[k] = unscale_element(x.v[k], s, bad);
      pv[i] = x;
    }
    done = nv * V;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    if (check_only) {
      check_element(p[i], bad);
    } else {
      p[i] = unscale_element(p[i], s, bad);
    }
  }
  if (bad) *found_inf = 1.0f;
}

template <typename T>
__global__ void axpby_kernel(TensorListMeta<3> meta, float* found_inf, const float* a_ptr,
                             float b) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t n = min(meta.sizes[t] - begin, kChunk);
  T* out = static_cast<T*>(meta.addresses[0][t]) + begin;
  const T* x = static_cast<const T*>(meta.addresses[1][t]) + begin;
  const T* y = static_cast<const T*>(meta.addresses[2][t]) + begin;
  const float a = *a_ptr;
  bool bad = false;
  constexpr int V = 16 / sizeof(T);
  int64_t done = 0;
  const bool aligned = (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(x) |
                        reinterpret_cast<uintptr_t>(y)) %
                           16 ==
                       0;
  if (aligned) {
    const int64_t nv = n / V;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      const Vec<T, V> xv = reinterpret_cast<const Vec<T, V>*>(x)[i];
      const Vec<T, V> yv = reinterpret_cast<const Vec<T, V>*>(y)[i];
      Vec<T, V> r;
#pragma unroll
      for (int k = 0; k < V; ++k) r.v[k] = axpby_element(xv.v[k], yv.v[k], a, b, bad);
      reinterpret_cast<Vec<T, V>*>(out)[i] = r;
    }
    done = nv * V;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    out[i] = axpby_element(x[i], y[i], a, b, bad);
  }
  if (bad) *found_inf = 1.0f;
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int64_t hysteresis, double min_scale,
                                    double max_scale) {
  update_scale_math(scale, growth_tracker, hysteresis_tracker, *found_inf, growth_factor,
                    backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

void unscale_group_cuda(const std::vector<at::Tensor>& tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  float* flag = found_inf.data_ptr<float>();
  const float* s = inv_scale.const_data_ptr<float>();
  const std::vector<at::Tensor>* const lists[1] = {&tensors};
  AT_DISPATCH_V2(tensors[0].scalar_type(), "optamp::unscale_check_", AT_WRAP([&] {
                   multi_tensor_apply<1>(lists, [&](const TensorListMeta<1>& meta, int blocks) {
                     unscale_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, flag, s);
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                   });
                 }),
                 OPTAMP_KERNEL_DTYPES);
}

void axpby_group_cuda(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& x,
                      const std::vector<at::Tensor>& y, const at::Tensor& a, float b,
                      const at::Tensor& found_inf) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  float* flag = found_inf.data_ptr<float>();
  const float* ap = a.const_data_ptr<float>();
  const std::vector<at::Tensor>* const lists[3] = {&out, &x, &y};
  AT_DISPATCH_V2(out[0].scalar_type(), "optamp::axpby_check_", AT_WRAP([&] {
                   multi_tensor_apply<3>(lists, [&](const TensorListMeta<3>& meta, int blocks) {
                     axpby_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, flag, ap, b);
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                   });
                 }),
                 OPTAMP_KERNEL_DTYPES);
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  update_scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(), growth_factor,
      backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace amp::ops::detail

TORCH_LIBRARY_IMPL(optamp, CUDA, m) {
  using namespace amp::ops::detail;
  register_multi_tensor_kernels<&unscale_group_cuda, &axpby_group_cuda, &update_scale_cuda>(m);
}
