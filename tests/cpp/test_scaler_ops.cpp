// The multi-tensor ops (optamp::unscale_check_, axpby_check_, update_scale_): every dtype, odd
// sizes, inf vs NaN vs finite, non-contiguous inputs, argument errors, each on the CPU and on
// CUDA (where a GPU is visible); a CUDA-only test compares the CUDA kernels with the CPU ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "ops/multi_tensor.h"
#include "test_util.h"

namespace amp {
namespace {

// float64 runs torch's own ops in float64 (a parameter kept in double, as torch.amp takes them).
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
const std::vector<int64_t> kSizes = {0, 1, 3, 17, (1 << 20) + 3};
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

at::TensorOptions on(at::Device d) { return at::TensorOptions(at::kFloat).device(d); }

std::vector<at::Tensor> make_list(at::ScalarType dtype, at::Device d) {
  std::vector<at::Tensor> out;
  out.reserve(kSizes.size());
  for (int64_t n : kSizes) out.push_back(at::randn({n}, on(d)).to(dtype));
  return out;
}

at::Tensor flag(at::Device d) { return at::zeros({1}, on(d)); }
at::Tensor scalar(float v, at::Device d) { return at::full({1}, v, on(d)); }

// The dtype the ops compute in: fp32, float64 for float64.
at::ScalarType math_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Reference: the math dtype's product, rounded back to the tensor's dtype.
at::Tensor ref_unscale(const at::Tensor& t, float inv) {
  return (t.to(math_dtype(t.scalar_type())) * inv).to(t.scalar_type());
}

void check_unscale_matches_reference(at::Device d) {
  at::manual_seed(1);
  for (auto dtype : kDtypes) {
    auto list = make_list(dtype, d);
    std::vector<at::Tensor> expected, torch_list;
    for (auto& t : list) {
      expected.push_back(ref_unscale(t, 0.125f));
      torch_list.push_back(t.clone());
    }
    auto found = flag(d);
    ops::unscale_check_(list, found, scalar(0.125f, d));
    EXPECT_EQ(found.item<float>(), 0.0f) << dtype;
    // torch's CUDA unscale dispatches on float and half only (AmpKernels.cu: "not implemented
    // for 'BFloat16'"), which is why GradScaler cannot unscale bf16 gradients on a GPU and
    // optamp has its own kernel: there the reference alone is the judge.
    const bool torch_has_kernel = !(d.is_cuda() && dtype == at::kBFloat16);
    if (torch_has_kernel) {
      auto torch_found = flag(d);
      at::_amp_foreach_non_finite_check_and_unscale_(torch_list, torch_found, scalar(0.125f, d));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(at::equal(list[i], expected[i])) << dtype << " size " << kSizes[i];
      if (torch_has_kernel) {
        EXPECT_TRUE(at::equal(list[i], torch_list[i])) << dtype << " size " << kSizes[i];
      }
    }
  }
}

void check_non_finite_detection(at::Device d) {
  for (auto dtype : kDtypes) {
    for (float bad : {kInf, -kInf, kNaN}) {
      // At the start, in a vector body, and in a scalar tail of the largest tensor.
      for (int64_t pos : {int64_t{0}, int64_t{4097}, (int64_t{1} << 20) + 2}) {
        auto list = make_list(dtype, d);
        list.back()[pos] = bad;
        auto found = flag(d);
        ops::unscale_check_(list, found, scalar(0.5f, d));
        EXPECT_EQ(found.item<float>(), 1.0f) << dtype << " " << bad << " at " << pos;
      }
    }
    // A bad value in a 1-element tensor; and the flag is never reset by a clean call.
    auto list = make_list(dtype, d);
    list[1][0] = kNaN;
    auto found = flag(d);
    ops::unscale_check_(list, found, scalar(1.0f, d));
    EXPECT_EQ(found.item<float>(), 1.0f);
    ops::unscale_check_(make_list(dtype, d), found, scalar(1.0f, d));
    EXPECT_EQ(found.item<float>(), 1.0f);
    // Large finite values are finite.
    auto big = at::full({100}, dtype == at::kHalf ? 65504.0f : 3.0e38f, on(d)).to(dtype);
    auto clean = flag(d);
    ops::unscale_check_({big}, clean, scalar(1.0f, d));
    EXPECT_EQ(clean.item<float>(), 0.0f) << dtype;
  }
}

void check_non_contiguous(at::Device d) {
  at::manual_seed(2);
  for (auto dtype : kDtypes) {
    auto base = at::randn({64, 33}, on(d)).to(dtype);
    auto transposed = base.t();  // dense, not contiguous
    auto strided = at::randn({50, 20}, on(d)).to(dtype).slice(1, 0, 20, 3);  // not dense
    auto exp_t = ref_unscale(transposed, 0.25f);
    auto exp_s = ref_unscale(strided, 0.25f);
    auto found = flag(d);
    ops::unscale_check_({transposed, strided}, found, scalar(0.25f, d));
    EXPECT_TRUE(at::equal(transposed, exp_t)) << dtype;
    EXPECT_TRUE(at::equal(strided, exp_s)) << dtype;
    EXPECT_EQ(found.item<float>(), 0.0f);
    strided[3][2] = kInf;
    ops::unscale_check_({strided}, found, scalar(0.25f, d));
    EXPECT_EQ(found.item<float>(), 1.0f);
  }
}

void check_axpby(at::Device d) {
  at::manual_seed(3);
  for (auto dtype : kDtypes) {
    std::vector<at::Tensor> x, y, expected;
    for (int64_t n : kSizes) {
      x.push_back(at::randn({n}, on(d)).to(dtype));
      y.push_back(at::randn({n}, on(d)).to(dtype));
      const auto m = math_dtype(dtype);
      expected.push_back((x.back().to(m) * 0.25f + y.back().to(m) * 2.0f).to(dtype));
    }
    auto found = flag(d);
    // out aliases x: the in-place accumulation the scaler uses.
    ops::axpby_check_(x, x, y, scalar(0.25f, d), 2.0, found);
    EXPECT_EQ(found.item<float>(), 0.0f);
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_TRUE(at::equal(x[i], expected[i])) << dtype << " size " << kSizes[i];
    }
    // inf in x, NaN in y (through the result) are both caught.
    for (int which = 0; which < 2; ++which) {
      auto xs = make_list(dtype, d), ys = make_list(dtype, d);
      (which == 0 ? xs : ys).back()[12345] = static_cast<double>(which == 0 ? kInf : kNaN);
      auto f = flag(d);
      ops::axpby_check_(xs, xs, ys, scalar(1.0f, d), 1.0, f);
      EXPECT_EQ(f.item<float>(), 1.0f) << dtype << " which=" << which;
    }
    // Different strides among out/x/y go through copies.
    auto xt = at::randn({16, 9}, on(d)).to(dtype).t();
    auto yc = at::randn({9, 16}, on(d)).to(dtype);
    auto out = at::empty({9, 16}, on(d)).to(dtype);
    auto exp = (xt.to(math_dtype(dtype)) * 0.5f + yc.to(math_dtype(dtype))).to(dtype);
    auto f = flag(d);
    ops::axpby_check_({out}, {xt}, {yc}, scalar(0.5f, d), 1.0, f);
    EXPECT_TRUE(at::equal(out, exp)) << dtype;
  }
}

void check_update_scale(at::Device d) {
  auto scale = at::full({}, 8.0f, on(d));
  auto growth = at::zeros({}, at::TensorOptions(at::kInt).device(d));
  auto hyst = at::full({}, 2, at::TensorOptions(at::kInt).device(d));
  auto step = [&](bool overflow) {
    auto f = at::full({1}, overflow ? 1.0f : 0.0f, on(d));
    ops::update_scale_(scale, growth, hyst, f, 2.0, 0.5, /*growth_interval=*/2, /*hysteresis=*/2,
                       /*min_scale=*/2.0, /*max_scale=*/32.0);
    return scale.item<float>();
  };
  EXPECT_EQ(step(false), 8.0f);   // growth 1
  EXPECT_EQ(step(false), 16.0f);  // grows
  EXPECT_EQ(step(true), 16.0f);   // hysteresis 2 -> 1: no backoff yet
  EXPECT_EQ(growth.item<int>(), 0);
  EXPECT_EQ(step(true), 8.0f);  // 1 -> 0: back off
  EXPECT_EQ(step(true), 4.0f);
  EXPECT_EQ(step(true), 2.0f);
  EXPECT_EQ(step(true), 2.0f);  // floor
  EXPECT_EQ(hyst.item<int>(), 0);
  EXPECT_EQ(step(false), 2.0f);
  EXPECT_EQ(step(false), 4.0f);  // growth resets hysteresis
  EXPECT_EQ(hyst.item<int>(), 2);
  for (int i = 0; i < 10; ++i) step(false);
  EXPECT_EQ(scale.item<float>(), 32.0f);  // ceiling
}

// The kernels of each device (CPU, and CUDA where a GPU is visible) against the same reference.
class ScalerOpsOnDevice : public ::testing::TestWithParam<at::DeviceType> {
 protected:
  void SetUp() override { OPTAMP_SKIP_UNLESS_VISIBLE(GetParam()); }
};

TEST_P(ScalerOpsOnDevice, UnscaleMatchesReferenceAndTorchForEveryDtypeAndOddSizes) {
  check_unscale_matches_reference(GetParam());
}
TEST_P(ScalerOpsOnDevice, DetectsInfAndNanButNotLargeFiniteValues) {
  check_non_finite_detection(GetParam());
}
TEST_P(ScalerOpsOnDevice, HandlesNonContiguousTensors) { check_non_contiguous(GetParam()); }
TEST_P(ScalerOpsOnDevice, AxpbyMatchesReferenceAndChecksBothInputs) { check_axpby(GetParam()); }
TEST_P(ScalerOpsOnDevice, UpdateScaleFollowsGrowthBackoffHysteresisAndClamps) {
  check_update_scale(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Devices, ScalerOpsOnDevice, testing::kDevices, testing::on_device);

TEST(ScalerOps, ThreadSplitsLandAnywhereInsideTheTensorList) {
  // The CPU kernels split the list's elements evenly over the threads, so a split can fall in
  // the middle of a tensor, on a boundary, or skip empty tensors: every element must be scaled
  // once and a bad value found wherever it sits, for any thread count.
  const std::vector<int64_t> sizes = {70001, 5, 0, 200000, 65536, 1, 0, 131073};
  const int threads_before = at::get_num_threads();
  for (int threads : {1, 2, 3, 4}) {
    at::set_num_threads(threads);
    at::manual_seed(5);
    std::vector<at::Tensor> list, expected;
    for (int64_t n : sizes) {
      list.push_back(at::randn({n}));
      expected.push_back(ref_unscale(list.back(), 0.25f));
    }
    auto found = flag(at::kCPU);
    ops::unscale_check_(list, found, scalar(0.25f, at::kCPU));
    EXPECT_EQ(found.item<float>(), 0.0f) << threads << " threads";
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(at::equal(list[i], expected[i])) << threads << " threads, tensor " << i;
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      for (int64_t pos : {int64_t{0}, sizes[i] - 1}) {
        if (sizes[i] == 0) continue;
        auto bad = list;  // shares storage: one element poisoned, then restored
        const float kept = bad[i][pos].item<float>();
        bad[i][pos] = kInf;
        auto hit = flag(at::kCPU);
        ops::unscale_check_(bad, hit, scalar(1.0f, at::kCPU));
        EXPECT_EQ(hit.item<float>(), 1.0f) << threads << " threads, tensor " << i << " at " << pos;
        bad[i][pos] = kept;
      }
    }
  }
  at::set_num_threads(threads_before);
}

TEST(ScalerOps, MixedDtypesInOneList) {
  at::manual_seed(4);
  std::vector<at::Tensor> list = {at::randn({5}), at::randn({7}).to(at::kHalf),
                                  at::randn({9}).to(at::kBFloat16), at::randn({3}, at::kDouble)};
  std::vector<at::Tensor> expected;
  expected.reserve(list.size());
  for (auto& t : list) expected.push_back(ref_unscale(t, 0.5f));
  auto found = flag(at::kCPU);
  ops::unscale_check_(list, found, scalar(0.5f, at::kCPU));
  for (size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(at::equal(list[i], expected[i]));
}

TEST(ScalerOps, RejectsBadArgumentsWithValueErrors) {
  auto t = at::randn({4});
  OPTAMP_EXPECT_THROW_WITH(
      ops::unscale_check_({t}, at::zeros({1}, at::kDouble), scalar(1, at::kCPU)), c10::ValueError,
      "found_inf must be a one-element float32 tensor", "Double");
  OPTAMP_EXPECT_THROW_WITH(
      ops::unscale_check_({t.to(at::kInt)}, flag(at::kCPU), scalar(1, at::kCPU)), c10::ValueError,
      "tensors[0] must be float32, float16, bfloat16 or float64", "Int");
  OPTAMP_EXPECT_THROW_WITH(
      ops::axpby_check_({t}, {t, t}, {t}, scalar(1, at::kCPU), 1.0, flag(at::kCPU)),
      c10::ValueError, "same length");
  OPTAMP_EXPECT_THROW_WITH(
      ops::axpby_check_({t}, {at::randn({5})}, {t}, scalar(1, at::kCPU), 1.0, flag(at::kCPU)),
      c10::ValueError, "same shape");
  auto before = t.clone();
  OPTAMP_EXPECT_THROW_WITH(
      ops::unscale_check_({t, t.to(at::kInt)}, flag(at::kCPU), scalar(0.5, at::kCPU)),
      c10::ValueError, "tensors[1]");
  EXPECT_TRUE(at::equal(t, before)) << "validation must precede any mutation";
}

TEST(ScalerOps, CudaMatchesCpuBitwiseAndManyTensorsSpanLaunches_CUDA) {
  OPTAMP_SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  for (auto dtype : kDtypes) {
    // 200 tensors (> 48 per launch) with sizes around the 64Ki chunk boundary and odd offsets.
    std::vector<at::Tensor> cpu, cuda;
    for (int i = 0; i < 200; ++i) {
      const int64_t n = (i % 7 == 0) ? 65536 * 3 + i : 1 + 37 * i;
      auto t = at::randn({n + 1}).to(dtype).slice(0, 1);  // misaligned start
      cpu.push_back(t);
      cuda.push_back(t.to(at::kCUDA));
    }
    auto fc = flag(at::kCPU), fg = flag(at::kCUDA);
    ops::unscale_check_(cpu, fc, scalar(0.0625f, at::kCPU));
    ops::unscale_check_(cuda, fg, scalar(0.0625f, at::kCUDA));
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_TRUE(at::equal(cpu[i], cuda[i].cpu())) << i;
    EXPECT_EQ(fg.item<float>(), 0.0f);
    cuda[150][3] = kInf;
    ops::unscale_check_(cuda, fg, scalar(1.0f, at::kCUDA));
    EXPECT_EQ(fg.item<float>(), 1.0f);
  }
}

}  // namespace
}  // namespace amp
