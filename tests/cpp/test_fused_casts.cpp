// Casts done by a fused replacement instead of a cast and the op (unboxed_kernels.cpp, Fused<Op>):
// the cast path's values and gradients (bit for bit on the CPU; within the reduced dtype's
// rounding on CUDA, where one kernel does the work), with fewer passes over the activation.
//
// Apex's fp32 GELU through optamp::widened_gelu (ops/widened_gelu.h): one node in the graph, and
// the reduced copy of the result handed to the next lower op.
// Apex's fp32 cross_entropy of reduced logits: log_softmax reads the reduced logits and writes
// fp32 instead of widening them first (optamp's widened_log_softmax, ops/widened_softmax.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/companion_casts.h"
#include "casting_test.h"
#include "common/step_events.h"
#include "ops/fused_cross_entropy.h"
#include "ops/gelu_math.h"
#include "ops/softmax_math.h"
#include "ops/widened_softmax.h"
#include "optamp/autocast.h"
#include "optamp/forward.h"
#include "test_util.h"

namespace amp {
namespace {

using testing::Casting;

TEST(GeluMath, MatchesTorchsFp32Gelu) {
  const auto x = at::linspace(-10, 10, 20001, at::kFloat);
  const auto g = at::linspace(-3, 3, 20001, at::kFloat);
  for (const bool tanh : {false, true}) {
    const char* approximate = tanh ? "tanh" : "none";
    const auto y = at::empty_like(x);
    const auto dx = at::empty_like(x);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float v = x[i].item<float>();
      y[i] = ops::detail::gelu_forward_math(v, tanh);
      dx[i] = ops::detail::gelu_backward_math(g[i].item<float>(), v, tanh);
    }
    // The erf form loses digits to cancellation in the left tail (1 + erf(x) for x < -3), where
    // CPU's vectorized erf and the scalar one differ by ~1e-6 absolute: a formula error would not.
    EXPECT_TRUE(testing::all_close(y, at::gelu(x, approximate), {1e-5, 1e-5})) << approximate;
    EXPECT_TRUE(testing::all_close(dx, at::gelu_backward(g, x, approximate), {1e-5, 1e-5}))
        << approximate;
  }
}

// How the CUDA kernels' 16-byte loads split a row (ops::detail::RowPacks): the head, the packs
// and the tail cover the row once, in order; the packs start on a 16-byte boundary; every element
// goes to a lane of the block, the head's and the tail's one per lane.
TEST(SoftmaxMath, RowPacksCoverARowOnceFromA16ByteBoundary) {
  for (const int64_t vec : {4, 8}) {
    for (int64_t shift = 0; shift < vec; ++shift) {
      for (const int64_t cols : {1, 3, 7, 8, 9, 33, 300, 50257}) {
        const ops::detail::RowPacks split(cols, shift, vec);
        const std::string at = "vec " + std::to_string(vec) + ", shift " + std::to_string(shift) +
                               ", cols " + std::to_string(cols);
        EXPECT_GE(split.head, 0) << at;
        EXPECT_LT(split.head, vec) << at;
        EXPECT_EQ(split.tail_start, split.head + split.packs * vec) << at;
        EXPECT_LE(split.tail_start, cols) << at;
        EXPECT_LT(cols - split.tail_start, vec) << at;
        if (split.packs > 0) EXPECT_EQ((shift + split.head) % vec, 0) << at;
        if (split.head < cols) EXPECT_EQ(split.head, shift == 0 ? 0 : vec - shift) << at;
        for (const int64_t threads : {32, 512}) {
          std::vector<int64_t> per_lane(threads, 0);
          for (int64_t i = 0; i < cols; ++i) {
            const int64_t lane = split.lane_of(i, threads, vec);
            ASSERT_GE(lane, 0) << at;
            ASSERT_LT(lane, threads) << at;
            ++per_lane[lane];
          }
          // Lane 0 takes pack 0, so at most ceil(packs / threads) packs plus a head and a tail.
          const int64_t most = (split.packs + threads - 1) / threads * vec + 2;
          EXPECT_LE(*std::max_element(per_lane.begin(), per_lane.end()), most) << at;
        }
      }
    }
  }
}

// The walk every pass of the CUDA kernels makes over a row (ops::detail::for_each_pack), run on
// the CPU for every lane: each element is visited once, by the lane RowPacks::lane_of names, in
// ascending order within a lane, and each pack is used with what was loaded for it.
template <int kVec, int kInFlight>
void expect_the_walk_covers_rows() {
  for (int64_t shift = 0; shift < kVec; ++shift) {
    for (const int64_t cols : {1, 3, 7, 9, 37, 300, 1024, 1025, 50257}) {
      for (const int64_t lanes : {32, 160, 512}) {
        const ops::detail::RowPacks split(cols, shift, kVec);
        const std::string at = "vec " + std::to_string(kVec) + ", in flight " +
                               std::to_string(kInFlight) + ", shift " + std::to_string(shift) +
                               ", cols " + std::to_string(cols) + ", lanes " +
                               std::to_string(lanes);
        std::vector<int> visits(cols, 0);
        std::vector<int64_t> owner(cols, -1);
        bool in_order = true;
        for (int64_t lane = 0; lane < lanes; ++lane) {
          int64_t last = -1;
          const auto visit = [&](int64_t i) {
            in_order = in_order && i > last;
            last = i;
            ++visits[i];
            owner[i] = lane;
          };
          ops::detail::for_each_pack<kVec, kInFlight>(
              split, cols, ops::detail::Lanes{lane, lanes}, visit, [](int64_t i) { return i; },
              [&](int64_t i, int64_t loaded) {
                EXPECT_EQ(loaded, i) << at;
                for (int64_t j = 0; j < kVec; ++j) visit(i + j);
              });
        }
        EXPECT_TRUE(in_order) << at;
        for (int64_t i = 0; i < cols; ++i) {
          ASSERT_EQ(visits[i], 1) << at << ", element " << i;
          ASSERT_EQ(owner[i], split.lane_of(i, lanes, kVec)) << at << ", element " << i;
        }
      }
    }
  }
}

TEST(SoftmaxMath, ThePackWalkVisitsEveryElementOnceByItsLane) {
  expect_the_walk_covers_rows<4, 2>();  // fp32 rows, two packs in flight (the backward)
  expect_the_walk_covers_rows<4, 4>();  // fp32 rows, four (the forward's elementwise pass)
  expect_the_walk_covers_rows<8, 4>();  // 16-byte packs of bf16 (the reductions)
}

// A pack's elements added at once (RowLogSumExp::add_pack, the reductions' way) give what they give
// added one by one, within fp32's rounding, the values torch treats specially among them: a pack of
// only -inf adds nothing (also to an empty part), a NaN or +inf anywhere turns the sum NaN (also
// beside -inf), a later pack's larger maximum rescales the sum.
TEST(SoftmaxMath, APackAddsWhatItsElementsAddOneByOne) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  using Pack = std::array<float, 4>;
  const std::vector<std::vector<Pack>> rows = {
      {{1, 2, 3, 4}, {10, -3, 0.5f, 7}, {-20, 30, 1, 2}},  // the maximum grows twice
      {{-kInf, -kInf, -kInf, -kInf}, {1, -kInf, 2, 0}},    // nothing, then a part
      {{-kInf, -kInf, -kInf, -kInf}},                      // only -inf: the empty part
      {{-kInf, kNaN, -kInf, -kInf}, {1, 2, 3, 4}},         // NaN beside -inf: NaN
      {{1, 2, kNaN, 4}, {5, 6, 7, 8}},                     // NaN: NaN
      {{1, 2, 3, 4}, {5, kInf, 7, 8}},                     // +inf: NaN
      {{1e4f, 1e4f + 1, -1e4f, 0}, {3, 2, 1, 0}},          // large values: the maximum matters
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    auto by_pack = ops::detail::RowLogSumExp::empty();
    auto one_by_one = ops::detail::RowLogSumExp::empty();
    for (const Pack& pack : rows[r]) {
      float values[4];
      std::copy(pack.begin(), pack.end(), values);
      by_pack.add_pack(values);
      for (const float v : pack) one_by_one.add(v);
    }
    const std::string row = "row " + std::to_string(r);
    EXPECT_EQ(std::isnan(by_pack.sum), std::isnan(one_by_one.sum)) << row;
    if (std::isnan(one_by_one.sum)) continue;
    EXPECT_EQ(by_pack.max, one_by_one.max) << row;
    EXPECT_NEAR(by_pack.sum, one_by_one.sum, 1e-6 * one_by_one.sum) << row;
  }
}

// fused_cross_entropy's CUDA math (ops::detail::cross_entropy_backward_math, from a row's merged
// log-sum-exp as the kernels gather it): the gradient of cross_entropy's logits is torch's fp32
// log_softmax backward of nll_loss's gradient, within fp32's rounding; an ignored row's (grad 0)
// is zero, or NaN where the row holds a NaN, as torch's.
TEST(SoftmaxMath, TheCrossEntropyGradientIsTorchsLogSoftmaxBackwardOfNllLoss) {
  const int64_t cols = 300;
  auto x = at::randn({6, cols}) * 8;
  x[1] = x[1] + 1e4;
  x[4][9] = std::numeric_limits<float>::quiet_NaN();
  const auto target = at::randint(cols, {6}, at::kLong);
  target[4] = -100;  // ignored, with a NaN in its row
  target[5] = -100;
  const auto g = at::rand({6}) + 0.5;
  const auto log_probs = at::_log_softmax(x, 1, false);
  const auto nll_grad = at::zeros_like(x).scatter_(
      1, target.clamp_min(0).unsqueeze(1), (-g * (target != -100).to(at::kFloat)).unsqueeze(1));
  const auto want = at::_log_softmax_backward_data(nll_grad, log_probs, 1, at::kFloat);
  auto got = at::empty_like(x);
  for (int64_t r = 0; r < x.size(0); ++r) {
    auto row = ops::detail::RowLogSumExp::empty();
    for (int64_t i = 0; i < cols; ++i) row.add(x[r][i].item<float>());
    const int64_t t = target[r].item<int64_t>();
    const float grad = t == -100 ? 0.0f : g[r].item<float>();
    for (int64_t i = 0; i < cols; ++i) {
      got[r][i] = ops::detail::cross_entropy_backward_math(x[r][i].item<float>(), row.max,
                                                           std::log(row.sum), i == t, grad);
    }
  }
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-7, /*equal_nan=*/true));
  EXPECT_TRUE(got[4].isnan().all().item<bool>());
  EXPECT_TRUE(got[5].eq(0).all().item<bool>());
}

// Where a block-per-row forward keeps its row in shared memory (ops::detail::kept_row_bytes): the
// row and one 16-byte pack more (the row is kept at its offset into a pack), only where two such
// blocks fit an SM. The limits are cudaDeviceProp's of an H100/H200 and of an A100, and the
// kernels' 128 bytes of static shared memory.
TEST(SoftmaxMath, AForwardKeepsItsRowInSharedMemoryWhereTwoBlocksFitAnSm) {
  const ops::detail::SharedMemoryLimits hopper{232448, 233472, 1024, 128};
  const ops::detail::SharedMemoryLimits a100{166912, 167936, 1024, 128};
  EXPECT_EQ(ops::detail::kept_row_bytes(50257, 2, 2, hopper), 50257 * 2 + 16);  // GPT-2's logits
  EXPECT_EQ(ops::detail::kept_row_bytes(50257, 2, 2, a100), 0);  // 2 x 101.7 KB > 164 KB
  EXPECT_EQ(ops::detail::kept_row_bytes(40000, 2, 2, a100), 40000 * 2 + 16);
  EXPECT_EQ(ops::detail::kept_row_bytes(2048, 4, 2, hopper), 2048 * 4 + 16);
  // The largest row two blocks hold on a Hopper SM: (233472 / 2 - 1024 - 128 - 16) / 2 elements.
  const int64_t largest = (233472 / 2 - 1024 - 128 - 16) / 2;
  EXPECT_GT(ops::detail::kept_row_bytes(largest, 2, 2, hopper), 0);
  EXPECT_EQ(ops::detail::kept_row_bytes(largest + 1, 2, 2, hopper), 0);
  // One block an SM may take more, up to the opt-in limit of a block.
  EXPECT_GT(ops::detail::kept_row_bytes(100000, 2, 1, hopper), 0);
  EXPECT_EQ(ops::detail::kept_row_bytes(120000, 2, 1, hopper), 0);  // 240 KB > 227 KB
}

// The CUDA kernels' row math, log_softmax's and softmax's: each of `threads` lanes gathers its part
// of the row as the kernels' 16-byte loads split it, the parts merge pairwise as the warp shuffles
// and the block's second round merge them. Rows with the values torch treats specially are among
// them.
TEST(SoftmaxMath, MergedPartsMatchTorchsFp32Kernels) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t cols = 300;
  auto x = at::randn({8, cols}) * 8;
  x[1] = x[1] + 1e4;                                      // large values: the maximum matters
  x[2].index_put_({at::indexing::Slice(0, 200)}, -kInf);  // masked entries (the first lanes')
  x[3] = -kInf;                                           // a row of only -inf: NaN
  x[4][7] = kInf;                                         // +inf: NaN row
  x[5][250] = std::numeric_limits<float>::quiet_NaN();
  x[6][0] = -kInf;
  const auto g = at::randn({8, cols});
  const auto want = at::_log_softmax(x, 1, false);
  const auto want_grad = at::_log_softmax_backward_data(g, want, 1, at::kFloat);
  const auto want_soft = at::_softmax(x, 1, false);
  const auto want_soft_grad = at::_softmax_backward_data(g, want_soft, 1, at::kFloat);
  auto got = at::empty_like(x);
  auto got_grad = at::empty_like(x);
  auto got_soft = at::empty_like(x);
  auto got_soft_grad = at::empty_like(x);
  // The CUDA kernels' lanes (ops::detail::RowPacks): bf16 logits 8 to a 16-byte pack, fp32
  // gradients 4, the row starting `shift` elements past a 16-byte boundary.
  for (const auto& [threads, shift] :
       std::vector<std::pair<int, int>>{{32, 0}, {32, 3}, {96, 7}, {96, 1}, {1024, 5}}) {
    const ops::detail::RowPacks logits(cols, shift, 8);
    const ops::detail::RowPacks grads(cols, shift % 4, 4);
    for (int64_t r = 0; r < x.size(0); ++r) {
      std::vector<ops::detail::RowLogSumExp> parts(threads, ops::detail::RowLogSumExp::empty());
      const auto row_values = x[r].contiguous();
      const float* values = row_values.const_data_ptr<float>();
      for (int64_t lane = 0; lane < threads; ++lane) {  // as the reductions walk a row: by packs
        auto& part = parts[lane];
        ops::detail::for_each_pack<8, 4>(
            logits, cols, ops::detail::Lanes{lane, threads},
            [&](int64_t i) { part.add(values[i]); }, [](int64_t i) { return i; },
            [&](int64_t i, int64_t) {
              float pack[8];
              std::copy(values + i, values + i + 8, pack);
              part.add_pack(pack);
            });
      }
      std::vector<float> grad_parts(threads, 0.0f);
      std::vector<float> dot_parts(threads, 0.0f);  // softmax's: grad * out
      for (int64_t i = 0; i < cols; ++i) {
        grad_parts[grads.lane_of(i, threads, 4)] += g[r][i].item<float>();
        dot_parts[grads.lane_of(i, threads, 4)] +=
            g[r][i].item<float>() * want_soft[r][i].item<float>();
      }
      for (int width = 1; width < threads; width *= 2) {  // a tree, as the shuffles merge
        for (int lane = 0; lane + width < threads; lane += 2 * width) {
          parts[lane].merge(parts[lane + width]);
          grad_parts[lane] += grad_parts[lane + width];
          dot_parts[lane] += dot_parts[lane + width];
        }
      }
      const auto row = parts[0];
      const float log_sum = std::log(row.sum);
      for (int64_t i = 0; i < cols; ++i) {
        got[r][i] = ops::detail::log_softmax_math(x[r][i].item<float>(), row.max, log_sum);
        got_grad[r][i] = ops::detail::log_softmax_backward_math(
            g[r][i].item<float>(), want[r][i].item<float>(), grad_parts[0]);
        got_soft[r][i] = ops::detail::softmax_math(x[r][i].item<float>(), row.max, row.sum);
        got_soft_grad[r][i] = ops::detail::softmax_backward_math(
            g[r][i].item<float>(), want_soft[r][i].item<float>(), dot_parts[0]);
      }
    }
    const std::string with = std::to_string(threads) + " lanes, shift " + std::to_string(shift);
    EXPECT_TRUE(at::equal(got.isnan(), want.isnan())) << with;
    EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-5, /*equal_nan=*/true)) << with;
    EXPECT_TRUE(at::allclose(got_grad, want_grad, 1e-6, 1e-5, /*equal_nan=*/true)) << with;
    EXPECT_TRUE(at::equal(got_soft.isnan(), want_soft.isnan())) << "softmax, " << with;
    EXPECT_TRUE(at::allclose(got_soft, want_soft, 1e-6, 1e-7, /*equal_nan=*/true))
        << "softmax, " << with;
    // softmax's backward subtracts the row's sum of grad * out from each gradient (out * (g -
    // sum)), so where one element dominates a row the result is a small difference of values the
    // size of the gradient (about 1 here): a different summation order moves it by a few of their
    // ulps (up to 2.4e-7 seen over 300 random rows), not of the result's.
    EXPECT_TRUE(at::allclose(got_soft_grad, want_soft_grad, 1e-5, 1e-6, /*equal_nan=*/true))
        << "softmax, " << with;
  }
}

// The companion of a result is served for that result while it is alive and unchanged, in the
// companion's dtype only; the ring keeps the last four offered.
TEST(CompanionCasts, ServedForTheLiveUnchangedSourceOnly) {
  detail::drop_companions();
  auto source = at::randn({3});
  const auto copy = source.to(at::kHalf);
  detail::offer_companion(source, copy);
  ASSERT_TRUE(detail::find_companion(source, at::kHalf));
  EXPECT_TRUE(detail::find_companion(source, at::kHalf)->is_same(copy));
  EXPECT_FALSE(detail::find_companion(source, at::kBFloat16));
  EXPECT_FALSE(detail::find_companion(source.view({3}), at::kHalf));  // another tensor
  source.add_(1.0);                                                   // a new version
  EXPECT_FALSE(detail::find_companion(source, at::kHalf));

  auto kept = at::randn({2});
  detail::offer_companion(kept, kept.to(at::kHalf));
  for (int i = 0; i < 4; ++i) {
    const auto other = at::randn({2});
    detail::offer_companion(other, other.to(at::kHalf));
  }
  EXPECT_FALSE(detail::find_companion(kept, at::kHalf));  // pushed out by four newer ones
  detail::drop_companions();
}

// Once an op has taken a companion the ring holds it weakly: it is served again while the op keeps
// it, and nothing of it stays alive once the op lets go (a thread with no step end, such as the
// autograd engine's device threads recomputing checkpointed forwards, kept up to four activation
// copies until process exit). A copy modified through a view is not served again.
TEST(CompanionCasts, ATakenCopyLivesOnlyWhileItsUsersHoldIt) {
  detail::drop_companions();
  const auto source = at::randn({3});
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> copy_ref;
  {
    const auto copy = source.to(at::kHalf);
    copy_ref.emplace(copy.getIntrusivePtr());
    detail::offer_companion(source, copy);
  }
  EXPECT_FALSE(copy_ref->expired()) << "the ring is the copy's only owner until it is taken";
  {
    const auto taken = detail::find_companion(source, at::kHalf);
    ASSERT_TRUE(taken);
    const auto again = detail::find_companion(source, at::kHalf);  // while the first user holds it
    ASSERT_TRUE(again);
    EXPECT_TRUE(again->is_same(*taken));
  }
  EXPECT_TRUE(copy_ref->expired()) << "the ring kept a taken copy alive";
  EXPECT_FALSE(detail::find_companion(source, at::kHalf));

  detail::offer_companion(source, source.to(at::kHalf));
  const auto taken = detail::find_companion(source, at::kHalf);
  ASSERT_TRUE(taken);
  taken->view({3}).mul_(2);  // the copy changes through a view
  EXPECT_FALSE(detail::find_companion(source, at::kHalf));
  detail::drop_companions();
}

// A companion with autograd history (a model boundary's reduced output, a widened GELU's reduced
// result) is served with its gradient edge while the result it was offered for is alive, but the
// ring does not keep the graph that made it: a forward whose output is dropped frees its graph, its
// saved activations and the parameters' grad accumulators at once, as natively (a CUDA graph
// captured after such a forward must not find its accumulators; a validation loop without no_grad
// must not hold its last graphs until the next step).
TEST(CompanionCasts, HoldTheirValuesNotTheGraphThatMadeThem) {
  detail::drop_companions();
  const auto x = at::randn({3}).requires_grad_();
  std::weak_ptr<torch::autograd::Node> node;
  std::weak_ptr<torch::autograd::Node> accumulator;
  {
    const auto reduced = (x * 2).to(at::kHalf);  // the model's output
    const auto wide = reduced.to(at::kFloat);    // the boundary's
    detail::offer_companion(wide, reduced, /*exact=*/true);
    node = reduced.grad_fn();
    accumulator = torch::autograd::impl::try_get_grad_accumulator(x);
    ASSERT_FALSE(accumulator.expired());
  }
  EXPECT_TRUE(node.expired()) << "the ring kept the forward's graph";
  EXPECT_TRUE(accumulator.expired()) << "the ring kept the parameter's grad accumulator";

  auto wide = (x * 2).to(at::kHalf).to(at::kFloat);
  {
    const auto reduced = (x * 3).to(at::kHalf);
    wide = reduced.to(at::kFloat);
    detail::offer_companion(wide, reduced, /*exact=*/true);
    node = reduced.grad_fn();
  }
  const auto served = detail::find_reduced_companion(wide);  // wide's graph holds the node
  ASSERT_TRUE(served);
  EXPECT_EQ(served->grad_fn(), node.lock());
  EXPECT_TRUE(at::equal(served->to(at::kFloat), wide));
  served->to(at::kFloat).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({3}, 3.0)));
  detail::drop_companions();
}

// Companions do not outlive a step: the end of a scale_loss guard (the "weights may change"
// event) and amp::clear_cache() drop the thread's.
TEST(CompanionCasts, DroppedAtTheStepEventAndByClearCache) {
  const auto source = at::randn({3});
  detail::offer_companion(source, source.to(at::kHalf));
  detail::notify_weights_may_change();
  EXPECT_FALSE(detail::find_companion(source, at::kHalf));
  detail::offer_companion(source, source.to(at::kHalf));
  clear_cache();
  EXPECT_FALSE(detail::find_companion(source, at::kHalf));
}

using Param = std::tuple<at::DeviceType, std::string, at::ScalarType>;

// The fixture of both: a device, and the reduced dtype at O1 (fp16) or O4 (bf16).
class FusedCast : public Casting {
 protected:
  void set_up(at::DeviceType device, at::ScalarType low) {
    device_ = device;
    low_ = low;
    detail::drop_companions();
  }
  at::DeviceType device() const { return device_; }
  at::ScalarType low() const { return low_; }
  const char* level() const { return low() == at::kHalf ? "O1" : "O4"; }
  at::Tensor leaf(at::IntArrayRef shape, at::ScalarType dtype) const {
    return at::randn(shape, at::TensorOptions().dtype(at::kFloat).device(device()))
        .to(dtype)
        .requires_grad_();
  }
  // Bit for bit on the CPU; on CUDA (or `exact` false) within the reduced dtype's rounding: a
  // result rounded one ulp the other way on CUDA carries into everything computed from it, fp32
  // weight gradients included.
  void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what,
                   bool exact = true) const {
    ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
    if (exact && device() == at::kCPU) {
      EXPECT_TRUE(at::equal(got, want)) << what;
    } else {
      // Rounding errors of the terms that sum to an element scale with the largest of them, not
      // with the (possibly cancelled) sum: the absolute tolerance follows the largest value.
      const auto w = want.to(at::kFloat).cpu();
      auto tol = testing::tolerance(low());
      tol.atol = std::max(tol.atol, tol.rtol * w.abs().max().item<double>());
      EXPECT_TRUE(testing::all_close(got.to(at::kFloat).cpu(), w, tol)) << what;
    }
  }

 private:
  at::DeviceType device_ = at::kCPU;
  at::ScalarType low_ = at::kHalf;
};

class WidenedGelu : public FusedCast, public ::testing::WithParamInterface<Param> {
 protected:
  void SetUp() override {
    OPTAMP_SKIP_UNLESS_VISIBLE(std::get<0>(GetParam()));
    set_up(std::get<0>(GetParam()), std::get<2>(GetParam()));
  }
  const char* approximate() const { return std::get<1>(GetParam()).c_str(); }
};

// MLP-shaped: x (reduced) -> gelu -> linear(w) -> loss. The reference writes the casts out.
TEST_P(WidenedGelu, ValuesAndGradientsAreThoseOfTheCastPath) {
  const auto x = leaf({6, 8}, low());
  const auto w = leaf({5, 8}, at::kFloat);
  const auto xr = x.detach().clone().requires_grad_();
  const auto wr = w.detach().clone().requires_grad_();
  const auto yr = at::gelu(xr.to(at::kFloat), approximate());
  const auto zr = at::linear(yr.to(low()), wr.to(low()));
  (zr.to(at::kFloat).pow(2).sum() + yr.sum()).backward();

  enable(level());
  const auto before = cast_count();
  const auto y = at::gelu(x, approximate());
  const auto z = at::linear(y, w);
  EXPECT_EQ(cast_count() - before, 3);  // x widened, y narrowed (its companion), w narrowed
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "WidenedGeluBackward");
  bool linear_uses_companion = false;
  for (const auto& e : z.grad_fn()->next_edges()) {
    linear_uses_companion |= e.function == y.grad_fn() && e.input_nr == 1;
  }
  EXPECT_TRUE(linear_uses_companion);
  (z.to(at::kFloat).pow(2).sum() + y.sum()).backward();  // both outputs get a gradient
  expect_same(y, yr, "gelu");
  expect_same(z, zr, "linear");
  expect_same(x.grad(), xr.grad(), "x.grad");
  expect_same(w.grad(), wr.grad(), "w.grad");
}

TEST_P(WidenedGelu, AResultChangedInPlaceIsCastAfresh) {
  enable(level());
  const auto x = leaf({4, 8}, low());
  const auto w = leaf({3, 8}, at::kFloat);
  auto y = at::gelu(x, approximate());
  y.mul_(2.0);
  const auto z = at::linear(y, w);
  const auto expected = at::linear(
      (at::gelu(x.detach().to(at::kFloat), approximate()) * 2.0).to(low()), w.detach().to(low()));
  expect_same(z.detach(), expected, "linear of the changed result");
}

TEST_P(WidenedGelu, NoGradRegionsUseItWithoutANode) {
  const auto x = leaf({4, 8}, low()).detach();
  amp::autocast region;
  enable(level());
  c10::NoGradGuard no_grad;
  const auto y = at::gelu(x, approximate());
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_FALSE(y.grad_fn());
  expect_same(y, at::gelu(x.to(at::kFloat), approximate()), "gelu");
}

TEST_P(WidenedGelu, DoubleBackwardIsCloseToTheCastPaths) {
  const auto x = leaf({4, 8}, low());
  const auto xr = x.detach().clone().requires_grad_();
  auto penalty = [this](const at::Tensor& y, const at::Tensor& input) {
    const auto g = torch::autograd::grad({y.pow(2).sum()}, {input}, {}, true, true)[0];
    g.to(at::kFloat).pow(2).sum().backward();
  };
  enable(level());  // both under the level's rules (they apply to the second backward's ops too)
  penalty(at::gelu(xr.to(at::kFloat), approximate()), xr);  // an fp32 input: torch's gelu
  penalty(at::gelu(x, approximate()), x);
  // Not bit for bit: x's second-order gradient comes by two paths, which the cast path sums in
  // fp32 (at the widened input) and the node's paths each round to x's dtype first.
  expect_same(x.grad(), xr.grad(), "x.grad", /*exact=*/false);
}

INSTANTIATE_TEST_SUITE_P(Levels, WidenedGelu,
                         ::testing::Combine(testing::kDevices, ::testing::Values("none", "tanh"),
                                            ::testing::Values(at::kHalf, at::kBFloat16)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::get<1>(info.param) + "_" +
                                  (std::get<2>(info.param) == at::kHalf ? "fp16" : "bf16") +
                                  testing::device_suffix(std::get<0>(info.param));
                         });

// ---- cross_entropy of fp16/bf16 logits ----

using LossParam = std::tuple<at::DeviceType, at::ScalarType>;

class CrossEntropy : public FusedCast, public ::testing::WithParamInterface<LossParam> {
 protected:
  void SetUp() override {
    OPTAMP_SKIP_UNLESS_VISIBLE(std::get<0>(GetParam()));
    set_up(std::get<0>(GetParam()), std::get<1>(GetParam()));
  }
  // The levels whose rules run the loss in fp32 for this dtype: O1 and O2 (fp16), O4 and O5 (bf16).
  std::vector<const char*> levels() const {
    if (low() == at::kHalf) return {"O1", "O2"};
    return {"O4", "O5"};
  }
  at::Tensor classes(at::IntArrayRef shape, int64_t count) const {
    return at::randint(count, shape, at::TensorOptions().dtype(at::kLong).device(device()));
  }
  // The loss (and the logits' gradient) under `level` against the cast path written out: the
  // logits widened to fp32, then torch's cross_entropy.
  void expect_cast_paths(const char* level, const at::Tensor& logits,
                         const std::function<at::Tensor(const at::Tensor&)>& loss_of,
                         const std::string& what) {
    const auto reference = logits.detach().clone().requires_grad_();
    const auto want = loss_of(reference.to(at::kFloat));
    want.sum().backward();
    const auto input = logits.detach().clone().requires_grad_();
    enable(level);
    const auto got = loss_of(input);
    got.sum().backward();
    detail::activate_thread(false);
    expect_same(got, want, what + " at " + level);
    expect_same(input.grad(), reference.grad(), what + " gradient at " + level);
  }
};

TEST_P(CrossEntropy, ValuesAndGradientsAreThoseOfTheCastPath) {
  const auto logits = leaf({12, 10}, low());
  auto target = classes({12}, 10);
  target[3] = 7;
  const auto weight = at::rand({10}, at::TensorOptions().device(device())) + 0.5;
  for (const char* level : levels()) {
    expect_cast_paths(
        level, logits, [&](const at::Tensor& x) { return at::cross_entropy_loss(x, target); },
        "mean");
    expect_cast_paths(
        level, logits,
        [&](const at::Tensor& x) {
          return at::cross_entropy_loss(x, target, weight, at::Reduction::Sum, 7);
        },
        "weighted sum, ignore_index");
    const auto spatial = leaf({2, 5, 3, 4}, low());  // classes in dim 1
    const auto spatial_target = classes({2, 3, 4}, 5);
    expect_cast_paths(
        level, spatial,
        [&](const at::Tensor& x) {
          return at::cross_entropy_loss(x, spatial_target, {}, at::Reduction::None);
        },
        "per element");
    // GPT-2's vocabulary: a row of many strides; on the CPU eight blocks of the kernel's fp32
    // intermediates (25 rows each: an eighth of the rows, under 32 MiB)
    const auto wide = leaf({200, 50257}, low());
    const auto wide_target = classes({200}, 50257);
    expect_cast_paths(
        level, wide, [&](const at::Tensor& x) { return at::cross_entropy_loss(x, wide_target); },
        "GPT-2 rows");
    const auto odd = leaf({5, 33}, low());  // a row one past a warp
    const auto odd_target = classes({5}, 33);
    expect_cast_paths(
        level, odd, [&](const at::Tensor& x) { return at::cross_entropy_loss(x, odd_target); },
        "33 classes");
    const auto one = leaf({6}, low());  // an unbatched input: classes in dim 0
    const auto one_target = classes({}, 6);
    expect_cast_paths(
        level, one, [&](const at::Tensor& x) { return at::cross_entropy_loss(x, one_target); },
        "unbatched");
  }
}

// What the replacement saves: on the CPU optamp::widened_log_softmax reads the reduced logits
// instead of a widened copy; on CUDA optamp::fused_cross_entropy computes the loss from the
// reduced logits with no log-probabilities at all (one node, FusedCrossEntropyBackward), and
// nothing widens the logits or narrows their gradient. Counted as the cast it replaces.
TEST_P(CrossEntropy, LogSoftmaxReadsTheReducedLogits) {
  const auto logits = leaf({8, 2000}, low());  // on CUDA a block per row (over 1024 classes)
  const auto target = classes({8}, 2000);
  const bool fused = device() == at::kCUDA;
  for (const char* level : levels()) {
    enable(level);
    at::Tensor loss;
    const auto before = cast_count();
    const auto dtypes = testing::first_input_dtypes(
        fused ? "optamp::fused_cross_entropy" : "optamp::widened_log_softmax",
        [&] { loss = at::cross_entropy_loss(logits, target); });
    EXPECT_EQ(cast_count() - before, 1) << level;
    EXPECT_EQ(loss.scalar_type(), at::kFloat) << level;
    EXPECT_EQ(dtypes, std::vector<at::ScalarType>{low()}) << level;
    const auto nodes = testing::graph_node_names(loss);
    EXPECT_EQ(std::count(nodes.begin(), nodes.end(),
                         fused ? "FusedCrossEntropyBackward" : "WidenedLogSoftmaxBackward"),
              1)
        << level;
    if (fused) {
      // One observer at a time (test_util's sinks do not nest): the loss and its backward again
      // for each.
      const auto run = [&] { at::cross_entropy_loss(logits, target).backward(); };
      EXPECT_TRUE(testing::first_input_dtypes("aten::_to_copy", run).empty())
          << "no widened copy, no narrowed gradient at " << level;
      EXPECT_TRUE(testing::first_input_dtypes("aten::_log_softmax", run).empty()) << level;
      EXPECT_TRUE(testing::first_input_dtypes("aten::nll_loss_forward", run).empty()) << level;
      // Nothing read on the host (a device->host sync; a CUDA graph capture would refuse it):
      // torch's mean divides by the count of rows not ignored on the device.
      for (const char* read : {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"}) {
        EXPECT_TRUE(testing::first_input_dtypes(read, run).empty()) << read << " at " << level;
      }
    }
  }
}

// At O2/O5 Apex's model boundary widens the model's output to fp32 (amp::forward; Python's
// wrapped forward): the loss of the fp32 logits, and of a view of all of them (GPT-2's
// `.view({-1, classes})`), reads the reduced output they were widened from, through the op O1
// takes (no cast counted: none is replaced), with the values of torch's loss of the fp32 logits
// and the gradient reaching the reduced output directly, as the widening's backward would hand it
// on. Not when the fp32 logits changed in place, for part of them, where their gradient is kept
// or hooked, under no_grad, or at O3 (which runs losses in the model's dtype), and not from a
// companion that is a rounding (a GELU's).
// A gradient reversal layer: the identity forward returns a view of its input, which autograd
// marks as made in a custom Function.
struct ReversedGradient : torch::autograd::Function<ReversedGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    return {-grads[0]};
  }
};

TEST_P(CrossEntropy, AModelsWidenedOutputIsReadReduced) {
  const char* op =
      device() == at::kCUDA ? "optamp::fused_cross_entropy" : "optamp::widened_log_softmax";
  const char* level = low() == at::kHalf ? "O2" : "O5";
  const auto target = classes({8}, 2000);
  for (const bool whole_view : {false, true}) {
    const std::string what =
        std::string(whole_view ? "a view of the output" : "the output") + " at " + level;
    const auto output =
        leaf(whole_view ? at::IntArrayRef{2, 4, 2000} : at::IntArrayRef{8, 2000}, low());
    const auto reference = output.detach().clone().requires_grad_();
    const auto want = at::cross_entropy_loss(reference.to(at::kFloat).view({8, 2000}), target);
    want.backward();
    enable(level);
    const auto wide = cast_model_output(output, at::kFloat);
    ASSERT_EQ(wide.scalar_type(), at::kFloat) << what;
    const auto logits = whole_view ? wide.view({-1, 2000}) : wide;
    at::Tensor loss;
    const auto before = cast_count();
    const auto read =
        testing::first_input_dtypes(op, [&] { loss = at::cross_entropy_loss(logits, target); });
    EXPECT_EQ(read, std::vector<at::ScalarType>{low()}) << what;
    EXPECT_EQ(cast_count(), before) << what;
    const auto nodes = testing::graph_node_names(loss);
    EXPECT_EQ(std::count(nodes.begin(), nodes.end(), "ToCopyBackward0"), 0) << what;
    loss.backward();
    detail::activate_thread(false);
    expect_same(loss, want, what, /*exact=*/false);
    expect_same(output.grad(), reference.grad(), what + " gradient", /*exact=*/false);
  }
  // Where the fp32 logits are not the reduced output's values as they are: torch's loss of them
  // (of the logits' rows, with their rows' targets).
  const auto fp32_loss_reads = [&](const std::function<at::Tensor()>& make,
                                   const std::string& what) {
    enable(level);
    const auto logits = make();
    const auto rows_target = target.narrow(0, 0, logits.size(0));
    const auto read =
        testing::first_input_dtypes(op, [&] { at::cross_entropy_loss(logits, rows_target); });
    detail::activate_thread(false);
    EXPECT_TRUE(read.empty()) << what;
  };
  const auto output = leaf({8, 2000}, low());
  fp32_loss_reads([&] { return cast_model_output(output, at::kFloat).mul_(2); },
                  "changed in place");
  fp32_loss_reads([&] { return cast_model_output(output, at::kFloat).narrow(0, 0, 4); },
                  "part of the rows");
  fp32_loss_reads(
      [&] {
        const at::NoGradGuard no_grad;
        return cast_model_output(output, at::kFloat);
      },
      "under no_grad");
  fp32_loss_reads(
      [&] {
        auto wide = cast_model_output(output, at::kFloat);
        wide.retain_grad();  // its gradient is looked at: it must reach it
        return wide;
      },
      "retain_grad");
  fp32_loss_reads(
      [&] {
        auto wide = cast_model_output(output, at::kFloat);
        wide.register_hook([](const at::Tensor& g) { return g; });
        return wide.view({-1, 2000});
      },
      "a hook on the tensor viewed");
  fp32_loss_reads([&] { return ReversedGradient::apply(cast_model_output(output, at::kFloat)); },
                  "a custom Function's view of it (its backward must run)");
  enable("O3");  // losses in the model's dtype: nothing to offer
  EXPECT_FALSE(detail::find_reduced_companion(cast_model_output(output, at::kFloat))) << "at O3";
  detail::activate_thread(false);
  fp32_loss_reads(
      [&] {
        auto wide = output.detach().to(at::kFloat).requires_grad_();
        detail::offer_companion(wide, output);  // a rounding's companion, as a GELU offers
        return wide;
      },
      "an inexact companion");
}

// optamp::fused_cross_entropy through its entry (detail::fused_cross_entropy, which the
// replacement calls for CUDA logits; the CPU kernels compute the CUDA kernels' formulas with
// torch's ops): the loss within fp32's rounding of torch's cross_entropy of the widened logits,
// the gradient within the reduced dtype's, for every reduction, with ignored rows, a row of a
// warp and of a block, GPT-2's rows and logits at an odd offset into their storage; a second
// backward (create_graph) through torch's differentiable ops.
TEST_P(CrossEntropy, TheFusedLossIsTheCastPaths) {
  struct Case {
    int64_t rows, cols, offset;
  };
  for (const Case c :
       {Case{12, 10, 0}, Case{5, 33, 0}, Case{9, 1100, 0}, Case{7, 1025, 3}, Case{40, 50257, 1}}) {
    const auto storage = leaf({c.rows * c.cols + c.offset}, low()).detach();
    const auto logits = storage.narrow(0, c.offset, c.rows * c.cols).view({c.rows, c.cols});
    auto target = classes({c.rows}, c.cols);
    target[1] = -100;  // ignored
    target[c.rows - 1] = c.cols - 1;
    for (const int64_t reduction : {at::Reduction::None, at::Reduction::Sum, at::Reduction::Mean}) {
      const std::string what = std::to_string(c.rows) + " x " + std::to_string(c.cols) + " at +" +
                               std::to_string(c.offset) + ", reduction " +
                               std::to_string(reduction);
      const auto x = logits.clone().requires_grad_();
      const auto xr = logits.clone().requires_grad_();
      std::optional<at::Tensor> got;
      const auto copied = testing::first_input_dtypes("aten::_to_copy", [&] {
        got = detail::fused_cross_entropy(x, target, reduction, -100, true);
      });
      ASSERT_TRUE(got) << what;
      // The mean's count of rows is not a widened copy of a bool mask; on CUDA nothing is copied
      // (the CPU kernels widen the logits with torch's ops).
      EXPECT_EQ(std::count(copied.begin(), copied.end(), at::kBool), 0) << what;
      if (device() == at::kCUDA) EXPECT_TRUE(copied.empty()) << what;
      const auto want = at::cross_entropy_loss(xr.to(at::kFloat), target, {}, reduction, -100);
      expect_same(*got, want, what, /*exact=*/false);
      const auto nodes = testing::graph_node_names(*got);
      EXPECT_EQ(std::count(nodes.begin(), nodes.end(), "FusedCrossEntropyBackward"), 1) << what;
      const auto grad = at::rand_like(want) + 0.5;
      got->backward(grad);
      want.backward(grad);
      expect_same(x.grad(), xr.grad(), what + " gradient", /*exact=*/false);
      EXPECT_TRUE(x.grad()[1].eq(0).all().item<bool>()) << what << ": the ignored row";
    }
  }
  // The second backward: a gradient penalty through the loss.
  const auto logits = leaf({6, 300}, low()).detach();
  const auto target = classes({6}, 300);
  const auto x = logits.clone().requires_grad_();
  const auto xr = logits.clone().requires_grad_();
  auto penalty = [](const at::Tensor& loss, const at::Tensor& input) {
    const auto g = torch::autograd::grad({loss}, {input}, {}, true, true)[0];
    g.to(at::kFloat).pow(2).sum().backward();
  };
  penalty(*detail::fused_cross_entropy(x, target, at::Reduction::Mean, -100, true), x);
  penalty(at::cross_entropy_loss(xr.to(at::kFloat), target), xr);
  expect_same(x.grad(), xr.grad(), "the second backward", /*exact=*/false);
  // A target changed in place before the backward is refused, as torch's nll_loss refuses it.
  auto changed = target.clone();
  const auto loss = *detail::fused_cross_entropy(logits.clone().requires_grad_(), changed,
                                                 at::Reduction::Mean, -100, true);
  changed.zero_();
  OPTAMP_EXPECT_THROW_WITH(loss.backward(), c10::Error, "modified by an inplace operation");
}

// Where the entry declines (the replacement then takes log_softmax + nll_loss), and what the ops
// (torch.ops.optamp.fused_cross_entropy and its backward, callable by anyone) refuse, naming the
// op and the argument.
TEST_P(CrossEntropy, TheFusedOpRefusesWhatItCannotCompute) {
  const auto x = leaf({4, 6}, low()).detach();
  const auto t = classes({4}, 6);
  EXPECT_FALSE(detail::fused_cross_entropy(x.to(at::kFloat), t, at::Reduction::Mean, -100, true));
  EXPECT_FALSE(detail::fused_cross_entropy(x.view({2, 2, 6}), t.view({2, 2}), at::Reduction::Mean,
                                           -100, true));
  EXPECT_FALSE(detail::fused_cross_entropy(x, t.to(at::kInt), at::Reduction::Mean, -100, true));
  EXPECT_FALSE(detail::fused_cross_entropy(x, t.narrow(0, 0, 3), at::Reduction::Mean, -100, true));
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("optamp::fused_cross_entropy", "")
                      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                                const at::Tensor&, int64_t)>();
  const auto backward = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("optamp::fused_cross_entropy_backward", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t)>();
  OPTAMP_EXPECT_THROW_WITH(op.call(x.to(at::kFloat), t, -100), c10::ValueError,
                           "fused_cross_entropy", "self must be float16 or bfloat16");
  OPTAMP_EXPECT_THROW_WITH(op.call(x, t.to(at::kInt), -100), c10::ValueError, "fused_cross_entropy",
                           "target must be int64", "Int");
  OPTAMP_EXPECT_THROW_WITH(op.call(x, t.narrow(0, 0, 3), -100), c10::ValueError,
                           "fused_cross_entropy", "target must be [rows]", "[3]");
  const auto [losses, stats] = op.call(x, t, -100);
  OPTAMP_EXPECT_THROW_WITH(backward.call(losses.narrow(0, 0, 2), x, t, stats, -100),
                           c10::ValueError, "fused_cross_entropy_backward",
                           "grad must be float32 [4]", "[2]");
  OPTAMP_EXPECT_THROW_WITH(backward.call(losses, x, t, stats.narrow(1, 0, 1), -100),
                           c10::ValueError, "fused_cross_entropy_backward",
                           "row_stats must be float32 [4, 2]");
  if (device() == at::kCPU) {  // CUDA's kernel asserts on the device, as torch's nll_loss does
    auto bad = t.clone();
    bad[2] = 6;
    OPTAMP_EXPECT_THROW_WITH(op.call(x, bad, -100), c10::ValueError, "fused_cross_entropy",
                             "class indices in [0, 6)");
  }
}

// A gradient penalty through the loss (create_graph): the node records torch's differentiable
// ops, so the second backward reaches the logits as the cast path's does.
TEST_P(CrossEntropy, DoubleBackwardIsCloseToTheCastPaths) {
  const auto logits = leaf({6, 1100}, low());  // on CUDA too through optamp's op (>= 128)
  const auto target = classes({6}, 1100);
  for (const char* level : levels()) {
    const auto x = logits.detach().clone().requires_grad_();
    const auto xr = logits.detach().clone().requires_grad_();
    auto penalty = [&](const at::Tensor& loss, const at::Tensor& input) {
      const auto g = torch::autograd::grad({loss}, {input}, {}, true, true)[0];
      g.to(at::kFloat).pow(2).sum().backward();
    };
    enable(level);
    penalty(at::cross_entropy_loss(xr.to(at::kFloat), target), xr);
    penalty(at::cross_entropy_loss(x, target), x);
    detail::activate_thread(false);
    expect_same(x.grad(), xr.grad(), std::string("x.grad at ") + level, /*exact=*/false);
  }
}

// The two ops of the fp32 list optamp computes from the reduced input (ops/widened_softmax.h),
// what they replace, and torch's fp32 ops the tests compare them with.
struct WidenedKind {
  const char* op;        // optamp::<op> and optamp::<op>_backward
  const char* torch_op;  // the aten op torch's own reduced-to-fp32 kernel (fp16 on CUDA) is
  const char* node;      // the op's autograd node
  at::Tensor (*call)(const at::Tensor&, int64_t, std::optional<at::ScalarType>);  // at::softmax
  at::Tensor (*fp32)(const at::Tensor&, int64_t, bool);                           // at::_softmax
  at::Tensor (*fp32_backward)(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType);

  using Forward = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)>;
  using Backward = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                       int64_t, at::ScalarType)>;
  Forward forward_op() const {
    return c10::Dispatcher::singleton()
        .findSchemaOrThrow((std::string("optamp::") + op).c_str(), "")
        .typed<at::Tensor(const at::Tensor&, int64_t)>();
  }
  Backward backward_op() const {
    return c10::Dispatcher::singleton()
        .findSchemaOrThrow((std::string("optamp::") + op + "_backward").c_str(), "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
  }
};

const std::vector<WidenedKind>& widened_kinds() {
  static const std::vector<WidenedKind> kinds = {
      {"widened_log_softmax", "aten::_log_softmax", "WidenedLogSoftmaxBackward",
       [](const at::Tensor& x, int64_t dim, std::optional<at::ScalarType> dtype) {
         return at::log_softmax(x, dim, dtype);
       },
       [](const at::Tensor& x, int64_t dim, bool h2f) { return at::_log_softmax(x, dim, h2f); },
       &at::_log_softmax_backward_data},
      {"widened_softmax", "aten::_softmax", "WidenedSoftmaxBackward",
       [](const at::Tensor& x, int64_t dim, std::optional<at::ScalarType> dtype) {
         return at::softmax(x, dim, dtype);
       },
       [](const at::Tensor& x, int64_t dim, bool h2f) { return at::_softmax(x, dim, h2f); },
       &at::_softmax_backward_data},
  };
  return kinds;
}

// The ops themselves (torch.ops.optamp.widened_log_softmax, widened_softmax and their backwards,
// callable by anyone) refuse what their kernels cannot compute, naming the op and the argument.
TEST_P(CrossEntropy, TheOpsRefuseArgumentsTheyCannotCompute) {
  for (const auto& kind : widened_kinds()) {
    const auto forward = kind.forward_op();
    const auto backward = kind.backward_op();
    const std::string op = kind.op;
    const auto on = at::TensorOptions().device(device());
    const auto x = at::randn({4, 6}, on).to(low());
    OPTAMP_EXPECT_THROW_WITH(forward.call(x.to(at::kFloat), 1), c10::ValueError,
                             op + ": self must be float16 or bfloat16, got Float");
    OPTAMP_EXPECT_THROW_WITH(forward.call(x.select(0, 0).select(0, 0), 0), c10::ValueError,
                             "self must have at least one dimension, got 0-D");
    OPTAMP_EXPECT_THROW_WITH(forward.call(x.view({2, 2, 6}), 1), c10::ValueError,
                             "dim must be the last dimension of self (2 or -1), got 1");
    OPTAMP_EXPECT_THROW_WITH(forward.call(x, 0), c10::ValueError,
                             "dim must be the last dimension of self (1 or -1), got 0");
    const auto out = forward.call(x, -1);
    EXPECT_TRUE(at::allclose(out, kind.fp32(x.to(at::kFloat), 1, false), 1e-5, 1e-5)) << op;
    const auto g = at::randn({4, 6}, on);
    OPTAMP_EXPECT_THROW_WITH(backward.call(g.to(low()), out, 1, low()), c10::ValueError,
                             op + "_backward: grad and output must be float32");
    OPTAMP_EXPECT_THROW_WITH(backward.call(g.view({6, 4}), out, 1, low()), c10::ValueError,
                             "grad must have output's shape [4, 6], got [6, 4]");
    OPTAMP_EXPECT_THROW_WITH(backward.call(g, out, 1, at::kFloat), c10::ValueError,
                             "input_dtype must be float16 or bfloat16, got Float");
    OPTAMP_EXPECT_THROW_WITH(backward.call(g, out, 0, low()), c10::ValueError,
                             "dim must be the last dimension of output (1 or -1), got 0");
    EXPECT_EQ(backward.call(g, out, 1, low()).scalar_type(), low()) << op;
  }
}

// log_softmax and softmax called on their own (F.log_softmax of a language model's [batch,
// tokens, vocab] logits, then nll_loss or a KL term; attention written out, scores.softmax(-1)):
// Apex's fp32 rule asks for an fp32 result, which the op computes from the reduced input (on CUDA
// from 128 classes) with the values and gradients of the cast path. A dtype the caller chose is
// left alone, and a dimension other than the last takes torch's path; so does, on CUDA, an fp16
// softmax with no backward to follow (torch's forward is the faster).
TEST_P(CrossEntropy, SoftmaxesOfTheLastDimensionReadTheReducedInput) {
  // On CUDA a block per row (1100 classes) and a warp per row (512 keys).
  for (const int64_t cols : {int64_t{1100}, int64_t{512}}) {
    const auto x = leaf({2, 3, cols}, low());
    for (const auto& kind : widened_kinds()) {
      for (const char* level : levels()) {
        const std::string at =
            std::string(kind.op) + " at " + level + " of " + std::to_string(cols) + " classes";
        const auto xr = x.detach().clone().requires_grad_();
        enable(level);
        at::Tensor y;
        const auto dtypes = testing::first_input_dtypes(
            std::string("optamp::") + kind.op, [&] { y = kind.call(x, -1, std::nullopt); });
        EXPECT_EQ(dtypes, std::vector<at::ScalarType>{low()}) << at;
        EXPECT_EQ(y.scalar_type(), at::kFloat) << at;
        const auto nodes = testing::graph_node_names(y);
        EXPECT_EQ(std::count(nodes.begin(), nodes.end(), kind.node), 1) << at;
        const auto yr = kind.call(xr.to(at::kFloat), -1, std::nullopt);  // the cast path, by hand
        const bool exact = device() == at::kCPU;  // the CPU runs the cast path's own ops
        expect_same(y.detach(), yr.detach(), "result of " + at, exact);
        const auto g = at::randn(y.sizes(), y.options());
        y.backward(g);
        yr.backward(g);
        expect_same(x.grad(), xr.grad(), "x.grad of " + at, exact);
        x.mutable_grad().reset();

        // The caller's dtype, another dimension, and on CUDA rows of under 128 classes: torch's
        // own path, as before.
        const auto own = testing::first_input_dtypes(std::string("optamp::") + kind.op, [&] {
          EXPECT_EQ(kind.call(x, -1, at::kFloat).scalar_type(), at::kFloat);
          EXPECT_EQ(kind.call(x, 1, std::nullopt).scalar_type(), at::kFloat);
          if (device() == at::kCUDA) {
            EXPECT_EQ(kind.call(x.narrow(2, 0, 100), -1, std::nullopt).scalar_type(), at::kFloat);
          }
        });
        EXPECT_TRUE(own.empty()) << at;

        const bool torchs_forward = device() == at::kCUDA && low() == at::kHalf &&
                                    std::string(kind.op) == "widened_softmax";
        const auto without_backward = testing::first_input_dtypes(
            torchs_forward ? kind.torch_op : std::string("optamp::") + kind.op,
            [&] { y = kind.call(x.detach(), -1, std::nullopt); });
        EXPECT_EQ(without_backward, std::vector<at::ScalarType>{low()}) << at << ", detached";
        expect_same(y, yr.detach(), "detached result of " + at, exact);
      }
    }
  }
}

// Where the CUDA ops leave a reduced input to torch's own kernel (which reads fp16 and writes
// fp32 in one pass, or widens bf16 first): the rule as measured on an H200 (docs/results.md).
TEST(WidenedSoftmaxOnCuda, TorchServesShortRowsAndAnFp16SoftmaxWithNoBackward) {
  using detail::cuda_softmax_declines;
  using detail::SoftmaxKind;
  for (const auto kind : {SoftmaxKind::kSoftmax, SoftmaxKind::kLogSoftmax}) {
    for (const auto dtype : {at::kHalf, at::kBFloat16}) {
      for (const bool backward : {false, true}) {
        const std::string at = std::string(kind == SoftmaxKind::kSoftmax ? "softmax " : "log ") +
                               c10::toString(dtype) + (backward ? " with backward" : "");
        EXPECT_TRUE(cuda_softmax_declines(kind, dtype, 127, backward)) << at;  // a warp's idle
        const bool fp16_softmax_forward =
            kind == SoftmaxKind::kSoftmax && dtype == at::kHalf && !backward;
        for (const int64_t classes : {128, 1024, 50257}) {
          EXPECT_EQ(cuda_softmax_declines(kind, dtype, classes, backward), fp16_softmax_forward)
              << at << ", " << classes << " classes";
        }
      }
    }
  }
}

// The ops on rows that start anywhere in their storage: the CUDA kernels move four elements per
// load and store where the fp32 array's row starts on a 16-byte boundary, and element by element
// where another array of the same row does not (a tensor at an odd offset into its storage). Each
// array at each offset, rows on both sides of the block-per-row threshold.
TEST_P(CrossEntropy, TheOpsTakeRowsAtAnyOffsetIntoTheirStorage) {
  const auto on = at::TensorOptions().device(device());
  // `t`'s values in a tensor that starts `offset` elements into its storage.
  const auto at_offset = [&](const at::Tensor& t, int64_t offset) {
    auto storage = at::empty({t.numel() + offset}, t.options());
    auto view = storage.narrow(0, offset, t.numel()).view(t.sizes());
    view.copy_(t);
    EXPECT_TRUE(view.is_contiguous());
    return view;
  };
  for (const auto& kind : widened_kinds()) {
    const auto forward = kind.forward_op();
    const auto backward = kind.backward_op();
    // A block per row (50257, 1025) and a warp per row (37, 1024) on CUDA.
    for (const int64_t cols : {int64_t{50257}, int64_t{1025}, int64_t{1024}, int64_t{37}}) {
      const auto x = (at::randn({3, cols}, on) * 4).to(low());
      const auto want = kind.fp32(x.to(at::kFloat), 1, false);
      const auto g = at::randn({3, cols}, on);
      const auto want_grad = kind.fp32_backward(g, want, 1, at::kFloat).to(low());
      for (const int64_t offset : {0, 1, 2, 3, 5}) {
        const std::string at = std::string(kind.op) + ", cols " + std::to_string(cols) +
                               ", offset " + std::to_string(offset);
        EXPECT_TRUE(at::allclose(forward.call(at_offset(x, offset), 1), want, 1e-5, 1e-6)) << at;
        expect_same(backward.call(at_offset(g, offset), want, 1, low()), want_grad, "grad at " + at,
                    /*exact=*/false);
        expect_same(backward.call(g, at_offset(want, offset), 1, low()), want_grad,
                    "output at " + at, /*exact=*/false);
      }
    }
  }
}

// Probability targets and label smoothing keep the cast: the same values, through a widened copy.
TEST_P(CrossEntropy, ProbabilityTargetsAndLabelSmoothingTakeTheCastPath) {
  const auto logits = leaf({8, 10}, low());
  const auto target = classes({8}, 10);
  const auto probabilities =
      at::softmax(at::randn({8, 10}, at::TensorOptions().device(device())), 1);
  for (const char* level : levels()) {
    expect_cast_paths(
        level, logits,
        [&](const at::Tensor& x) {
          return at::cross_entropy_loss(x, target, {}, at::Reduction::Mean, -100, 0.1);
        },
        "label smoothing");
    expect_cast_paths(
        level, logits,
        [&](const at::Tensor& x) { return at::cross_entropy_loss(x, probabilities); },
        "probabilities");
    enable(level);
    const auto dtypes = testing::first_input_dtypes(
        "aten::log_softmax", [&] { at::cross_entropy_loss(logits, probabilities); });
    ASSERT_FALSE(dtypes.empty());
    EXPECT_EQ(dtypes.front(), at::kFloat) << level;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, CrossEntropy,
                         ::testing::Combine(testing::kDevices,
                                            ::testing::Values(at::kHalf, at::kBFloat16)),
                         [](const ::testing::TestParamInfo<LossParam>& info) {
                           return std::string(std::get<1>(info.param) == at::kHalf ? "fp16"
                                                                                   : "bf16") +
                                  testing::device_suffix(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace amp
