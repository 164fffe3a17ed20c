// CUDA kernels of optamp::widened_log_softmax, optamp::widened_softmax, optamp::fused_cross_entropy
// and their backwards (ops/widened_softmax.h, ops/fused_cross_entropy.h): one block per row of a
// contiguous [rows, cols] tensor (a warp per row for short rows), the class dimension last, one
// template over the softmax kind. Each kernel makes two passes over a row: a reduction (the
// forward's log-sum-exp; the backward's sum of the gradient, or of the gradient times the result
// for softmax) that loads 16 bytes per load where the row allows (the log-sum-exp merges such a
// pack at once: RowLogSumExp::add_pack), then the elementwise pass, four elements per load and
// store (16 bytes of fp32, 8 of the reduced dtype; fused_cross_entropy's backward, which has no
// fp32 array, 16 bytes of the reduced dtype), split by the fp32 array's 16-byte boundaries: a row
// starts at different offsets into a 16-byte pack in its fp32 and its reduced array (GPT-2's 50257
// classes are odd), and the fp32 side moves twice the bytes. RowPacks (ops/softmax_math.h) says
// which lane takes which element; tests/cpp/test_fused_casts.cpp's SoftmaxMath tests merge a row's
// parts in that order. The forward reads the reduced row once where a block per row can keep it in
// shared memory (kept_row_bytes: a GPT-2 row, 100 KB, on an H100 or H200), else twice (mostly from
// L2 the second time), and writes fp32; the backward reads its fp32 rows twice (log_softmax's
// reduction reads the gradient alone) and writes the reduced gradient. The row math is
// ops/softmax_math.h's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "ops/fused_cross_entropy.h"
#include "ops/softmax_math.h"
#include "ops/widened_softmax.h"

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

// The 32 parts of a warp merged, returned to every lane (a butterfly: every lane ends with the
// same merge of all of them).
template <typename Part>
__device__ Part warp_merge(Part part) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) merge_into(part, shuffle_xor(part, offset));
  return part;
}

// A pack of N elements of T, loaded or stored with one instruction where its address allows.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A pack's bytes as one of CUDA's vector types, loaded with one instruction (__ldg: the stores
// written in PTX below keep nvcc from proving by itself that the inputs are read-only).
template <int kBytes>
struct RawPack;
template <>
struct RawPack<8> {
  using type = uint2;
};
template <>
struct RawPack<16> {
  using type = uint4;
};

__device__ bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// `aligned` is the same for every pack of a row (the block's), so the branch does not diverge.
template <typename T, int N>
__device__ Pack<T, N> load_pack(const T* p, bool aligned) {
  Pack<T, N> pack;
  if (aligned) {
    using Raw = typename RawPack<sizeof(pack)>::type;
    const Raw raw = __ldg(reinterpret_cast<const Raw*>(p));  // read-only: the .nc path
    memcpy(&pack, &raw, sizeof(pack));
    return pack;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) pack.v[j] = p[j];
  return pack;
}

// A pack of the row a block keeps in shared memory (__ldg reads global memory only).
template <typename T, int N>
__device__ Pack<T, N> load_kept(const T* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const Pack<T, N>*>(p);
  Pack<T, N> pack;
#pragma unroll
  for (int j = 0; j < N; ++j) pack.v[j] = p[j];
  return pack;
}

// Stores in one instruction, written in PTX: nvcc split a float4 or uint2 store into 4-byte stores
// when the address was a row's pointer plus a computed head (checked in the PTX of these kernels),
// and the stores are half of the elementwise passes' bytes. store_pack: a 16-byte pack (four fp32
// elements, or eight of a 2-byte type); store_quad: four elements of a 2-byte type (8 bytes).
template <typename T, int N>
__device__ void store_pack(T* p, const Pack<T, N>& pack, bool aligned) {
  static_assert(sizeof(pack) == 16, "a 16-byte pack");
  if (aligned) {
    uint4 raw;
    memcpy(&raw, &pack, sizeof(raw));
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(raw.x), "r"(raw.y),
                 "r"(raw.z), "r"(raw.w));
    return;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) p[j] = pack.v[j];
}

template <typename T>  // c10::Half, c10::BFloat16: their bits in `x`
__device__ void store_quad(T* p, const Pack<T, 4>& q, bool aligned) {
  static_assert(sizeof(T) == 2, "a 2-byte floating-point type");
  if (aligned) {
    const auto pair = [](T low, T high) { return low.x | (static_cast<uint32_t>(high.x) << 16); };
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(pair(q.v[0], q.v[1])),
                 "r"(pair(q.v[2], q.v[3])));
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = q.v[j];
}

// A 16-byte pack stored into a row kept in shared memory (at a 16-byte boundary), written in PTX:
// nvcc split half of these stores into narrower ones (2- and 4-byte stores, with bank conflicts,
// seen in the PTX). The clobber keeps it before the barrier after which other threads read it.
template <typename T, int N>
__device__ void store_kept_pack(T* p, const Pack<T, N>& pack) {
  static_assert(sizeof(pack) == 16, "a 16-byte pack");
  uint4 raw;
  memcpy(&raw, &pack, sizeof(raw));
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(raw.x), "r"(raw.y),
               "r"(raw.z), "r"(raw.w)
               : "memory");
}

// The row's element count in the pack that `p` starts in: RowPacks' shift for packs of `bytes`.
template <typename T>
__device__ int64_t shift_of(const T* p, size_t bytes) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % bytes / sizeof(T));
}

// The reductions: adds to `part` (a RowLogSumExp or RowSum) the elements of `row` that RowPacks
// gives this lane when it loads 16 bytes at a time, a pack's with add_pack (its exps independent
// of each other), and stores what it loads at keep[i] unless `keep` is null (a row
// kept in shared memory at the row's own offset into a 16-byte pack, so a pack stores as it
// loads). Measured on an H200 (GPT-2's 4096 x 50257 bf16 logits): with 2-byte loads the forward
// took 0.86 ms per step where torch's own fp16-to-fp32 kernel, whose reductions load 16 bytes at a
// time, takes 0.51 ms.
template <typename scalar_t, typename Part>
__device__ void for_each_of_row(const scalar_t* row, int64_t cols, Lanes lanes, scalar_t* keep,
                                Part& part) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  using RowPack = Pack<scalar_t, kVec>;
  const RowPacks split(cols, shift_of(row, 16), kVec);
  for_each_pack<kVec, 4>(
      split, cols, lanes,
      [row, keep, &part](int64_t i) {
        const scalar_t v = row[i];
        if (keep != nullptr) keep[i] = v;
        part.add(static_cast<float>(v));
      },
      [row](int64_t i) { return load_pack<scalar_t, kVec>(row + i, true); },
      [keep, &part](int64_t i, const RowPack& pack) {
        if (keep != nullptr) store_kept_pack(keep + i, pack);
        float values[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) values[j] = static_cast<float>(pack.v[j]);
        part.add_pack(values);
      });
}

// The elementwise passes take four elements at a time: 16 bytes of the fp32 arrays (their packs
// decide the split), 8 of the reduced one, whose four elements start on an 8-byte boundary
// wherever the fp32 ones start on a 16-byte one, unless a tensor starts at an odd offset into its
// storage (then its packs load and store element by element: `aligned` false).
constexpr int kQuad = 4;

using amp::detail::SoftmaxKind;
constexpr SoftmaxKind kLog = SoftmaxKind::kLogSoftmax;

// The forward's result of one element from its row's statistics: log_softmax from the maximum and
// log(sum) (one logarithm per row, as torch's kernels take it), softmax from the maximum and sum.
template <SoftmaxKind Kind>
struct RowResult {
  float max, stat;
  __device__ explicit RowResult(const RowLogSumExp& row)
      : max(row.max), stat(Kind == kLog ? ::logf(row.sum) : row.sum) {}
  __device__ float operator()(float x) const {
    return Kind == kLog ? log_softmax_math(x, max, stat) : softmax_math(x, max, stat);
  }
};

// The forward of row `row` by `lanes`, whose parts `merge` merges (block_merge or warp_merge); each
// kind's kernels below are this body under their own names, so that a profile tells them apart.
// `kept` (a block per row only; null: none) is shared memory of kept_row_bytes for the row: the
// reduction stores the row there, and the block's merge, which waits for every thread, makes it
// whole before the elementwise pass reads it.
template <SoftmaxKind Kind, typename scalar_t, typename Merge>
__device__ __forceinline__ void softmax_forward_row(const scalar_t* __restrict__ input,
                                                    float* __restrict__ output, int64_t row,
                                                    int64_t cols, Lanes lanes, scalar_t* kept,
                                                    Merge merge) {
  const scalar_t* x = input + row * cols;
  float* y = output + row * cols;
  scalar_t* keep = kept == nullptr ? nullptr : kept + shift_of(x, 16);
  RowLogSumExp part = RowLogSumExp::empty();
  for_each_of_row(x, cols, lanes, keep, part);
  const RowResult<Kind> result(merge(part));
  const RowPacks split(cols, shift_of(y, 16), kQuad);
  const bool x_aligned = aligned_to(x + split.head, sizeof(scalar_t) * kQuad);
  const bool keep_aligned =
      keep != nullptr && aligned_to(keep + split.head, sizeof(scalar_t) * kQuad);
  for_each_pack<kQuad, 4>(
      split, cols, lanes,
      [=](int64_t i) { y[i] = result(static_cast<float>(keep != nullptr ? keep[i] : x[i])); },
      [=](int64_t i) {
        return keep != nullptr ? load_kept<scalar_t, kQuad>(keep + i, keep_aligned)
                               : load_pack<scalar_t, kQuad>(x + i, x_aligned);
      },
      [=](int64_t i, const Pack<scalar_t, kQuad>& in) {
        Pack<float, kQuad> out;
#pragma unroll
        for (int j = 0; j < kQuad; ++j) out.v[j] = result(static_cast<float>(in.v[j]));
        store_pack(y + i, out, true);
      });
}

struct GradAndResult {
  Pack<float, kQuad> grad, out;
};

// The backward's two fp32 rows, four elements of each, split by the gradient's 16-byte boundaries.
struct GradAndResultRows {
  const float* g;
  const float* out;
  RowPacks split;
  bool out_aligned;

  __device__ GradAndResultRows(const float* g_, const float* out_, int64_t cols)
      : g(g_),
        out(out_),
        split(cols, shift_of(g_, 16), kQuad),
        out_aligned(aligned_to(out_ + split.head, 16)) {}
  __device__ GradAndResult load(int64_t i) const {
    return {load_pack<float, kQuad>(g + i, true), load_pack<float, kQuad>(out + i, out_aligned)};
  }
};

// The row's sum the backward needs: of the gradient (log_softmax; the result is not read), of the
// gradient times the result (softmax). Two packs of each array in flight: 16 floats a thread,
// within the 64 registers.
template <SoftmaxKind Kind, typename Merge>
__device__ float backward_row_sum(const GradAndResultRows& rows, int64_t cols, Lanes lanes,
                                  Merge merge) {
  float part = 0.0f;
  if (Kind == kLog) {
    RowSum sum{0.0f};
    for_each_of_row(rows.g, cols, lanes, static_cast<float*>(nullptr), sum);
    part = sum.sum;
  } else {
    for_each_pack<kQuad, 2>(
        rows.split, cols, lanes, [&](int64_t i) { part += rows.g[i] * rows.out[i]; },
        [&](int64_t i) { return rows.load(i); },
        [&](int64_t, const GradAndResult& in) {
#pragma unroll
          for (int j = 0; j < kQuad; ++j) part += in.grad.v[j] * in.out.v[j];
        });
  }
  return merge(part);
}

template <SoftmaxKind Kind>
__device__ float backward_math(float grad, float out, float row_sum) {
  return Kind == kLog ? log_softmax_backward_math(grad, out, row_sum)
                      : softmax_backward_math(grad, out, row_sum);
}

template <SoftmaxKind Kind, typename scalar_t, typename Merge>
__device__ __forceinline__ void softmax_backward_row(const float* __restrict__ grad,
                                                     const float* __restrict__ output,
                                                     scalar_t* __restrict__ grad_input, int64_t row,
                                                     int64_t cols, Lanes lanes, Merge merge) {
  const int64_t offset = row * cols;
  const GradAndResultRows rows(grad + offset, output + offset, cols);
  scalar_t* gi = grad_input + offset;
  const float row_sum = backward_row_sum<Kind>(rows, cols, lanes, merge);
  const bool gi_aligned = aligned_to(gi + rows.split.head, sizeof(scalar_t) * kQuad);
  for_each_pack<kQuad, 2>(
      rows.split, cols, lanes,
      [&](int64_t i) {
        gi[i] = static_cast<scalar_t>(backward_math<Kind>(rows.g[i], rows.out[i], row_sum));
      },
      [&](int64_t i) { return rows.load(i); },
      [&](int64_t i, const GradAndResult& in) {
        Pack<scalar_t, kQuad> result;
#pragma unroll
        for (int j = 0; j < kQuad; ++j) {
          result.v[j] =
              static_cast<scalar_t>(backward_math<Kind>(in.grad.v[j], in.out.v[j], row_sum));
        }
        store_quad(gi + i, result, gi_aligned);
      });
}

// How a kernel's threads take rows: a block per row for long rows (a thread per 16-byte pack of
// the row, at most kMaxThreads), a warp per row for rows of at most kMaxWarpRowCols (attention
// over 512 or 1024 keys, a classifier's 1000 classes: a block's barriers would cost more than such
// a row's loads; kWarpRowsPerBlock rows to a block).
constexpr int64_t kMaxWarpRowCols = 1024;
constexpr int kWarpRowsPerBlock = 8;

struct BlockPerRow {
  static constexpr bool kKeepsRows = true;  // its merge waits for the whole block
  __device__ static int64_t row() { return blockIdx.x; }
  __device__ static Lanes lanes() { return {threadIdx.x, blockDim.x}; }
  template <typename Part>
  __device__ static Part merge(Part part, Part* shared) {
    return block_merge(part, shared);
  }
};

struct WarpPerRow {
  static constexpr bool kKeepsRows = false;
  __device__ static int64_t row() {
    return static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / kWarp;
  }
  __device__ static Lanes lanes() { return {threadIdx.x % kWarp, kWarp}; }
  template <typename Part>
  __device__ static Part merge(Part part, Part*) {
    return warp_merge(part);
  }
};

// The kernels of a kind (KernelsOf<Kind>::forward<scalar_t, Rows>() and ::backward), each kind's
// under their own names, so that a profile tells them apart. A warp whose row is past the last
// returns at once (warps per row only: a block per row has no such thread). __launch_bounds__:
// kBlocksPerSm blocks of kMaxThreads must fit an SM's registers (64 a thread).
template <SoftmaxKind Kind>
struct KernelsOf;
#define OPTAMP_SOFTMAX_KERNELS(name, kind)                                                        \
  template <typename scalar_t, typename Rows>                                                     \
  __global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)                                    \
      name##_kernel(const scalar_t* __restrict__ input, float* __restrict__ output, int64_t rows, \
                    int64_t cols, bool keep_row) {                                                \
    __shared__ RowLogSumExp parts[kMaxThreads / kWarp];                                           \
    extern __shared__ __align__(16) unsigned char kept_row[];                                     \
    const int64_t row = Rows::row();                                                              \
    if (row >= rows) return;                                                                      \
    softmax_forward_row<kind>(                                                                    \
        input, output, row, cols, Rows::lanes(),                                                  \
        Rows::kKeepsRows && keep_row ? reinterpret_cast<scalar_t*>(kept_row) : nullptr,           \
        [&](RowLogSumExp p) { return Rows::merge(p, parts); });                                   \
  }                                                                                               \
  template <typename scalar_t, typename Rows>                                                     \
  __global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)                                    \
      name##_backward_kernel(const float* __restrict__ grad, const float* __restrict__ output,    \
                             scalar_t* __restrict__ grad_input, int64_t rows, int64_t cols) {     \
    __shared__ float parts[kMaxThreads / kWarp];                                                  \
    const int64_t row = Rows::row();                                                              \
    if (row >= rows) return;                                                                      \
    softmax_backward_row<kind>(grad, output, grad_input, row, cols, Rows::lanes(),                \
                               [&](float p) { return Rows::merge(p, parts); });                   \
  }                                                                                               \
  template <>                                                                                     \
  struct KernelsOf<kind> {                                                                        \
    template <typename scalar_t, typename Rows>                                                   \
    static auto forward() {                                                                       \
      return &name##_kernel<scalar_t, Rows>;                                                      \
    }                                                                                             \
    template <typename scalar_t, typename Rows>                                                   \
    static auto backward() {                                                                      \
      return &name##_backward_kernel<scalar_t, Rows>;                                             \
    }                                                                                             \
  };
OPTAMP_SOFTMAX_KERNELS(widened_log_softmax, SoftmaxKind::kLogSoftmax)
OPTAMP_SOFTMAX_KERNELS(widened_softmax, SoftmaxKind::kSoftmax)
#undef OPTAMP_SOFTMAX_KERNELS

// The grid and block of a launch: warps per row (kWarpRowsPerBlock rows to a block) for rows of
// at most kMaxWarpRowCols, else a block per row with a thread per 16-byte pack of the reduced row
// (a multiple of the warp size, at most kMaxThreads): a thread with nothing to load in the
// reduction would only wait at its barriers.
struct RowLaunch {
  int64_t rows, cols;
  bool warp_per_row;
  int blocks, threads;
};

RowLaunch row_launch(amp::detail::SoftmaxRows rows, const char* op) {
  const bool warp_per_row = rows.cols <= kMaxWarpRowCols;
  const int64_t blocks =
      warp_per_row ? (rows.rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock : rows.rows;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max(), op, ": at most ",
                    std::numeric_limits<int>::max(), " blocks of rows, got ", blocks, " for ",
                    rows.rows, " rows");
  int64_t threads = kWarpRowsPerBlock * kWarp;
  if (!warp_per_row) {
    const int64_t packs = (rows.cols + 7) / 8;
    threads = std::min<int64_t>(kMaxThreads, (packs + kWarp - 1) / kWarp * kWarp);
  }
  return {rows.rows, rows.cols, warp_per_row, static_cast<int>(blocks), static_cast<int>(threads)};
}

// Launches `kernel<Rows>` (a callable taking the Rows type's tag) with the launch's shape.
template <typename Launch>
void launch_rows(const RowLaunch& launch, Launch&& launch_with) {
  if (launch.warp_per_row) {
    launch_with(WarpPerRow{});
  } else {
    launch_with(BlockPerRow{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Lets the block-per-row forward of `Kind` and `scalar_t` take the device's opt-in shared memory
// (above the 48 KB a launch may take by default; the dynamic part may not exceed it less the
// kernel's static part) and returns that static part: the attribute is set once per kernel and
// device, so that later launches, captured ones among them, make no such call.
template <SoftmaxKind Kind, typename scalar_t>
int64_t prepare_kept_rows(c10::DeviceIndex device) {
  static std::array<std::once_flag, C10_COMPILE_TIME_MAX_GPUS> once;
  static std::array<int64_t, C10_COMPILE_TIME_MAX_GPUS> static_bytes{};
  std::call_once(once.at(device), [device] {
    const auto kernel = KernelsOf<Kind>::template forward<scalar_t, BlockPerRow>();
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    const auto optin = at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(optin - attributes.sharedSizeBytes)));
    static_bytes.at(device) = static_cast<int64_t>(attributes.sharedSizeBytes);
  });
  return static_bytes.at(device);
}

// The shared memory a block-per-row forward keeps its rows of `x` in (0: none).
template <SoftmaxKind Kind, typename scalar_t>
int64_t kept_row_bytes_for(const at::Tensor& x, const RowLaunch& launch) {
  if (launch.warp_per_row) return 0;
  const c10::DeviceIndex device = x.get_device();
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  const SharedMemoryLimits limits{static_cast<int64_t>(prop->sharedMemPerBlockOptin),
                                  static_cast<int64_t>(prop->sharedMemPerMultiprocessor),
                                  static_cast<int64_t>(prop->reservedSharedMemPerBlock),
                                  prepare_kept_rows<Kind, scalar_t>(device)};
  return kept_row_bytes(launch.cols, x.element_size(), kBlocksPerSm, limits);
}

template <SoftmaxKind Kind>
at::Tensor widened_softmax_cuda(const at::Tensor& self, int64_t dim) {
  const RowLaunch launch =
      row_launch(amp::detail::checked_forward_rows(Kind, self, dim), "widened softmax");
  const c10::cuda::CUDAGuard device_guard(self.device());  // launches go to the current device
  const at::Tensor input = self.contiguous();
  at::Tensor output = at::empty(input.sizes(), input.options().dtype(at::kFloat));
  if (launch.rows == 0) return output;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "widened_softmax", [&] {
    const int64_t kept_bytes = kept_row_bytes_for<Kind, scalar_t>(input, launch);
    launch_rows(launch, [&](auto rows) {
      const auto kernel = KernelsOf<Kind>::template forward<scalar_t, decltype(rows)>();
      kernel<<<launch.blocks, launch.threads, kept_bytes, stream>>>(
          input.const_data_ptr<scalar_t>(), output.mutable_data_ptr<float>(), launch.rows,
          launch.cols, kept_bytes > 0);
    });
  });
  return output;
}

template <SoftmaxKind Kind>
at::Tensor widened_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output,
                                         int64_t dim, at::ScalarType input_dtype) {
  const RowLaunch launch =
      row_launch(amp::detail::checked_backward_rows(Kind, grad, output, dim, input_dtype),
                 "widened softmax backward");
  const c10::cuda::CUDAGuard device_guard(output.device());
  const at::Tensor g = grad.contiguous();
  const at::Tensor out = output.contiguous();
  at::Tensor grad_input = at::empty(out.sizes(), out.options().dtype(input_dtype));
  if (launch.rows == 0) return grad_input;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input_dtype, "widened_softmax_backward", [&] {
    launch_rows(launch, [&](auto rows) {
      const auto kernel = KernelsOf<Kind>::template backward<scalar_t, decltype(rows)>();
      kernel<<<launch.blocks, launch.threads, 0, stream>>>(
          g.const_data_ptr<float>(), out.const_data_ptr<float>(),
          grad_input.mutable_data_ptr<scalar_t>(), launch.rows, launch.cols);
    });
  });
  return grad_input;
}

// fused_cross_entropy's forward: a row's log-sum-exp as the softmax forward gathers it (without
// keeping the row: nothing reads it again), then the row's loss from its target's logit, written
// by the row's first lane with the row's statistics (maximum, log of the sum) for the backward.
template <typename scalar_t, typename Rows>
__global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)
    fused_cross_entropy_kernel(const scalar_t* __restrict__ input,
                               const int64_t* __restrict__ target, float* __restrict__ losses,
                               float* __restrict__ row_stats, int64_t rows, int64_t cols,
                               int64_t ignore_index) {
  __shared__ RowLogSumExp parts[kMaxThreads / kWarp];
  const int64_t row = Rows::row();
  if (row >= rows) return;
  const Lanes lanes = Rows::lanes();
  const scalar_t* x = input + row * cols;
  RowLogSumExp part = RowLogSumExp::empty();
  for_each_of_row(x, cols, lanes, static_cast<scalar_t*>(nullptr), part);
  const RowLogSumExp all = Rows::merge(part, parts);
  if (lanes.lane != 0) return;
  const float log_sum = ::logf(all.sum);
  const int64_t t = target[row];
  float loss = 0.0f;
  if (t != ignore_index) {
    CUDA_KERNEL_ASSERT(t >= 0 && t < cols);  // torch's nll_loss asserts the same
    loss = t >= 0 && t < cols ? -log_softmax_math(static_cast<float>(x[t]), all.max, log_sum)
                              : std::numeric_limits<float>::quiet_NaN();
  }
  losses[row] = loss;
  row_stats[2 * row] = all.max;
  row_stats[2 * row + 1] = log_sum;
}

// fused_cross_entropy's backward: one elementwise pass over a row, reading the reduced logits and
// writing their gradient in the same dtype, 16 bytes per load and store (split by the gradient's
// 16-byte boundaries; the logits' packs share them unless the logits start at another offset into
// a 16-byte pack: then they load element by element). With 8-byte packs the sixth GPU run moved
// 824 MB in 0.391 ms (2.1 TB/s of the H200's 4.8): 16 bytes a load doubles what a thread keeps in
// flight (four packs, as the reductions).
template <typename scalar_t, typename Rows>
__global__ void __launch_bounds__(kMaxThreads, kBlocksPerSm)
    fused_cross_entropy_backward_kernel(const float* __restrict__ grad,
                                        const scalar_t* __restrict__ input,
                                        const int64_t* __restrict__ target,
                                        const float* __restrict__ row_stats,
                                        scalar_t* __restrict__ grad_input, int64_t rows,
                                        int64_t cols, int64_t ignore_index) {
  const int64_t row = Rows::row();
  if (row >= rows) return;
  const int64_t t = target[row];
  const float g = t == ignore_index ? 0.0f : grad[row];
  const float row_max = row_stats[2 * row];
  const float log_sum = row_stats[2 * row + 1];
  const scalar_t* x = input + row * cols;
  scalar_t* gi = grad_input + row * cols;
  const auto grad_of = [=](float v, int64_t j) {
    return static_cast<scalar_t>(cross_entropy_backward_math(v, row_max, log_sum, j == t, g));
  };
  constexpr int kVec = 16 / sizeof(scalar_t);
  const RowPacks split(cols, shift_of(gi, 16), kVec);
  const bool x_aligned = aligned_to(x + split.head, 16);
  // Four packs in flight a thread where a block takes a row; two where a warp does (a row of at
  // most 1024 elements is four packs a lane; with four, its kernel spilled a register).
  constexpr int kInFlight = std::is_same<Rows, BlockPerRow>::value ? 4 : 2;
  for_each_pack<kVec, kInFlight>(
      split, cols, Rows::lanes(), [=](int64_t i) { gi[i] = grad_of(static_cast<float>(x[i]), i); },
      [=](int64_t i) { return load_pack<scalar_t, kVec>(x + i, x_aligned); },
      [=](int64_t i, const Pack<scalar_t, kVec>& in) {
        Pack<scalar_t, kVec> out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) out.v[j] = grad_of(static_cast<float>(in.v[j]), i + j);
        store_pack(gi + i, out, true);
      });
}

std::tuple<at::Tensor, at::Tensor> fused_cross_entropy_cuda(const at::Tensor& self,
                                                            const at::Tensor& target,
                                                            int64_t ignore_index) {
  const amp::detail::CrossEntropyRows shape =
      amp::detail::checked_cross_entropy_rows(self, target, "fused_cross_entropy");
  const int64_t rows = shape.rows;
  const int64_t cols = shape.cols;
  const RowLaunch launch = row_launch({rows, cols}, "fused_cross_entropy");
  const c10::cuda::CUDAGuard device_guard(self.device());
  const at::Tensor input = self.contiguous();
  const at::Tensor targets = target.contiguous();
  at::Tensor losses = at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor row_stats = at::empty({rows, 2}, input.options().dtype(at::kFloat));
  if (rows == 0) return {losses, row_stats};
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "fused_cross_entropy", [&] {
    launch_rows(launch, [&](auto rows_of) {
      fused_cross_entropy_kernel<scalar_t, decltype(rows_of)>
          <<<launch.blocks, launch.threads, 0, stream>>>(
              input.const_data_ptr<scalar_t>(), targets.const_data_ptr<int64_t>(),
              losses.mutable_data_ptr<float>(), row_stats.mutable_data_ptr<float>(), rows, cols,
              ignore_index);
    });
  });
  return {losses, row_stats};
}

at::Tensor fused_cross_entropy_backward_cuda(const at::Tensor& grad, const at::Tensor& self,
                                             const at::Tensor& target, const at::Tensor& row_stats,
                                             int64_t ignore_index) {
  amp::detail::check_cross_entropy_backward(grad, self, target, row_stats);
  const int64_t rows = self.size(0);
  const int64_t cols = self.size(1);
  const RowLaunch launch = row_launch({rows, cols}, "fused_cross_entropy_backward");
  const c10::cuda::CUDAGuard device_guard(self.device());
  const at::Tensor input = self.contiguous();
  const at::Tensor g = grad.contiguous();
  const at::Tensor targets = target.contiguous();
  const at::Tensor stats = row_stats.contiguous();
  at::Tensor grad_input = at::empty({rows, cols}, input.options());
  if (rows == 0) return grad_input;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "fused_cross_entropy_backward", [&] {
    launch_rows(launch, [&](auto rows_of) {
      fused_cross_entropy_backward_kernel<scalar_t, decltype(rows_of)>
          <<<launch.blocks, launch.threads, 0, stream>>>(
              g.const_data_ptr<float>(), input.const_data_ptr<scalar_t>(),
              targets.const_data_ptr<int64_t>(), stats.const_data_ptr<float>(),
              grad_input.mutable_data_ptr<scalar_t>(), rows, cols, ignore_index);
    });
  });
  return grad_input;
}

}  // namespace
}  // namespace amp::ops::detail

TORCH_LIBRARY_IMPL(optamp, CUDA, m) {
  using amp::detail::SoftmaxKind;
  namespace ops = amp::ops::detail;
  m.impl("widened_log_softmax", &ops::widened_softmax_cuda<SoftmaxKind::kLogSoftmax>);
  m.impl("widened_log_softmax_backward",
         &ops::widened_softmax_backward_cuda<SoftmaxKind::kLogSoftmax>);
  m.impl("widened_softmax", &ops::widened_softmax_cuda<SoftmaxKind::kSoftmax>);
  m.impl("widened_softmax_backward", &ops::widened_softmax_backward_cuda<SoftmaxKind::kSoftmax>);
  m.impl("fused_cross_entropy", &ops::fused_cross_entropy_cuda);
  m.impl("fused_cross_entropy_backward", &ops::fused_cross_entropy_backward_cuda);
}
