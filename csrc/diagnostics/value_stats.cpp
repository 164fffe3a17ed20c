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

// float for float16/bfloat16/float32 values (exact), double for float64.
template <typename Acc, typename T>
ValueStats scan(const T* data, std::int64_t n) {
  const Acc fp16_over = static_cast<Acc>(kFp16OverflowAt),
            fp16_flush = static_cast<Acc>(kFp16FlushAt);
  const Acc bf16_over = static_cast<Acc>(kBf16OverflowAt),
            bf16_flush = static_cast<Acc>(kBf16FlushAt);
  const Acc largest = std::numeric_limits<Acc>::max();
  std::int64_t nonfinite = 0, h_over = 0, h_flush = 0, b_over = 0, b_flush = 0;
  Acc max_abs = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Acc a = std::abs(static_cast<Acc>(data[i]));
    const bool finite = a <= largest;  // false for inf and NaN
    nonfinite += !finite;
    max_abs = (finite && a > max_abs) ? a : max_abs;
    h_over += finite && a >= fp16_over;
    b_over += finite && a >= bf16_over;
    h_flush += a > 0 && a <= fp16_flush;
    b_flush += a > 0 && a <= bf16_flush;
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

// Elsewhere (CUDA): the same counts as reductions, read back with one copy.
ValueStats device_stats(const at::Tensor& t) {
  const auto wide = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor a = t.abs().to(wide);
  const at::Tensor finite = a.isfinite();
  const at::Tensor nonzero = a.gt(0);
  const at::Tensor counts =
      at::stack({at::logical_not(finite).sum(),
                 at::logical_and(finite, a.ge(kFp16OverflowAt)).sum(),
                 at::logical_and(nonzero, a.le(kFp16FlushAt)).sum(),
                 at::logical_and(finite, a.ge(kBf16OverflowAt)).sum(),
                 at::logical_and(nonzero, a.le(kBf16FlushAt)).sum(),
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

}  // namespace

ValueStats value_stats(const at::Tensor& t) {
  return t.device().is_cpu() ? cpu_stats(t) : device_stats(t);
}

}  // namespace amp::detail
