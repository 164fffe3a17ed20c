// One pass over a CPU tensor's values (the probe measures every op's outputs: a dozen ATen
// reductions per tensor cost 50x a training step), a few reductions on other devices.
#include "diagnostics/value_stats.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace amp::detail {
namespace {

// Acc: float for float16/bfloat16/float32 values (exact), double for float64. The thresholds
// apply to the value as a float: torch casts float64 to float16/bfloat16 through float32.
template <typename Acc, typename T>
ValueStats scan(const T* data, std::int64_t n) {
  constexpr float fp16_over = kFp16OverflowAt, fp16_flush = kFp16FlushAt;
  constexpr float bf16_over = kBf16OverflowAt, bf16_flush = kBf16FlushAt;
  const Acc largest = std::numeric_limits<Acc>::max();
  std::int64_t nonfinite = 0, h_over = 0, h_flush = 0, b_over = 0, b_flush = 0;
  Acc max_abs = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Acc a = std::abs(static_cast<Acc>(data[i]));
    const bool finite = a <= largest;  // false for inf and NaN
    const auto f = static_cast<float>(a);
    nonfinite += !finite;
    max_abs = (finite && a > max_abs) ? a : max_abs;
    h_over += finite && f >= fp16_over;
    b_over += finite && f >= bf16_over;
    h_flush += a > 0 && f <= fp16_flush;
    b_flush += a > 0 && f <= bf16_flush;
  }
  ValueStats s;
  s.elements = n;
  s.nonfinite = nonfinite;
  s.max_abs = static_cast<double>(max_abs);
  s.fp16_overflow = h_over;
  s.fp16_flush = h_flush;
  s.bf16_overflow = b_over;
  s.bf16_flush = b_flush;
  return s;
}

ValueStats cpu_stats(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  ValueStats s;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "value_stats", [&] {
    using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    s = scan<Acc>(c.const_data_ptr<scalar_t>(), c.numel());
  });
  return s;
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
                 at::logical_and(nonzero, f.le(kBf16FlushAt)).sum(),
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
  std::memcpy(&s.max_abs, &c[5], sizeof s.max_abs);  // the double's bits, carried as int64
  return s;
}

ValueStats value_stats(const at::Tensor& t) {
  return t.device().is_cpu() ? cpu_stats(t) : value_stats_by_reductions(t);
}

}  // namespace amp::detail
