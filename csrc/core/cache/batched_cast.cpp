#include "cache/batched_cast.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

#include "dispatch/carried_state.h"

namespace amp::detail {
namespace {

// Each copy starts on a 64-byte boundary of the block, so the multi-tensor copy's vectorized
// path (16-byte aligned tensors) applies to every one of them.
constexpr std::int64_t kAlignmentBytes = 64;

std::int64_t aligned(std::int64_t elements, std::int64_t element_size) {
  const std::int64_t per_boundary = kAlignmentBytes / element_size;
  return (elements + per_boundary - 1) / per_boundary * per_boundary;
}

}  // namespace

// Made directly: as_strided would go through the dispatcher once per copy for the same result (no
// autograd view, and no checks needed for a layout the caller computed).
at::Tensor tensor_over(const at::Tensor& owner, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                       std::int64_t offset) {
  auto part = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(owner.storage()),
                                                       owner.key_set(), owner.dtype());
  part.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return part;
}

void BatchedCast::add(at::Tensor source) {
  TORCH_INTERNAL_ASSERT(source.is_non_overlapping_and_dense());
  std::size_t g = 0;
  while (g < groups_.size() && (groups_[g].sources.front().device() != source.device() ||
                                groups_[g].sources.front().scalar_type() != source.scalar_type())) {
    ++g;
  }
  if (g == groups_.size()) groups_.emplace_back();
  groups_[g].positions.push_back(order_.size());
  groups_[g].sources.push_back(std::move(source));
  order_.push_back(g);
}

// Below autograd and optamp's keys: the copies are the cache's own business, and the sources
// (O2/O5 masters) would otherwise be substituted by copies of themselves.
std::vector<at::Tensor> BatchedCast::run() {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_optamp_keys(
      c10::DispatchKeySet({kCastKey, kSubstituteKey}));
  std::vector<at::Tensor> copies(order_.size());
  const auto element_size = static_cast<std::int64_t>(c10::elementSize(dtype_));
  for (auto& group : groups_) {
    std::int64_t total = 0;
    for (const auto& s : group.sources) total += aligned(s.numel(), element_size);
    const at::Tensor block = at::empty({total}, group.sources.front().options().dtype(dtype_));
    std::vector<at::Tensor> destinations;
    destinations.reserve(group.sources.size());
    std::int64_t offset = 0;
    for (const auto& s : group.sources) {
      // Dense and non-overlapping: the copy spans numel elements whatever its strides.
      destinations.push_back(tensor_over(block, s.sizes(), s.strides(), offset));
      offset += aligned(s.numel(), element_size);
    }
    at::_foreach_copy_(destinations, group.sources);
    for (std::size_t i = 0; i < destinations.size(); ++i) {
      copies[group.positions[i]] = std::move(destinations[i]);
    }
  }
  return copies;
}

}  // namespace amp::detail
