// CUDA kernels of the optamp multi-tensor ops.
//
// A chunked multi-tensor launcher (as Apex's multi_tensor_apply): the host-side plan
// (ops/launch_plan.h) cuts the tensors of a call into chunks and groups them into launches; each
// launch gets its part of the plan as a by-value kernel argument (< 4 KiB). Each block does one
// chunk; aligned chunks use 16-byte vector loads/stores. The per-element math is shared with the
// CPU kernels (ops/unscale_math.h). Launches go to the current stream and are checked.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

#include "ops/launch_plan.h"
#include "ops/multi_tensor.h"
#include "ops/register_kernels.h"
#include "ops/unscale_math.h"
#include "ops/update_scale_math.h"

namespace amp::ops::detail {
namespace {

constexpr int kThreads = 512;

// The kernel argument of one launch: the plan's block map plus each slot's addresses and size.
template <int Depth>
struct TensorListMeta {
  void* addresses[Depth][kLaunchMaxTensors];
  int64_t sizes[kLaunchMaxTensors];
  LaunchBlocks blocks;
};
static_assert(sizeof(TensorListMeta<3>) < 4096, "kernel argument too large");

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Calls launch(meta, blocks) for every launch of the plan (launch_plan.h) of `lists` (Depth
// lists of the same length; the plan follows the first).
template <int Depth, typename LaunchFn>
void multi_tensor_apply(const std::vector<at::Tensor>* const (&lists)[Depth], LaunchFn&& launch) {
  std::vector<int64_t> numels;
  numels.reserve(lists[0]->size());
  for (const auto& t : *lists[0]) numels.push_back(t.numel());
  for (const auto& plan : plan_launches(numels)) {
    TensorListMeta<Depth> meta;
    for (int slot = 0; slot < plan.num_tensors; ++slot) {
      const int64_t t = plan.list_index[slot];
      for (int d = 0; d < Depth; ++d) meta.addresses[d][slot] = (*lists[d])[t].data_ptr();
      meta.sizes[slot] = numels[t];
    }
    meta.blocks = plan.blocks;
    launch(meta, plan.num_blocks);
  }
}

template <typename T>
__global__ void unscale_kernel(TensorListMeta<1> meta, float* found_inf, const float* inv_scale) {
  const int t = meta.blocks.tensor[blockIdx.x];
  const auto [begin, n] = chunk_range(meta.sizes[t], meta.blocks.chunk[blockIdx.x]);
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
  const int t = meta.blocks.tensor[blockIdx.x];
  const auto [begin, n] = chunk_range(meta.sizes[t], meta.blocks.chunk[blockIdx.x]);
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
