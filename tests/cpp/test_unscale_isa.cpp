// The CPU kernels' instruction-set paths (ops/cpu/cpu_isa.h): how a path is picked and capped,
// and every vector path this CPU can run against the scalar path, bit for bit, through the ops
// themselves: every dtype, every fp16/bf16 bit pattern, lengths around the vector widths,
// misaligned starts, a tensor split between threads, non-contiguous and mixed-dtype lists, and
// the non-finite flag with one bad value at every position. A path the CPU lacks is skipped (and
// shows as skipped); test_unscale_math.cpp also holds each path to ops/unscale_math.h directly.
#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ops/cpu/cpu_isa.h"
#include "ops/multi_tensor.h"
#include "test_util.h"

namespace amp {
namespace {

using ops::detail::cpu::best_isa;
using ops::detail::cpu::capped_isa;
using ops::detail::cpu::cpu_isa;
using ops::detail::cpu::Isa;
using ops::detail::cpu::isa_name;
using ops::detail::cpu::set_cpu_isa;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kHalf, at::kBFloat16};

// Restores the path the kernels took before.
class UsePath {
 public:
  explicit UsePath(Isa isa) : before_(cpu_isa()) { set_cpu_isa(isa); }
  ~UsePath() { set_cpu_isa(before_); }

 private:
  Isa before_;
};

TEST(CpuIsa, TheVariableCapsThePathAtWhatTheCpuRuns) {
  EXPECT_EQ(capped_isa(nullptr, Isa::kAvx512), Isa::kAvx512);
  EXPECT_EQ(capped_isa("", Isa::kAvx2), Isa::kAvx2);
  EXPECT_EQ(capped_isa("scalar", Isa::kAvx512), Isa::kScalar);
  EXPECT_EQ(capped_isa("AVX2", Isa::kAvx512), Isa::kAvx2);
  EXPECT_EQ(capped_isa("avx512", Isa::kAvx512), Isa::kAvx512);
  // A cap above what the CPU runs leaves the widest path it does run.
  EXPECT_EQ(capped_isa("avx512", Isa::kAvx2), Isa::kAvx2);
  EXPECT_EQ(capped_isa("avx2", Isa::kScalar), Isa::kScalar);
  OPTAMP_EXPECT_THROW_WITH(capped_isa("sse9", Isa::kAvx2), c10::ValueError, "OPTAMP_CPU_ISA",
                           "scalar, avx2, avx512", "got 'sse9'");
  OPTAMP_EXPECT_THROW_WITH(capped_isa("avx512 ", Isa::kAvx2), c10::ValueError, "got 'avx512 '");
}

TEST(CpuIsa, PathsCanBeSwitchedUpToWhatTheCpuRuns) {
  {
    UsePath scalar(Isa::kScalar);
    EXPECT_EQ(cpu_isa(), Isa::kScalar);
  }
  if (best_isa() < Isa::kAvx512) {
    OPTAMP_EXPECT_THROW_WITH(set_cpu_isa(Isa::kAvx512), c10::ValueError, "set_cpu_isa",
                             std::string("at most ") + isa_name(best_isa()), "got avx512");
  }
  UsePath best(best_isa());
  EXPECT_EQ(cpu_isa(), best_isa());
}

// Same bits, or NaN in both (NaN payloads are not part of the contract: conversions differ).
::testing::AssertionResult same_bits(const at::Tensor& actual, const at::Tensor& expected) {
  const auto as_int = actual.scalar_type() == at::kFloat ? at::kInt : at::kShort;
  const auto a = actual.contiguous(), e = expected.contiguous();
  const auto ok = a.view(as_int).eq(e.view(as_int)).logical_or(a.isnan().logical_and(e.isnan()));
  if (ok.all().item<bool>()) return ::testing::AssertionSuccess();
  const int64_t i = ok.logical_not().nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure() << "element " << i << " of " << a.numel() << ": "
                                       << a[i].item<float>() << " vs " << e[i].item<float>();
}

// A copy with the same sizes, strides and offset into a storage of the same size, so copies of
// misaligned or non-contiguous tensors stay so.
at::Tensor copy_layout(const at::Tensor& t) {
  const auto base =
      at::empty({static_cast<int64_t>(t.storage().nbytes()) / t.element_size()}, t.options());
  auto out = base.as_strided(t.sizes(), t.strides(), t.storage_offset());
  out.copy_(t);
  return out;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(copy_layout(t));
  return out;
}

// Runs `op` on its own copy of the inputs with the scalar path and with `isa`; the outputs and
// the flags must agree.
using ListOp = std::function<void(std::vector<at::Tensor>&, at::Tensor& found)>;
void expect_paths_agree(Isa isa, const std::vector<at::Tensor>& inputs, const ListOp& op,
                        const std::string& what) {
  auto by_scalar = copies(inputs), by_isa = copies(inputs);
  auto found_scalar = at::zeros({1}), found_isa = at::zeros({1});
  {
    UsePath path(Isa::kScalar);
    op(by_scalar, found_scalar);
  }
  {
    UsePath path(isa);
    op(by_isa, found_isa);
  }
  EXPECT_EQ(found_isa.item<float>(), found_scalar.item<float>()) << what;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_TRUE(same_bits(by_isa[i], by_scalar[i])) << what << ", tensor " << i;
  }
}

// Every 16-bit pattern (fp16/bf16), or fp32 values over the whole exponent range with subnormals,
// zeros, infinities and NaNs; shuffled.
at::Tensor wild_values(at::ScalarType dtype) {
  if (dtype != at::kFloat) {
    const auto all = at::arange(-32768, 32768, at::kShort).view(dtype);
    return all.index_select(0, at::randperm(all.numel()));
  }
  const int64_t n = 1 << 17;
  auto v = at::randn({n}) * at::pow(2.0, at::randint(-150, 129, {n}, at::kLong).to(at::kFloat));
  for (float special : {kNaN, -kInf, 0.0f, -0.0f}) {
    v.index_put_({at::randint(0, n, {64}, at::kLong)}, special);
  }
  return v;
}

// Pieces of `values` with every length from 0 to 70 (the vector widths are 8 and 16 lanes), a few
// larger ones, and all of it, starting 0-3 elements past an aligned address.
std::vector<at::Tensor> pieces(const at::Tensor& values) {
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 70; ++n) lengths.push_back(n);
  for (int64_t n : {int64_t{127}, int64_t{128}, int64_t{129}, int64_t{1000}, values.numel()}) {
    lengths.push_back(n);
  }
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (int64_t n : lengths) {
    if (start + n > values.numel()) start = 0;
    const int64_t skip = static_cast<int64_t>(out.size() + 1) % 4;
    auto piece = at::empty({skip + n}, values.options()).slice(0, skip);
    out.push_back(piece.copy_(values.slice(0, start, start + n)));
    start += n;
  }
  return out;
}

ListOp unscale_by(float inv_scale) {
  return [inv_scale](std::vector<at::Tensor>& ts, at::Tensor& found) {
    ops::unscale_check_(ts, found, at::full({1}, inv_scale));
  };
}

// axpby over tensors [0, n/3) as out, [n/3, 2n/3) as x, the rest as y (same lengths), plus the
// same with out aliasing x.
ListOp axpby_by(float a, float b) {
  return [a, b](std::vector<at::Tensor>& ts, at::Tensor& found) {
    const size_t third = ts.size() / 3;
    std::vector<at::Tensor> out(ts.begin(), ts.begin() + third);
    std::vector<at::Tensor> x(ts.begin() + third, ts.begin() + 2 * third);
    std::vector<at::Tensor> y(ts.begin() + 2 * third, ts.begin() + 3 * third);
    ops::axpby_check_(out, x, y, at::full({1}, a), b, found);
    ops::axpby_check_(x, x, y, at::full({1}, b), a, found);
  };
}

const float kScales[] = {0.5f, 2.0f, 1.0f / 3.0f, 1048576.0f, 65530.0f / 65504.0f, 3e-39f, 1.0f};

void expect_wild_values_agree(Isa isa, at::ScalarType dtype) {
  const auto list = pieces(wild_values(dtype));
  for (float s : kScales) {
    expect_paths_agree(isa, list, unscale_by(s), c10::str("unscale s=", s));
  }
  std::vector<at::Tensor> triple;
  for (int k = 0; k < 3; ++k) {
    for (const auto& t : k == 0 ? list : pieces(wild_values(dtype))) triple.push_back(t);
  }
  for (auto [a, b] : {std::pair{0.5f, 2.0f}, {1.0f / 3.0f, 1.0f}, {0.0f, 1.0f}, {1.0f, -0.1f}}) {
    expect_paths_agree(isa, triple, axpby_by(a, b), c10::str("axpby a=", a, " b=", b));
  }
}

// Finite values leave the flag clear; one bad value at any position of lengths around the vector
// widths sets it: inf or NaN (also for the read-only check of a scale of 1.0), or a finite value
// out of range once unscaled.
bool flags(const at::Tensor& t, float inv_scale) {
  auto found = at::zeros({1});
  ops::unscale_check_({t.clone()}, found, at::full({1}, inv_scale));
  return found.item<float>() != 0.0f;
}

void expect_flag_at_every_position(Isa isa, at::ScalarType dtype) {
  UsePath path(isa);
  for (int64_t n : {7, 16, 17, 33, 47}) {
    const auto clean = (at::randn({n}) * 100).to(dtype);
    EXPECT_FALSE(flags(clean, 0.5f)) << n;
    EXPECT_FALSE(flags(clean, 1.0f)) << n;
    for (int64_t i = 0; i < n; ++i) {
      for (float bad : {kInf, -kInf, kNaN}) {
        auto t = clean.clone();
        t[i] = bad;
        EXPECT_TRUE(flags(t, 0.5f)) << "n=" << n << " " << bad << " at " << i;
        EXPECT_TRUE(flags(t, 1.0f)) << "n=" << n << " " << bad << " at " << i << " (check only)";
      }
      auto t = clean.clone();
      t[i] = 6e4f;  // finite in every dtype, not once multiplied by 1e34
      EXPECT_FALSE(flags(t, 1.0f)) << "n=" << n << " at " << i;
      EXPECT_TRUE(flags(t, 1e34f)) << "n=" << n << " at " << i;
    }
  }
}

// One tensor larger than two threads' minimum share, non-contiguous tensors (the ops go through
// dense copies), and dtypes mixed in one list (the ops group them).
void expect_split_and_strided_lists_agree(Isa isa) {
  std::vector<at::Tensor> list;
  for (auto dtype : kDtypes) {
    list.push_back((at::randn({(1 << 17) + 5}) * 10).to(dtype));
    list.push_back((at::randn({37, 19}) * 10).to(dtype).t());
    list.push_back((at::randn({3, 41}) * 10).to(dtype).slice(1, 0, 41, 2));
  }
  list[0][(1 << 16) + 3] = kNaN;  // in the second thread's share
  for (float s : {0.25f, 1.0f}) expect_paths_agree(isa, list, unscale_by(s), "mixed list");
}

void expect_path_matches_scalar(Isa isa) {
  if (best_isa() < isa) {
    GTEST_SKIP() << "this CPU cannot run the " << isa_name(isa)
                 << " path (best: " << isa_name(best_isa()) << ")";
  }
  at::manual_seed(19);
  for (auto dtype : kDtypes) {
    SCOPED_TRACE(::testing::Message() << isa_name(isa) << " " << dtype);
    expect_wild_values_agree(isa, dtype);
    expect_flag_at_every_position(isa, dtype);
  }
  expect_split_and_strided_lists_agree(isa);
}

TEST(CpuIsa, Avx2PathMatchesTheScalarPathBitForBit) { expect_path_matches_scalar(Isa::kAvx2); }

TEST(CpuIsa, Avx512PathMatchesTheScalarPathBitForBit) { expect_path_matches_scalar(Isa::kAvx512); }

}  // namespace
}  // namespace amp
