// The CPU kernels' instruction-set paths (ops/cpu/cpu_isa.h): how a path is picked and capped,
// and every vector path this CPU can run against the scalar path, bit for bit, through the ops
// themselves: every dtype, every fp16/bf16 bit pattern, lengths around the vector widths,
// misaligned starts, a tensor split between threads, non-contiguous and mixed-dtype lists, and
// the non-finite flag with one bad value at every position. A path the CPU lacks is skipped (and
// shows as skipped); test_unscale_math.cpp also holds each path to ops/unscale_math.h directly.
// The AVX-512 loops also run on every CPU under SIMDe's emulation of the intrinsics
// (avx512_emulated.cpp), called directly rather than through the ops, with the same inputs.
#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "avx512_emulated.h"
#include "ops/cpu/cpu_isa.h"
#include "ops/multi_tensor.h"
#include "ops/unscale_math.h"
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

// Runs `tested` and `reference` each on its own copy of the inputs; the outputs and the flags
// must agree.
using ListOp = std::function<void(std::vector<at::Tensor>&, at::Tensor& found)>;
void expect_ops_agree(const std::vector<at::Tensor>& inputs, const ListOp& reference,
                      const ListOp& tested, const std::string& what) {
  auto by_reference = copies(inputs), by_tested = copies(inputs);
  auto found_reference = at::zeros({1}), found_tested = at::zeros({1});
  reference(by_reference, found_reference);
  tested(by_tested, found_tested);
  EXPECT_EQ(found_tested.item<float>(), found_reference.item<float>()) << what;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_TRUE(same_bits(by_tested[i], by_reference[i])) << what << ", tensor " << i;
  }
}

// `op` run with the kernels of `isa`.
ListOp on_path(Isa isa, ListOp op) {
  return [isa, op](std::vector<at::Tensor>& ts, at::Tensor& found) {
    UsePath path(isa);
    op(ts, found);
  };
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

// A set of kernels as the checks below use them: an unscale (a check only for a scale of 1.0) and
// an axpby over lists.
struct KernelSet {
  std::function<ListOp(float inv_scale)> unscale;
  std::function<ListOp(float a, float b)> axpby;
};

// The ops, with the kernels of `isa`.
KernelSet through_ops(Isa isa) {
  return {[isa](float s) { return on_path(isa, unscale_by(s)); },
          [isa](float a, float b) { return on_path(isa, axpby_by(a, b)); }};
}

// The emulated AVX-512 loops (avx512_emulated.h), called on each (contiguous) tensor as the ops'
// CPU kernels call the loops of the path they run.
template <typename T>
T* data(at::Tensor& t, const ops::detail::cpu::Kernels<T>& /*deduces T*/) {
  return static_cast<T*>(t.data_ptr());
}

template <typename Body>
bool with_emulated_kernels(at::ScalarType dtype, Body body) {
  if (dtype == at::kFloat) return body(test::emulated_avx512_kernels<float>());
  if (dtype == at::kHalf) return body(test::emulated_avx512_kernels<c10::Half>());
  return body(test::emulated_avx512_kernels<c10::BFloat16>());
}

KernelSet emulated_avx512() {
  auto unscale = [](float s) -> ListOp {
    return [s](std::vector<at::Tensor>& ts, at::Tensor& found) {
      bool bad = false;
      for (auto& t : ts) {
        bad |= with_emulated_kernels(t.scalar_type(), [&](auto k) {
          auto* p = data(t, k);
          return ops::detail::unscale_is_check(s) ? k.check(p, t.numel())
                                                  : k.unscale(p, t.numel(), s);
        });
      }
      if (bad) found.fill_(1.0);
    };
  };
  auto axpby = [](float a, float b) -> ListOp {  // the tensors as axpby_by splits them
    return [a, b](std::vector<at::Tensor>& ts, at::Tensor& found) {
      const size_t third = ts.size() / 3;
      bool bad = false;
      for (auto [x_is_out, va, vb] : {std::tuple{false, a, b}, {true, b, a}}) {
        for (size_t i = 0; i < third; ++i) {
          at::Tensor &x = ts[third + i], &y = ts[2 * third + i];
          at::Tensor& out = x_is_out ? x : ts[i];
          // Structured bindings are captured by name only from C++20 (Clang refuses it in C++17).
          bad |= with_emulated_kernels(out.scalar_type(), [&, va = va, vb = vb](auto k) {
            return k.axpby(data(out, k), data(x, k), data(y, k), out.numel(), va, vb);
          });
        }
      }
      if (bad) found.fill_(1.0);
    };
  };
  return {unscale, axpby};
}

const float kScales[] = {0.5f, 2.0f, 1.0f / 3.0f, 1048576.0f, 65530.0f / 65504.0f, 3e-39f, 1.0f};

void expect_wild_values_agree(const KernelSet& tested, at::ScalarType dtype) {
  const KernelSet reference = through_ops(Isa::kScalar);
  const auto list = pieces(wild_values(dtype));
  for (float s : kScales) {
    expect_ops_agree(list, reference.unscale(s), tested.unscale(s), c10::str("unscale s=", s));
  }
  std::vector<at::Tensor> triple;
  for (int k = 0; k < 3; ++k) {
    for (const auto& t : k == 0 ? list : pieces(wild_values(dtype))) triple.push_back(t);
  }
  for (auto [a, b] : {std::pair{0.5f, 2.0f}, {1.0f / 3.0f, 1.0f}, {0.0f, 1.0f}, {1.0f, -0.1f}}) {
    expect_ops_agree(triple, reference.axpby(a, b), tested.axpby(a, b),
                     c10::str("axpby a=", a, " b=", b));
  }
}

// Finite values leave the flag clear; one bad value at any position of lengths around the vector
// widths sets it: inf or NaN (also for the read-only check of a scale of 1.0), or a finite value
// out of range once unscaled.
bool flags(const KernelSet& kernels, const at::Tensor& t, float inv_scale) {
  auto found = at::zeros({1});
  std::vector<at::Tensor> list{t.clone()};
  kernels.unscale(inv_scale)(list, found);
  return found.item<float>() != 0.0f;
}

void expect_flag_at_every_position(const KernelSet& kernels, at::ScalarType dtype) {
  for (int64_t n : {7, 16, 17, 33, 47}) {
    const auto clean = (at::randn({n}) * 100).to(dtype);
    EXPECT_FALSE(flags(kernels, clean, 0.5f)) << n;
    EXPECT_FALSE(flags(kernels, clean, 1.0f)) << n;
    for (int64_t i = 0; i < n; ++i) {
      for (float bad : {kInf, -kInf, kNaN}) {
        auto t = clean.clone();
        t[i] = bad;
        EXPECT_TRUE(flags(kernels, t, 0.5f)) << "n=" << n << " " << bad << " at " << i;
        EXPECT_TRUE(flags(kernels, t, 1.0f))
            << "n=" << n << " " << bad << " at " << i << " (check only)";
      }
      auto t = clean.clone();
      t[i] = 6e4f;  // finite in every dtype, not once multiplied by 1e34
      EXPECT_FALSE(flags(kernels, t, 1.0f)) << "n=" << n << " at " << i;
      EXPECT_TRUE(flags(kernels, t, 1e34f)) << "n=" << n << " at " << i;
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
  for (float s : {0.25f, 1.0f}) {
    expect_ops_agree(list, on_path(Isa::kScalar, unscale_by(s)), on_path(isa, unscale_by(s)),
                     "mixed list");
  }
}

void expect_path_matches_scalar(Isa isa) {
  if (best_isa() < isa) {
    GTEST_SKIP() << "this CPU cannot run the " << isa_name(isa)
                 << " path (best: " << isa_name(best_isa()) << ")";
  }
  at::manual_seed(19);
  for (auto dtype : kDtypes) {
    SCOPED_TRACE(::testing::Message() << isa_name(isa) << " " << dtype);
    expect_wild_values_agree(through_ops(isa), dtype);
    expect_flag_at_every_position(through_ops(isa), dtype);
  }
  expect_split_and_strided_lists_agree(isa);
}

TEST(CpuIsa, Avx2PathMatchesTheScalarPathBitForBit) { expect_path_matches_scalar(Isa::kAvx2); }

TEST(CpuIsa, Avx512PathMatchesTheScalarPathBitForBit) { expect_path_matches_scalar(Isa::kAvx512); }

// The same loops on every CPU, their intrinsics emulated: what keeps the AVX-512 code checked on
// machines without AVX-512 (most of this project's). Splitting lists and dense copies are the ops'
// and are checked above on the paths the CPU runs.
TEST(CpuIsa, EmulatedAvx512LoopsMatchTheScalarPathBitForBit) {
  if (!test::emulated_avx512_available()) {
    GTEST_SKIP() << "built without SIMDe (Debian: libsimde-dev, which scripts/bootstrap.sh "
                    "installs): the AVX-512 loops cannot be emulated";
  }
  at::manual_seed(19);
  for (auto dtype : kDtypes) {
    SCOPED_TRACE(::testing::Message() << "emulated avx512 " << dtype);
    expect_wild_values_agree(emulated_avx512(), dtype);
    expect_flag_at_every_position(emulated_avx512(), dtype);
  }
}

}  // namespace
}  // namespace amp
