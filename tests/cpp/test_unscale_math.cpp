// The per-element math shared by the CPU and CUDA kernels (ops/unscale_math.h): the functions
// themselves on edge values (inf, NaN, values that overflow only after unscaling or rounding,
// subnormals, the scale-1.0 read-only check), and the kernels against them bit for bit (each CPU
// path this CPU runs, vector bodies and scalar tails; the *_CUDA twins run the CUDA kernels where
// a GPU is).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/cpu/cpu_isa.h"
#include "ops/multi_tensor.h"
#include "ops/unscale_math.h"
#include "test_util.h"

namespace amp {
namespace {

using c10::BFloat16;
using c10::Half;
using ops::detail::axpby_element;
using ops::detail::check_element;
using ops::detail::unscale_element;
using ops::detail::unscale_is_check;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
uint32_t bits(Half v) { return v.x; }
uint32_t bits(BFloat16 v) { return v.x; }
float from_bits_f(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
Half half_bits(uint16_t u) { return Half(u, Half::from_bits()); }
BFloat16 bf16_bits(uint16_t u) { return BFloat16(u, BFloat16::from_bits()); }

template <typename T>
bool is_nan(T v) {
  return std::isnan(static_cast<float>(v));
}

// Same value, or both NaN (NaN payloads are not part of the contract: conversions differ).
template <typename T>
::testing::AssertionResult same(T actual, T expected) {
  if (bits(actual) == bits(expected) || (is_nan(actual) && is_nan(expected))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << std::hex << "bits 0x" << bits(actual) << " != 0x" << bits(expected) << " ("
         << static_cast<float>(actual) << " vs " << static_cast<float>(expected) << ")";
}

template <typename T>
T unscale(T v, float s, bool& bad) {
  bad = false;
  return unscale_element(v, s, bad);
}

TEST(UnscaleMath, InfAndNanInputsAreFlagged) {
  bool bad = false;
  for (float v : {kInf, -kInf, kNaN}) {
    EXPECT_TRUE(same(unscale(v, 0.5f, bad), v * 0.5f));
    EXPECT_TRUE(bad) << v;
    EXPECT_TRUE(same(unscale(Half(v), 0.5f, bad), Half(v)));
    EXPECT_TRUE(bad) << v;
    EXPECT_TRUE(same(unscale(BFloat16(v), 0.5f, bad), BFloat16(v)));
    EXPECT_TRUE(bad) << v;
  }
  EXPECT_TRUE(same(unscale(1.5f, 0.25f, bad), 0.375f));
  EXPECT_FALSE(bad);
}

TEST(UnscaleMath, FiniteValuesThatOverflowOnlyAfterUnscalingAreFlagged) {
  bool bad = false;
  // A loss scale below 1 gives inv_scale > 1: a finite gradient can leave the range.
  EXPECT_TRUE(same(unscale(1e33f, 1048576.0f, bad), kInf));
  EXPECT_TRUE(bad);
  EXPECT_TRUE(same(unscale(-3e38f, 2.0f, bad), -kInf));
  EXPECT_TRUE(bad);
  EXPECT_TRUE(same(unscale(BFloat16(3e38f), 2.0f, bad), BFloat16(kInf)));
  EXPECT_TRUE(bad);
  // fp16: the fp32 product is finite, the stored value is not.
  EXPECT_TRUE(same(unscale(Half(40000.0f), 2.0f, bad), Half(kInf)));
  EXPECT_TRUE(bad);
  // fp16: only the rounding overflows (65530 is above 65520, the midpoint to 65536).
  EXPECT_TRUE(same(unscale(Half(65504.0f), 65530.0f / 65504.0f, bad), Half(kInf)));
  EXPECT_TRUE(bad);
  // ... and just below the midpoint it rounds to the largest finite half.
  EXPECT_TRUE(same(unscale(Half(65504.0f), 65519.0f / 65504.0f, bad), Half(65504.0f)));
  EXPECT_FALSE(bad);
  // The largest finite values stay finite when unscaled by 1 or less.
  EXPECT_TRUE(same(unscale(std::numeric_limits<float>::max(), 1.0f, bad),
                   std::numeric_limits<float>::max()));
  EXPECT_FALSE(bad);
  EXPECT_TRUE(same(unscale(Half(65504.0f), 0.5f, bad), Half(32752.0f)));
  EXPECT_FALSE(bad);
}

TEST(UnscaleMath, SubnormalsAreKeptAndRoundedToNearestEven) {
  bool bad = false;
  const float tiny = std::numeric_limits<float>::denorm_min();  // 2^-149
  EXPECT_TRUE(same(unscale(tiny, 0.5f, bad), 0.0f));            // tie -> even (0)
  EXPECT_FALSE(bad);
  EXPECT_TRUE(same(unscale(3 * tiny, 0.5f, bad), 2 * tiny));  // 1.5 ulp: tie -> even (2)
  EXPECT_TRUE(same(unscale(tiny, 4.0f, bad), 4 * tiny));
  EXPECT_TRUE(same(unscale(std::numeric_limits<float>::min(), 0.25f, bad),
                   from_bits_f(0x00200000u)));  // normal -> subnormal
  EXPECT_TRUE(same(unscale(-tiny, 0.5f, bad), -0.0f));
  EXPECT_FALSE(bad);
  // fp16 subnormals (2^-24 is 0x0001).
  EXPECT_TRUE(same(unscale(half_bits(0x0001), 0.5f, bad), half_bits(0x0000)));
  EXPECT_TRUE(same(unscale(half_bits(0x0003), 0.5f, bad), half_bits(0x0002)));
  EXPECT_TRUE(same(unscale(half_bits(0x0400), 0.5f, bad), half_bits(0x0200)));
  EXPECT_TRUE(same(unscale(half_bits(0x8001), 0.5f, bad), half_bits(0x8000)));
  EXPECT_FALSE(bad);
  // bf16 subnormals (2^-133 is 0x0001).
  EXPECT_TRUE(same(unscale(bf16_bits(0x0001), 0.5f, bad), bf16_bits(0x0000)));
  EXPECT_TRUE(same(unscale(bf16_bits(0x0003), 0.5f, bad), bf16_bits(0x0002)));
  EXPECT_TRUE(same(unscale(bf16_bits(0x0002), 0.5f, bad), bf16_bits(0x0001)));
  EXPECT_FALSE(bad);
}

TEST(UnscaleMath, ScaleOneIsTheReadOnlyCheck) {
  EXPECT_TRUE(unscale_is_check(1.0f));
  EXPECT_FALSE(unscale_is_check(std::nextafter(1.0f, 2.0f)));
  EXPECT_FALSE(unscale_is_check(std::nextafter(1.0f, 0.0f)));
  EXPECT_FALSE(unscale_is_check(0.5f));
  EXPECT_FALSE(unscale_is_check(kNaN));
  // check_element flags exactly what an unscale by 1.0 would flag.
  const float tiny = std::numeric_limits<float>::denorm_min();
  for (float v :
       {0.0f, -0.0f, 1.0f, tiny, -tiny, std::numeric_limits<float>::max(), kInf, -kInf, kNaN}) {
    bool checked = false, unscaled = false;
    check_element(v, checked);
    EXPECT_TRUE(same(unscale_element(v, 1.0f, unscaled), v));
    EXPECT_EQ(checked, unscaled) << v;
    EXPECT_EQ(checked, !std::isfinite(v)) << v;
    bool half_checked = false;
    check_element(Half(v), half_checked);
    EXPECT_EQ(half_checked, !std::isfinite(static_cast<float>(Half(v)))) << v;
  }
  // The flag accumulates: a finite value does not clear it.
  bool bad = true;
  check_element(1.0f, bad);
  EXPECT_TRUE(bad);
}

TEST(UnscaleMath, AxpbyRoundsEachOperationAndChecksXAndTheResult) {
  bool bad = false;
  EXPECT_TRUE(same(axpby_element(2.0f, 3.0f, 0.5f, 2.0f, bad), 7.0f));
  EXPECT_FALSE(bad);
  // No fused multiply-add: round(a*x) is exactly 1, so the sum is exactly 0 (an FMA gives
  // 2.98e-8). The CUDA kernel matches through __fmul_rn/__fadd_rn.
  EXPECT_TRUE(same(axpby_element(3.0f, -1.0f, 1.0f / 3.0f, 1.0f, bad), 0.0f));
  EXPECT_FALSE(bad);
  // inf/NaN in x, even where a is 0 (0 * inf is NaN).
  axpby_element(kInf, 1.0f, 1.0f, 1.0f, bad = false);
  EXPECT_TRUE(bad);
  axpby_element(kNaN, 1.0f, 0.0f, 1.0f, bad = false);
  EXPECT_TRUE(bad);
  // inf/NaN in y reach the result.
  EXPECT_TRUE(same(axpby_element(1.0f, kInf, 1.0f, 1.0f, bad = false), kInf));
  EXPECT_TRUE(bad);
  EXPECT_TRUE(is_nan(axpby_element(1.0f, kNaN, 1.0f, 1.0f, bad = false)));
  EXPECT_TRUE(bad);
  // Finite inputs whose sum overflows, in fp32 and only after rounding to fp16.
  EXPECT_TRUE(same(axpby_element(3e38f, 3e38f, 1.0f, 1.0f, bad = false), kInf));
  EXPECT_TRUE(bad);
  EXPECT_TRUE(
      same(axpby_element(Half(40000.0f), Half(30000.0f), 1.0f, 1.0f, bad = false), Half(kInf)));
  EXPECT_TRUE(bad);
  EXPECT_TRUE(same(axpby_element(BFloat16(1.0f), BFloat16(1.0f), 0.5f, 0.25f, bad = false),
                   BFloat16(0.75f)));
  EXPECT_FALSE(bad);
  // Subnormal results are kept.
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(same(axpby_element(4 * tiny, tiny, 0.5f, 1.0f, bad = false), 3 * tiny));
  EXPECT_TRUE(same(axpby_element(half_bits(0x0002), half_bits(0x0001), 0.5f, 1.0f, bad),
                   half_bits(0x0002)));
  EXPECT_FALSE(bad);
}

// ---- the kernels against the shared functions ---------------------------------------------------

// Edge values of every kind, then random ones; the length puts values both in vector bodies
// (16 and 8 lanes on the CPU, 16-byte vectors on CUDA) and in scalar tails.
template <typename T>
std::vector<T> edge_values() {
  const float tiny = std::numeric_limits<float>::denorm_min();
  std::vector<T> v;
  for (float f : {0.0f, -0.0f, 1.0f, -1.5f, 3.0f, 1e-3f, 40000.0f, 65504.0f, 65519.0f, 1e33f, 3e38f,
                  -3e38f, std::numeric_limits<float>::min(), tiny, 3 * tiny})
    v.push_back(T(f));
  for (uint16_t b : {0x0001, 0x0003, 0x0400, 0x8001, 0x03ff}) {
    if constexpr (std::is_same_v<T, Half>) v.push_back(half_bits(b));
    if constexpr (std::is_same_v<T, BFloat16>) v.push_back(bf16_bits(b));
  }
  at::manual_seed(11);
  const at::Tensor r = (at::randn({1000}) * 100).to(c10::CppTypeToScalarType<T>::value);
  const T* rp = r.const_data_ptr<T>();
  v.insert(v.end(), rp, rp + r.numel());
  return v;
}

template <typename T>
at::Tensor tensor_of(const std::vector<T>& v, at::Device d) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, c10::CppTypeToScalarType<T>::value);
  std::memcpy(t.data_ptr<T>(), v.data(), v.size() * sizeof(T));
  return t.to(d);
}

template <typename T>
std::vector<T> values_of(const at::Tensor& t) {
  const auto c = t.cpu().contiguous();
  return {c.const_data_ptr<T>(), c.const_data_ptr<T>() + c.numel()};
}

at::Tensor scalar(float v, at::Device d) { return at::full({1}, v, at::device(d)); }

template <typename T>
void check_unscale_kernel(at::Device d) {
  const auto values = edge_values<T>();
  for (float s : {0.5f, 1.0f / 3.0f, 1048576.0f, 65530.0f / 65504.0f, 1.0f}) {
    // All values at once: the stored values match the shared function bit for bit.
    auto t = tensor_of(values, d);
    auto found = at::zeros({1}, at::device(d));
    ops::unscale_check_({t}, found, scalar(s, d));
    const auto out = values_of<T>(t);
    bool any_bad = false;
    for (size_t i = 0; i < values.size(); ++i) {
      bool bad = false;
      const T expected = unscale_is_check(s) ? values[i] : unscale_element(values[i], s, bad);
      if (unscale_is_check(s)) check_element(values[i], bad);
      any_bad |= bad;
      EXPECT_TRUE(same(out[i], expected)) << "s=" << s << " value #" << i;
    }
    EXPECT_EQ(found.item<float>() != 0.0f, any_bad) << "s=" << s;
    // One value at a time, in a vector body (position 17) of finite ones: the flag matches.
    for (size_t i = 0; i < 35; ++i) {
      std::vector<T> one(40, T(1.0f));
      one[17] = values[i];
      auto u = tensor_of(one, d);
      auto f = at::zeros({1}, at::device(d));
      ops::unscale_check_({u}, f, scalar(s, d));
      bool bad = false;
      unscale_element(T(1.0f), s, bad);
      unscale_element(values[i], s, bad);
      EXPECT_EQ(f.item<float>() != 0.0f, bad) << "s=" << s << " value #" << i;
    }
  }
}

template <typename T>
void check_axpby_kernel(at::Device d) {
  const auto xs = edge_values<T>();
  auto ys = xs;
  std::rotate(ys.begin(), ys.begin() + 7, ys.end());
  const std::pair<float, float> coefficients[] = {
      {0.5f, 2.0f}, {1.0f / 3.0f, 1.0f}, {1.0f, -0.1f}, {0.0f, 1.0f}};
  for (const auto& [a, b] : coefficients) {
    auto out =
        at::empty({static_cast<int64_t>(xs.size())}, c10::CppTypeToScalarType<T>::value).to(d);
    auto found = at::zeros({1}, at::device(d));
    ops::axpby_check_({out}, {tensor_of(xs, d)}, {tensor_of(ys, d)}, scalar(a, d), b, found);
    const auto got = values_of<T>(out);
    bool any_bad = false;
    for (size_t i = 0; i < xs.size(); ++i) {
      EXPECT_TRUE(same(got[i], axpby_element(xs[i], ys[i], a, b, any_bad)))
          << "a=" << a << " b=" << b << " value #" << i;
    }
    EXPECT_EQ(found.item<float>() != 0.0f, any_bad) << "a=" << a << " b=" << b;
  }
}

template <typename T>
void check_scale_one_writes_nothing(at::Device d) {
  // Signalling NaNs would come back quiet from a multiply; the read-only pass leaves every bit.
  std::vector<T> v(40, T(2.0f));
  if constexpr (std::is_same_v<T, float>) v[20] = from_bits_f(0x7f800001u);
  if constexpr (std::is_same_v<T, Half>) v[20] = half_bits(0x7c01);
  if constexpr (std::is_same_v<T, BFloat16>) v[20] = bf16_bits(0x7f81);
  v[3] = T(-0.0f);
  auto t = tensor_of(v, d);
  auto found = at::zeros({1}, at::device(d));
  ops::unscale_check_({t}, found, scalar(1.0f, d));
  EXPECT_EQ(found.item<float>(), 1.0f);
  const auto out = values_of<T>(t);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(bits(out[i]), bits(v[i])) << i;
}

void check_kernels(at::Device d) {
  check_unscale_kernel<float>(d);
  check_unscale_kernel<Half>(d);
  check_unscale_kernel<BFloat16>(d);
  check_axpby_kernel<float>(d);
  check_axpby_kernel<Half>(d);
  check_axpby_kernel<BFloat16>(d);
  check_scale_one_writes_nothing<float>(d);
  check_scale_one_writes_nothing<Half>(d);
  check_scale_one_writes_nothing<BFloat16>(d);
}

// Every instruction-set path this CPU can run (ops/cpu/cpu_isa.h), the scalar one included.
TEST(UnscaleMath, CpuKernelsMatchTheSharedFunctionsBitForBit) {
  namespace cpu = ops::detail::cpu;
  const cpu::Isa before = cpu::cpu_isa();
  for (int isa = 0; isa <= static_cast<int>(cpu::best_isa()); ++isa) {
    cpu::set_cpu_isa(static_cast<cpu::Isa>(isa));
    SCOPED_TRACE(cpu::isa_name(cpu::cpu_isa()));
    check_kernels(at::kCPU);
  }
  cpu::set_cpu_isa(before);
}

TEST(UnscaleMath, CudaKernelsMatchTheSharedFunctionsBitForBit_CUDA) {
  OPTAMP_SKIP_WITHOUT_CUDA();
  check_kernels(at::kCUDA);
}

}  // namespace
}  // namespace amp
