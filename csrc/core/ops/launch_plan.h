#pragma once
// The launch plan of the CUDA multi-tensor kernels (as Apex's multi_tensor_apply), computed on
// the host: which tensor and which chunk of it each block of each launch handles.
//
// The tensors of a list are cut into chunks of kLaunchChunk elements; one block does one chunk.
// A launch holds up to kLaunchMaxTensors tensors ("slots") and kLaunchMaxBlocks blocks. A launch
// is closed when its blocks are used up, or when its slots are and the last slot's tensor is
// complete; a tensor cut by a closed launch continues in slot 0 of the next one. Empty tensors
// get no slot.
//
// Plain C++ (no CUDA headers): the .cu file calls plan_launches and copies each Launch's block
// map into its kernel argument; tests/cpp/test_launch_plan.cpp checks the plan on the CPU.
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace amp::ops::detail {

constexpr int kLaunchMaxTensors = 48;
constexpr int kLaunchMaxBlocks = 320;
constexpr int64_t kLaunchChunk = 65536;
static_assert(kLaunchMaxTensors <= 256, "a block's slot is stored in one byte");

// Block b of a launch handles chunk chunk[b] of the tensor in slot tensor[b].
struct LaunchBlocks {
  unsigned char tensor[kLaunchMaxBlocks];
  int32_t chunk[kLaunchMaxBlocks];
};

struct Launch {
  int32_t num_tensors = 0;                // slots used
  int32_t num_blocks = 0;                 // blocks used (the grid size)
  int64_t list_index[kLaunchMaxTensors];  // slot -> position of its tensor in the list
  LaunchBlocks blocks;
};

// The elements [begin, begin + size) of a tensor of `numel` elements that chunk `chunk` covers:
// what a kernel's block works on (host and device code).
struct ChunkRange {
  int64_t begin;
  int64_t size;
};
C10_HOST_DEVICE inline ChunkRange chunk_range(int64_t numel, int32_t chunk) {
  const int64_t begin = static_cast<int64_t>(chunk) * kLaunchChunk;
  const int64_t rest = numel - begin;
  return {begin, rest < kLaunchChunk ? rest : kLaunchChunk};
}

// The launches for a list of tensors with these element counts, in order.
std::vector<Launch> plan_launches(c10::ArrayRef<int64_t> numels);

}  // namespace amp::ops::detail
