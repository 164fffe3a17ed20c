// The host-side launch plan of the CUDA multi-tensor kernels (see launch_plan.h).
#include "ops/launch_plan.h"

#include <c10/util/Exception.h>

#include <limits>

namespace amp::ops::detail {

std::vector<Launch> plan_launches(c10::ArrayRef<int64_t> numels) {
  std::vector<Launch> launches;
  Launch* cur = nullptr;
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    const int64_t chunks = (n + kLaunchChunk - 1) / kLaunchChunk;
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "tensor ", t, " has ", n,
                " elements, more than the multi-tensor kernels can index");
    if (cur == nullptr) cur = &launches.emplace_back();
    int slot = cur->num_tensors++;
    cur->list_index[slot] = static_cast<int64_t>(t);
    for (int64_t c = 0; c < chunks; ++c) {
      if (cur == nullptr) {  // the previous launch closed inside this tensor: carry it over
        cur = &launches.emplace_back();
        slot = cur->num_tensors++;
        cur->list_index[slot] = static_cast<int64_t>(t);
      }
      const int b = cur->num_blocks++;
      cur->blocks.tensor[b] = static_cast<unsigned char>(slot);
      cur->blocks.chunk[b] = static_cast<int32_t>(c);
      const bool last_chunk = c == chunks - 1;
      if (cur->num_blocks == kLaunchMaxBlocks ||
          (cur->num_tensors == kLaunchMaxTensors && last_chunk)) {
        cur = nullptr;
      }
    }
  }
  return launches;
}

}  // namespace amp::ops::detail
