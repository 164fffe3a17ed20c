#pragma once
// The row math of optamp::widened_log_softmax, optamp::widened_softmax and their backwards on CUDA
// (ops/widened_softmax.h says what the ops are for), in fp32: a row's log-sum-exp gathered in one
// pass (a running maximum and the sum of exp(x - maximum), rescaled when the maximum grows, so
// parts of a row gathered by different threads merge in any order; a pack of elements loaded
// together is added at once), and torch's formulas for the results and the gradients: log_softmax
// out = (x - max) - log(sum), grad_in = grad - exp(out) * sum(grad); softmax out = exp(x - max) /
// sum, grad_in = out * (grad - sum(grad * out)). Non-finite inputs give what torch's fp32 kernels
// give: a NaN or a +inf in the row makes the whole row NaN, -inf entries contribute nothing (a row
// of only -inf is NaN). The CPU runs the ops as torch's own ops; tests/cpp/test_fused_casts.cpp
// checks these functions against them.
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace amp::ops::detail {

#if defined(__CUDACC__)
#define OPTAMP_UNROLL _Pragma("unroll")
#else
#define OPTAMP_UNROLL
#endif

// A part of a row. An aggregate without initializers: CUDA kernels keep parts in __shared__
// arrays, which admit no constructor.
struct RowLogSumExp {
  float max;
  float sum;  // of exp(x - max) over the elements seen

  // The part of no element.
  C10_HOST_DEVICE static RowLogSumExp empty() {
    return {-std::numeric_limits<float>::infinity(), 0.0f};
  }
  // One element as a part of its own.
  C10_HOST_DEVICE static RowLogSumExp of(float x) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    if (x == -kInf) return empty();  // exp(-inf) = 0
    if (x != x || x == kInf) {       // torch's row turns NaN
      return {-kInf, std::numeric_limits<float>::quiet_NaN()};
    }
    return {x, 1.0f};
  }

  // Both parts rescaled to the larger maximum. A part whose maximum is the new one keeps its sum
  // as it is (no exp(-inf - -inf) = NaN for two empty parts); NaN sums stay NaN.
  C10_HOST_DEVICE void merge(const RowLogSumExp& other) {
    const float top = other.max > max ? other.max : max;
    const float mine = max == top ? sum : sum * ::expf(max - top);
    const float theirs = other.max == top ? other.sum : other.sum * ::expf(other.max - top);
    max = top;
    sum = mine + theirs;
  }

  C10_HOST_DEVICE void add(float x) { merge(of(x)); }

  // The N elements of a pack at once, with what add gives for each in turn (NaN or +inf turn the
  // sum NaN; -inf adds nothing) in another rounding: the pack's maximum first, the sum rescaled
  // once if it grew, then an exp of each element, independent of each other. add one element at a
  // time makes each exp wait for the one before (the maximum and the sum depend on it): on an H200
  // the reduction over GPT-2's 50257-class bf16 rows read at 1 TB/s (0.42 ms for 412 MB) where the
  // memory moves 4.8, and that chain is what a thread waits on.
  template <int N>
  C10_HOST_DEVICE void add_pack(const float (&x)[N]) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    float top = max;
    OPTAMP_UNROLL
    for (int j = 0; j < N; ++j) top = ::fmaxf(top, x[j]);  // a NaN is not a maximum
    if (top == -kInf) {  // the pack adds nothing, unless it holds a NaN
      for (int j = 0; j < N; ++j) {
        if (x[j] != x[j]) sum = std::numeric_limits<float>::quiet_NaN();
      }
      return;
    }
    if (top > max) {
      sum *= ::expf(max - top);
      max = top;
    }
    float pack_sum = 0.0f;
    OPTAMP_UNROLL
    for (int j = 0; j < N; ++j) pack_sum += ::expf(x[j] - top);
    sum += pack_sum;
  }
};

// A lane's sum of plain values (the backward's sum of gradients), with RowLogSumExp's interface:
// element by element, a pack's in order.
struct RowSum {
  float sum;

  C10_HOST_DEVICE void add(float x) { sum += x; }
  template <int N>
  C10_HOST_DEVICE void add_pack(const float (&x)[N]) {
    OPTAMP_UNROLL
    for (int j = 0; j < N; ++j) sum += x[j];
  }
};

// How a reduction pass splits a row of `cols` elements among `threads` lanes when it loads 16
// bytes (`vec` elements) at a time: the `head` elements before the first 16-byte boundary (the row
// starts `shift` elements past one; a GPT-2 row of 50257 bf16 elements rarely starts on one) one
// per lane, then `packs` aligned packs of `vec`, pack q to lane q % threads, then the rest of the
// row one element per lane. Each lane merges its elements in ascending order. The CUDA kernels
// use the bounds; tests/cpp/test_fused_casts.cpp merges a row's parts on the CPU by lane_of.
struct RowPacks {
  int64_t head, packs, tail_start;

  C10_HOST_DEVICE RowPacks(int64_t cols, int64_t shift, int64_t vec)
      : head(shift == 0 ? 0 : (vec - shift < cols ? vec - shift : cols)),
        packs((cols - head) / vec),
        tail_start(head + packs * vec) {}

  // The lane that merges element i (threads >= vec: a head or a tail is shorter than a pack).
  C10_HOST_DEVICE int64_t lane_of(int64_t i, int64_t threads, int64_t vec) const {
    if (i < head) return i;
    if (i >= tail_start) return i - tail_start;
    return ((i - head) / vec) % threads;
  }
};

// The threads that share a row, and this thread's place among them: on CUDA a block's (long rows)
// or a warp's (rows of at most 1024, several to a block).
struct Lanes {
  int64_t lane, count;
};

// Walks lane `lanes.lane`'s share of a row split by `split` (packs of kVec, among `lanes.count`
// lanes, as RowPacks::lane_of assigns them): one(i) for each of its head and tail elements, and
// for its packs, starting at element i, load(i) for kInFlight packs before use(i, loaded) for any
// of them (on a GPU one load at a time per thread would leave too few bytes in flight to keep the
// memory busy). Ascending order within a lane. Every pass of the CUDA kernels walks its rows so;
// tests/cpp/test_fused_casts.cpp runs it on the CPU for every lane.
template <int kVec, int kInFlight, typename One, typename Load, typename Use>
C10_HOST_DEVICE void for_each_pack(const RowPacks& split, int64_t cols, Lanes lanes, One one,
                                   Load load, Use use) {
  using Loaded = decltype(load(int64_t{0}));
  const int64_t threads = lanes.count;
  if (lanes.lane < split.head) one(lanes.lane);
  for (int64_t base = lanes.lane; base < split.packs; base += threads * kInFlight) {
    Loaded loaded[kInFlight];
    OPTAMP_UNROLL
    for (int k = 0; k < kInFlight; ++k) {
      if (base + k * threads < split.packs) {
        loaded[k] = load(split.head + (base + k * threads) * kVec);
      }
    }
    OPTAMP_UNROLL
    for (int k = 0; k < kInFlight; ++k) {
      if (base + k * threads < split.packs)
        use(split.head + (base + k * threads) * kVec, loaded[k]);
    }
  }
  if (split.tail_start + lanes.lane < cols) one(split.tail_start + lanes.lane);
}

#undef OPTAMP_UNROLL

// What an SM offers a block's shared memory (cudaDeviceProp's sharedMemPerBlockOptin,
// sharedMemPerMultiprocessor, reservedSharedMemPerBlock) and what a kernel declares itself.
struct SharedMemoryLimits {
  int64_t per_block_optin, per_sm, reserved_per_block, static_per_block;
};

// The bytes of dynamic shared memory in which a block-per-row forward keeps its row of `cols`
// elements of `elem_size` bytes as its reduction loads them, so that its elementwise pass reads
// the row from there instead of from memory a second time; 0 where it does not keep the row. The
// row is kept at its offset into a 16-byte pack (the reduction's packs store as they load), so one
// pack more than the row. Only where `blocks_per_sm` such blocks fit an SM at once: fewer would
// leave an SM's loads waiting at every row's reduction (a GPT-2 row of 50257 bf16 elements, 100
// KB, fits twice on an H100 or H200, not on an A100).
inline int64_t kept_row_bytes(int64_t cols, int64_t elem_size, int64_t blocks_per_sm,
                              const SharedMemoryLimits& limits) {
  const int64_t bytes = cols * elem_size + 16;
  if (bytes + limits.static_per_block > limits.per_block_optin) return 0;
  const int64_t per_block = bytes + limits.static_per_block + limits.reserved_per_block;
  return blocks_per_sm * per_block <= limits.per_sm ? bytes : 0;
}

// log_softmax of an element `x` of a row whose parts merged into `row`, given log(row.sum) (one
// logarithm per row, as torch's kernels take it).
C10_HOST_DEVICE inline float log_softmax_math(float x, float row_max, float log_sum) {
  return (x - row_max) - log_sum;
}

// The gradient of log_softmax's input at one element, from the gradient `grad` of its result
// `out` and the row's sum of gradients.
C10_HOST_DEVICE inline float log_softmax_backward_math(float grad, float out, float grad_sum) {
  return grad - ::expf(out) * grad_sum;
}

// The gradient of cross_entropy's logit `x` (fused_cross_entropy's backward): softmax(x) minus 1 at
// the target, times the row's gradient `grad` (0 for an ignored row), softmax taken as exp of
// log_softmax_math, as torch's log_softmax backward takes exp of its saved result.
C10_HOST_DEVICE inline float cross_entropy_backward_math(float x, float row_max, float log_sum,
                                                         bool is_target, float grad) {
  return (::expf(log_softmax_math(x, row_max, log_sum)) - (is_target ? 1.0f : 0.0f)) * grad;
}

// softmax of an element `x` of a row whose parts merged into `row` (max and sum).
C10_HOST_DEVICE inline float softmax_math(float x, float row_max, float row_sum) {
  return ::expf(x - row_max) / row_sum;
}

// The gradient of softmax's input at one element, from the gradient `grad` of its result `out`
// and the row's sum of grad * out.
C10_HOST_DEVICE inline float softmax_backward_math(float grad, float out, float grad_dot_out) {
  return out * (grad - grad_dot_out);
}

}  // namespace amp::ops::detail
