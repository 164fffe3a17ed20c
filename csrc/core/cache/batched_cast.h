#pragma once
// Casts many tensors to one dtype together: per (device, source dtype), one allocation holds
// every copy and one multi-tensor copy fills them (torch's _foreach_copy_, which converts dtypes
// on its CUDA fast path). On a GPU that is a few kernel launches for a whole model's parameters,
// where a cast per tensor costs an allocation, a TensorIterator and a launch each: host work an
// eager step of a small model waits on (cast_cache.h says when the cache uses it).
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace amp::detail {

class BatchedCast {
 public:
  explicit BatchedCast(c10::ScalarType dtype) : dtype_(dtype) {}

  // Adds `source`, which must be dense and non-overlapping (is_non_overlapping_and_dense).
  void add(at::Tensor source);

  // The copies, in the order the sources were added: each a tensor of its own, with its source's
  // sizes and strides, over its group's shared block. Made below autograd and optamp's keys (no
  // history: the caller gives each the gradient edge it needs).
  std::vector<at::Tensor> run();

 private:
  struct Group {
    std::vector<at::Tensor> sources;
    std::vector<std::size_t> positions;  // in order_
  };
  c10::ScalarType dtype_;
  std::vector<Group> groups_;
  std::vector<std::size_t> order_;  // the group of each source, in adding order
};

// A new tensor over `owner`'s storage with these sizes, strides and offset (no autograd history).
at::Tensor tensor_over(const at::Tensor& owner, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                       std::int64_t offset);

}  // namespace amp::detail
