// The launch plan of the CUDA multi-tensor kernels (ops/launch_plan.h), checked on the CPU:
// every element of every tensor is covered by exactly one block of one launch, and no launch
// exceeds kLaunchMaxTensors slots or kLaunchMaxBlocks blocks.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "ops/launch_plan.h"

namespace amp {
namespace {

using ops::detail::chunk_range;
using ops::detail::kLaunchChunk;
using ops::detail::kLaunchMaxBlocks;
using ops::detail::kLaunchMaxTensors;
using ops::detail::Launch;
using ops::detail::plan_launches;

constexpr int64_t kBlockElems = kLaunchChunk;  // what one block covers at most

// Checks the plan for `numels` and returns it. Coverage is checked per tensor as a list of
// element ranges (chunk_range, as the kernels compute them), sorted and required to tile
// [0, numel) without gap or overlap, so huge tensors need no per-element memory.
std::vector<Launch> checked_plan(const std::vector<int64_t>& numels) {
  const std::vector<Launch> plan = plan_launches(numels);
  std::map<int64_t, std::map<int64_t, int64_t>> covered;  // tensor -> begin -> size
  for (size_t l = 0; l < plan.size(); ++l) {
    const Launch& launch = plan[l];
    EXPECT_GE(launch.num_tensors, 1) << "launch " << l;
    EXPECT_LE(launch.num_tensors, kLaunchMaxTensors) << "launch " << l;
    EXPECT_GE(launch.num_blocks, 1) << "launch " << l;
    EXPECT_LE(launch.num_blocks, kLaunchMaxBlocks) << "launch " << l;
    std::vector<int> blocks_per_slot(launch.num_tensors, 0);
    for (int b = 0; b < launch.num_blocks; ++b) {
      const int slot = launch.blocks.tensor[b];
      EXPECT_LT(slot, launch.num_tensors) << "launch " << l << " block " << b;
      if (slot >= launch.num_tensors) continue;
      ++blocks_per_slot[slot];
      const int64_t t = launch.list_index[slot];
      EXPECT_GE(t, 0);
      EXPECT_LT(t, static_cast<int64_t>(numels.size()));
      if (t < 0 || t >= static_cast<int64_t>(numels.size())) continue;
      const auto range = chunk_range(numels[t], launch.blocks.chunk[b]);
      EXPECT_GT(range.size, 0) << "launch " << l << " block " << b << " is empty";
      EXPECT_LE(range.size, kBlockElems);
      const bool fresh = covered[t].emplace(range.begin, range.size).second;
      EXPECT_TRUE(fresh) << "tensor " << t << " chunk at " << range.begin << " covered twice";
    }
    for (int slot = 0; slot < launch.num_tensors; ++slot) {
      EXPECT_GE(blocks_per_slot[slot], 1) << "launch " << l << " slot " << slot << " unused";
    }
  }
  for (size_t t = 0; t < numels.size(); ++t) {
    int64_t next = 0;
    for (const auto& [begin, size] : covered[static_cast<int64_t>(t)]) {
      EXPECT_EQ(begin, next) << "tensor " << t << ": gap or overlap at " << next;
      next = begin + size;
    }
    EXPECT_EQ(next, numels[t]) << "tensor " << t << " covered up to " << next;
  }
  return plan;
}

// The list positions a launch's slots refer to, in slot order.
std::vector<int64_t> tensors_of(const Launch& launch) {
  return {launch.list_index, launch.list_index + launch.num_tensors};
}

TEST(LaunchPlan, EmptyListAndEmptyTensorsGetNoLaunchOrSlot) {
  EXPECT_TRUE(checked_plan({}).empty());
  EXPECT_TRUE(checked_plan({0, 0, 0}).empty());
  const auto plan = checked_plan({0, 5, 0, 0, 7, 0});
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(tensors_of(plan[0]), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(plan[0].num_blocks, 2);
}

TEST(LaunchPlan, ChunkBoundariesOfOneTensor) {
  for (int64_t n : {int64_t{1}, kLaunchChunk - 1, kLaunchChunk, kLaunchChunk + 1, 3 * kLaunchChunk,
                    3 * kLaunchChunk + 17}) {
    const auto plan = checked_plan({n});
    ASSERT_EQ(plan.size(), 1u) << n;
    EXPECT_EQ(plan[0].num_blocks, (n + kLaunchChunk - 1) / kLaunchChunk) << n;
  }
}

TEST(LaunchPlan, ExactlyMaxTensorsFitOneLaunchAndOneMoreStartsAnother) {
  const auto full = checked_plan(std::vector<int64_t>(kLaunchMaxTensors, 3));
  ASSERT_EQ(full.size(), 1u);
  EXPECT_EQ(full[0].num_tensors, kLaunchMaxTensors);
  EXPECT_EQ(full[0].num_blocks, kLaunchMaxTensors);

  const auto over = checked_plan(std::vector<int64_t>(kLaunchMaxTensors + 1, 3));
  ASSERT_EQ(over.size(), 2u);
  EXPECT_EQ(over[0].num_tensors, kLaunchMaxTensors);
  EXPECT_EQ(over[1].num_tensors, 1);
  EXPECT_EQ(over[1].list_index[0], kLaunchMaxTensors);
}

TEST(LaunchPlan, TheLastSlotsTensorIsFinishedBeforeALaunchClosesOnSlots) {
  // 47 one-chunk tensors, then a 5-chunk one in the last slot: it stays whole in this launch.
  std::vector<int64_t> numels(kLaunchMaxTensors - 1, 1);
  numels.push_back(5 * kLaunchChunk);
  numels.push_back(1);
  const auto plan = checked_plan(numels);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].num_tensors, kLaunchMaxTensors);
  EXPECT_EQ(plan[0].num_blocks, kLaunchMaxTensors - 1 + 5);
  EXPECT_EQ(tensors_of(plan[1]), (std::vector<int64_t>{kLaunchMaxTensors}));
}

TEST(LaunchPlan, ExactlyMaxBlocksFitOneLaunchAndOneMoreStartsAnother) {
  const int64_t full_launch = kLaunchMaxBlocks * kLaunchChunk;
  const auto full = checked_plan({full_launch});
  ASSERT_EQ(full.size(), 1u);
  EXPECT_EQ(full[0].num_blocks, kLaunchMaxBlocks);

  // One element more: the tensor continues in slot 0 of a second launch, with its last chunk.
  const auto over = checked_plan({full_launch + 1});
  ASSERT_EQ(over.size(), 2u);
  EXPECT_EQ(over[0].num_blocks, kLaunchMaxBlocks);
  EXPECT_EQ(over[1].num_blocks, 1);
  EXPECT_EQ(tensors_of(over[1]), (std::vector<int64_t>{0}));
  EXPECT_EQ(over[1].blocks.chunk[0], kLaunchMaxBlocks);

  // A launch filled to the block limit exactly at a tensor's end: the next tensor starts fresh.
  const auto boundary = checked_plan({full_launch - 2 * kLaunchChunk, 2 * kLaunchChunk, 9});
  ASSERT_EQ(boundary.size(), 2u);
  EXPECT_EQ(tensors_of(boundary[0]), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(tensors_of(boundary[1]), (std::vector<int64_t>{2}));
}

TEST(LaunchPlan, ATensorSpanningSeveralLaunchesIsCarriedInSlotZero) {
  // Small tensors, then one of 2.5 launches' worth of chunks, then more small ones.
  const int64_t big = (2 * kLaunchMaxBlocks + kLaunchMaxBlocks / 2) * kLaunchChunk + 123;
  const auto plan = checked_plan({10, 20, big, 30});
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(tensors_of(plan[0]), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(tensors_of(plan[1]), (std::vector<int64_t>{2}));
  EXPECT_EQ(tensors_of(plan[2]), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(plan[0].num_blocks, kLaunchMaxBlocks);
  EXPECT_EQ(plan[1].num_blocks, kLaunchMaxBlocks);
}

TEST(LaunchPlan, MixedSizesRespectBothLimits) {
  // Sizes around the chunk boundary, empty ones, and a few multi-launch tensors, over many
  // launches: the checks in checked_plan do the work.
  std::vector<int64_t> numels;
  for (int i = 0; i < 500; ++i) {
    switch (i % 9) {
      case 0:
        numels.push_back(0);
        break;
      case 1:
        numels.push_back(kLaunchChunk);
        break;
      case 2:
        numels.push_back(kLaunchChunk + i);
        break;
      case 3:
        numels.push_back(1 + 37 * i);
        break;
      case 4:
        numels.push_back(i % 4 == 0 ? 400 * kLaunchChunk + i : 7);
        break;
      default:
        numels.push_back((i % 5 + 1) * kLaunchChunk - 1);
        break;
    }
  }
  const auto plan = checked_plan(numels);
  EXPECT_GT(plan.size(), 10u);
  // Every launch but the last is full in one of the two limits.
  for (size_t l = 0; l + 1 < plan.size(); ++l) {
    EXPECT_TRUE(plan[l].num_blocks == kLaunchMaxBlocks || plan[l].num_tensors == kLaunchMaxTensors)
        << "launch " << l << " closed early";
  }
}

TEST(LaunchPlan, ASingleHugeTensor) {
  // More than 2^31 elements (int64 sizes and offsets) over about a hundred launches.
  const int64_t n = 110 * kLaunchMaxBlocks * kLaunchChunk + kLaunchChunk / 2;
  ASSERT_GT(n, int64_t{1} << 31);
  const auto plan = checked_plan({n});
  ASSERT_EQ(plan.size(), 111u);
  for (const auto& launch : plan) EXPECT_EQ(tensors_of(launch), (std::vector<int64_t>{0}));
  const auto last = chunk_range(n, plan.back().blocks.chunk[plan.back().num_blocks - 1]);
  EXPECT_EQ(last.begin + last.size, n);
  EXPECT_EQ(last.size, kLaunchChunk / 2);
}

}  // namespace
}  // namespace amp
