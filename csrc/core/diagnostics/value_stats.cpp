// One pass over a CPU tensor's values (the probe measures every op's outputs: a dozen ATen
// reductions per tensor cost 50x a training step), a few reductions on other devices.
#include "diagnostics/value_stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace amp::detail {
namespace {

// Counts of one block, in 32-bit lanes so the compiler vectorizes the loop (the probe reads every
// op's outputs: the scan is most of its cost).
struct BlockCounts {
  std::int32_t nonfinite = 0, nan = 0, h_over = 0, h_flush = 0, b_over = 0, b_flush = 0;
};

// Acc: float for float16/bfloat16/float32 values (exact), double for float64. The thresholds
// apply to the value as a float: torch casts float64 to float16/bfloat16 through float32.
// The largest |value| is kept as the bits of the float: for non-negative values their order
// is the order of the integers, and an integer max vectorizes (a float max does not without
// -ffast-math, and keeps the whole loop scalar).
template <typename Acc>
using Bits = std::conditional_t<sizeof(Acc) == 4, std::int32_t, std::int64_t>;

template <typename Acc, typename T>
Bits<Acc> scan_block(const T* data, std::int64_t n, BlockCounts& c, Bits<Acc> max_bits) {
  constexpr float fp16_over = kFp16OverflowAt, fp16_flush = kFp16FlushAt;
  constexpr float bf16_over = kBf16OverflowAt, bf16_flush = kBf16FlushAt;
  constexpr Acc largest = std::numeric_limits<Acc>::max();
  std::int32_t nonfinite = 0, nan = 0, h_over = 0, h_flush = 0, b_over = 0, b_flush = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Acc a = std::abs(static_cast<Acc>(data[i]));
    const bool finite = a <= largest;  // false for inf and NaN
    const auto f = static_cast<float>(a);
    Bits<Acc> bits;
    std::memcpy(&bits, &a, sizeof bits);
    const Bits<Acc> kept = finite ? bits : 0;
    max_bits = kept > max_bits ? kept : max_bits;
    nonfinite += !finite;
    nan += a != a;  // NaN is the one value unequal to itself
    h_over += finite & (f >= fp16_over);
    b_over += finite & (f >= bf16_over);
    h_flush += (a > 0) & (f <= fp16_flush);
    b_flush += (a > 0) & (f <= bf16_flush);
  }
  c.nonfinite += nonfinite;
  c.nan += nan;
  c.h_over += h_over;
  c.h_flush += h_flush;
  c.b_over += b_over;
  c.b_flush += b_flush;
  return max_bits;
}

template <typename Acc, typename T>
ValueStats scan(const T* data, std::int64_t n) {
  constexpr std::int64_t kBlock = 1 << 20;  // 32-bit counters cannot overflow within a block
  ValueStats s;
  s.elements = n;
  Bits<Acc> max_bits = 0;
  for (std::int64_t begin = 0; begin < n; begin += kBlock) {
    BlockCounts c;
    max_bits = scan_block<Acc>(data + begin, std::min(kBlock, n - begin), c, max_bits);
    s.nonfinite += c.nonfinite;
    s.nan += c.nan;
    s.fp16_overflow += c.h_over;
    s.fp16_flush += c.h_flush;
    s.bf16_overflow += c.b_over;
    s.bf16_flush += c.b_flush;
  }
  Acc max_abs;
  std::memcpy(&max_abs, &max_bits, sizeof max_abs);
  s.max_abs = static_cast<double>(max_abs);
  return s;
}

// float16/bfloat16: converted to float32 a block at a time by ATen's vectorized cast (this
// file's scalar conversion keeps the scan loop from vectorizing: 7 ns per value, not 0.5).
ValueStats low_precision_stats(const at::Tensor& flat) {
  constexpr std::int64_t kBlock = 1 << 16;
  ValueStats s;
  for (std::int64_t begin = 0; begin < flat.numel(); begin += kBlock) {
    const at::Tensor block =
        flat.narrow(0, begin, std::min(kBlock, flat.numel() - begin)).to(at::kFloat);
    const ValueStats part = scan<float>(block.const_data_ptr<float>(), block.numel());
    add_counts(s, part);
    s.nan += part.nan;
  }
  return s;
}

ValueStats cpu_stats(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  switch (c.scalar_type()) {
    case at::kHalf:
    case at::kBFloat16:
      return low_precision_stats(c.view(-1));
    case at::kFloat:
      return scan<float>(c.const_data_ptr<float>(), c.numel());
    case at::kDouble:
      return scan<double>(c.const_data_ptr<double>(), c.numel());
    default:
      return ValueStats{};  // other floating types (float8): not measured
  }
}

}  // namespace

// Elsewhere (CUDA): the same counts as reductions, read back with one copy.
ValueStats value_stats_by_reductions(const at::Tensor& t) {
  const auto wide = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor a = t.abs().to(wide);
  const at::Tensor finite = a.isfinite();
  const at::Tensor nonzero = a.gt(0);
  const at::Tensor f = a.to(at::kFloat);  // as torch casts: float64 through float32
  const at::Tensor counts =
      at::stack({at::logical_not(finite).sum(),
                 at::logical_and(finite, f.ge(kFp16OverflowAt)).sum(),
                 at::logical_and(nonzero, f.le(kFp16FlushAt)).sum(),
                 at::logical_and(finite, f.ge(kBf16OverflowAt)).sum(),
                 at::logical_and(nonzero, f.le(kBf16FlushAt)).sum(), a.isnan().sum(),
                 at::where(finite, a, 0).amax().to(at::kDouble).view(at::kLong)})
          .cpu();  // the one device->host read
  const auto* c = counts.const_data_ptr<std::int64_t>();
  ValueStats s;
  s.elements = t.numel();
  s.nonfinite = c[0];
  s.fp16_overflow = c[1];
  s.fp16_flush = c[2];
  s.bf16_overflow = c[3];
  s.bf16_flush = c[4];
  s.nan = c[5];
  std::memcpy(&s.max_abs, &c[6], sizeof s.max_abs);  // the double's bits, carried as int64
  return s;
}

ValueStats value_stats(const at::Tensor& t) {
  return t.device().is_cpu() ? cpu_stats(t) : value_stats_by_reductions(t);
}

}  // namespace amp::detail
