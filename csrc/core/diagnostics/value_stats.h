#pragma once
// Internal: what a tensor's values would lose in float16 / bfloat16 (docs/precision.md,
// "Definitions"), for amp::PrecisionProbe.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

// The cast thresholds of round-to-nearest-even, as torch's casts round: |x| at or above the
// overflow threshold becomes inf, 0 < |x| at or below the flush threshold becomes 0.
constexpr double kFp16OverflowAt = 65520.0;     // midway from 65504 (the largest) to 2^16
constexpr double kFp16FlushAt = 0x1p-25;        // half the smallest subnormal, 2^-24
constexpr double kBf16OverflowAt = 0x1.ffp127;  // (2 - 2^-8) * 2^127, midway to 2^128
constexpr double kBf16FlushAt = 0x1p-134;       // half the smallest subnormal, 2^-133

struct ValueStats {
  std::int64_t elements = 0;
  std::int64_t nonfinite = 0;
  std::int64_t nan = 0;  // of the non-finite values, NaN (the rest are +-inf)
  double max_abs = 0.0;  // over the finite values
  std::int64_t fp16_overflow = 0, fp16_flush = 0, bf16_overflow = 0, bf16_flush = 0;
};

// Adds `part`'s counts into `total`: any two of ValueStats, the probe's per-call measurement and
// its report rows, which carry the same counters.
template <typename Total, typename Part>
void add_counts(Total& total, const Part& part) {
  total.elements += part.elements;
  total.nonfinite += part.nonfinite;
  total.max_abs = total.max_abs > part.max_abs ? total.max_abs : part.max_abs;
  total.fp16_overflow += part.fp16_overflow;
  total.fp16_flush += part.fp16_flush;
  total.bf16_overflow += part.bf16_overflow;
  total.bf16_flush += part.bf16_flush;
}

// `t`: defined, floating point, dense with storage. One pass over the data on the CPU; a few
// reductions and one device->host read elsewhere. Runs ATen ops: call it where they are not
// observed and not cast (PrecisionProbe's measuring guards).
ValueStats value_stats(const at::Tensor& t);
// The path for other devices (CUDA): ATen reductions, on any device (the tests check it against
// the CPU pass on the CPU).
ValueStats value_stats_by_reductions(const at::Tensor& t);

}  // namespace amp::detail
