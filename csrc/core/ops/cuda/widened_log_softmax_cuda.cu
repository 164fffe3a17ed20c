// CUDA kernels of optamp::widened_log_softmax and its backward (ops/widened_log_softmax.h): one
// block per row of a contiguous [rows, cols] tensor, the class dimension last. Each kernel makes
// two passes over a row: a reduction (the forward's log-sum-exp, the backward's sum of gradients)
// that loads 16 bytes per load where the row allows (RowPacks in ops/log_softmax_math.h says which
// lane takes which element; tests/cpp/test_fused_casts.cpp's LogSoftmaxMath test merges a row's
// parts in that order), then the elementwise pass, thread t taking elements t, t + blockDim.x, ...
// so that the stores coalesce (the fp32 result's rows start where the reduced input's do not, so
// one pack per thread would scatter them). The forward reads the reduced row twice (a GPT-2 row,
// 100 KB, is mostly still in L2 the second time) and writes fp32; the backward reads the gradient
// twice and the result once and writes the reduced gradient. The row math is
// ops/log_softmax_math.h's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "ops/log_softmax_math.h"
#include "ops/widened_log_softmax.h"

namespace amp::ops::detail {
namespace {

// Two blocks of at most 512 threads share an SM (kBlocksPerSm), so one block's loads run while the
// other waits at its reduction's barriers: with 1024-thread blocks (45-56 registers a thread, so
// one block an SM) the SM's loads stopped at every row's reduction.
constexpr int kMaxThreads = 512;
constexpr int kBlocksPerSm = 2;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ float shuffle_xor(float v, int offset) { return __shfl_xor_sync(kFullMask, v, offset); }
__device__ RowLogSumExp shuffle_xor(RowLogSumExp v, int offset) {
  return {shuffle_xor(v.max, offset), shuffle_xor(v.sum, offset)};
}
__device__ void merge_into(float& into, float part) { into += part; }
__device__ void merge_into(RowLogSumExp& into, const RowLogSumExp& part) { into.merge(part); }
__device__ float empty_like_part(float) { return 0.0f; }
__device__ RowLogSumExp empty_like_part(const RowLogSumExp&) { return RowLogSumExp::empty(); }

// Every thread's part merged, returned to every thread. `shared` holds one part per warp.
// blockDim.x is a multiple of the warp size, at most kMaxThreads.
template <typename Part>
__device__ Part block_merge(Part part, Part* shared) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) merge_into(part, shuffle_xor(part, offset));
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) shared[warp] = part;
  __syncthreads();
  if (warp == 0) {
    part = lane < static_cast<int>(blockDim.x / kWarp) ? shared[lane] : empty_like_part(part);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      merge_into(part, shuffle_xor(part, offset));
    }
    if (lane == 0) shared[0] = part;
  }
  __syncthreads();
  return shared[0];
}

// Calls use(i, load(i)) for the elements i = threadIdx.x + k * blockDim.x of a row of `cols`, in
// ascending order, issuing kIlp loads before using any: one 2-byte load at a time per thread
// would leave too few bytes in flight to keep the memory busy.
constexpr int kIlp = 8;

template <typename Load, typename Use>
__device__ void for_each_of_thread(int64_t cols, Load load, Use use) {
  using Value = decltype(load(int64_t{0}));
  const int64_t threads = blockDim.x;
  for (int64_t base = threadIdx.x; base < cols; base += threads * kIlp) {
    Value values[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      if (base + k * threads < cols) values[k] = load(base + k * threads);
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      if (base + k * threads < cols) use(base + k * threads, values[k]);
    }
  }
}

// Calls use(value) for the elements of `row` (`cols` of them) that RowPacks gives this thread, in
// ascending order, loading kPacksInFlight 16-byte packs before using any. Measured on an H200
// (GPT-2's 4096 x 50257 bf16 logits): with 2-byte loads (for_each_of_thread) the forward took 0.86
// ms per step where torch's own fp16-to-fp32 kernel, whose reductions load 16 bytes at a time,
// takes 0.51 ms.
constexpr int kPacksInFlight = 4;

template <typename scalar_t, typename Use>
__device__ void for_each_packed(const scalar_t* row, int64_t cols, Use use) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  struct alignas(16) Pack {
    scalar_t v[kVec];
  };
  const int64_t shift = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16) /
                        static_cast<int64_t>(sizeof(scalar_t));
  const RowPacks split(cols, shift, kVec);
  const int64_t threads = blockDim.x;
  if (threadIdx.x < split.head) use(static_cast<float>(row[threadIdx.x]));
  const Pack* packs = reinterpret_cast<const Pack*>(row + split.head);
  for (int64_t base = threadIdx.x; base < split.packs; base += threads * kPacksInFlight) {
    Pack loaded[kPacksInFlight];
#pragma unroll
    for (int k = 0; k < kPacksInFlight; ++k) {
      if (base + k * threads < split.packs) loaded[k] = packs[base + k * threads];
    }
#pragma unroll
    for (int k = 0; k < kPacksInFlight; ++k) {
      if (base + k * threads < split.packs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) use(static_cast<float>(loaded[k].v[j]));
      }
    }
  }
  if (split.tail_start + threadIdx.x < cols) {
    use(static_cast<float>(row[split.tail_start + threadIdx.x]));
  }
}

// __launch_bounds__: kBlocksPerSm blocks of kMaxThreads must fit an SM's registers (64 a thread).
template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)
    widened_log_softmax_kernel(const scalar_t* __restrict__ input, float* __restrict__ output,
                               int64_t cols) {
  __shared__ RowLogSumExp parts[kMaxThreads / kWarp];
  const scalar_t* x = input + static_cast<int64_t>(blockIdx.x) * cols;
  float* y = output + static_cast<int64_t>(blockIdx.x) * cols;
  const auto load = [x](int64_t i) { return static_cast<float>(x[i]); };
  RowLogSumExp part = RowLogSumExp::empty();
  for_each_packed(x, cols, [&part](float v) { part.add(v); });
  const RowLogSumExp row = block_merge(part, parts);
  const float log_sum = ::logf(row.sum);
  for_each_of_thread(cols, load, [y, &row, log_sum](int64_t i, float v) {
    y[i] = log_softmax_math(v, row.max, log_sum);
  });
}

struct GradAndResult {
  float grad, out;
};

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)
    widened_log_softmax_backward_kernel(const float* __restrict__ grad,
                                        const float* __restrict__ output,
                                        scalar_t* __restrict__ grad_input, int64_t cols) {
  __shared__ float parts[kMaxThreads / kWarp];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * cols;
  const float* g = grad + offset;
  const float* out = output + offset;
  scalar_t* gi = grad_input + offset;
  float part = 0.0f;
  for_each_packed(g, cols, [&part](float v) { part += v; });
  const float grad_sum = block_merge(part, parts);
  for_each_of_thread(
      cols,
      [g, out](int64_t i) {
        return GradAndResult{g[i], out[i]};
      },
      [gi, grad_sum](int64_t i, GradAndResult v) {
        gi[i] = static_cast<scalar_t>(log_softmax_backward_math(v.grad, v.out, grad_sum));
      });
}

// A block per row of `rows`, a multiple of the warp size threads, no more than the row needs.
struct RowLaunch {
  int64_t rows, cols;
  int threads;
};

RowLaunch row_launch(amp::detail::SoftmaxRows rows) {
  TORCH_CHECK_VALUE(rows.rows <= std::numeric_limits<int>::max(), "widened_log_softmax: at most ",
                    std::numeric_limits<int>::max(), " rows, got ", rows.rows);
  const int64_t threads = std::min<int64_t>(kMaxThreads, (rows.cols + kWarp - 1) / kWarp * kWarp);
  return {rows.rows, rows.cols, static_cast<int>(std::max<int64_t>(threads, kWarp))};
}

at::Tensor widened_log_softmax_cuda(const at::Tensor& self, int64_t dim) {
  const RowLaunch launch = row_launch(amp::detail::checked_forward_rows(self, dim));
  const c10::cuda::CUDAGuard device_guard(self.device());  // launches go to the current device
  const at::Tensor input = self.contiguous();
  at::Tensor output = at::empty(input.sizes(), input.options().dtype(at::kFloat));
  if (launch.rows == 0) return output;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "widened_log_softmax", [&] {
    widened_log_softmax_kernel<scalar_t><<<launch.rows, launch.threads, 0, stream>>>(
        input.const_data_ptr<scalar_t>(), output.mutable_data_ptr<float>(), launch.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return output;
}

at::Tensor widened_log_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output,
                                             int64_t dim, at::ScalarType input_dtype) {
  const RowLaunch launch =
      row_launch(amp::detail::checked_backward_rows(grad, output, dim, input_dtype));
  const c10::cuda::CUDAGuard device_guard(output.device());
  const at::Tensor g = grad.contiguous();
  const at::Tensor out = output.contiguous();
  at::Tensor grad_input = at::empty(out.sizes(), out.options().dtype(input_dtype));
  if (launch.rows == 0) return grad_input;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input_dtype, "widened_log_softmax_backward", [&] {
    widened_log_softmax_backward_kernel<scalar_t><<<launch.rows, launch.threads, 0, stream>>>(
        g.const_data_ptr<float>(), out.const_data_ptr<float>(),
        grad_input.mutable_data_ptr<scalar_t>(), launch.cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace
}  // namespace amp::ops::detail

TORCH_LIBRARY_IMPL(optamp, CUDA, m) {
  m.impl("widened_log_softmax", &amp::ops::detail::widened_log_softmax_cuda);
  m.impl("widened_log_softmax_backward", &amp::ops::detail::widened_log_softmax_backward_cuda);
}
