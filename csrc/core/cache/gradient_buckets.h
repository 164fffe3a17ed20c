#pragma once
// The gradients of a step's batched copies, converted a bucket at a time.
//
// A cached copy borrows its parameter's gradient edge (autograd_cast.h), so the engine converts
// each copy's fp16/bf16 gradient to fp32 on its own: on a GPU an allocation, a TensorIterator and
// a kernel launch per parameter in every backward (GPT-2 small at O2: 149; native autocast's
// ToCopyBackward nodes make 123). The copies the cache re-casts together (cast_cache.h) instead
// lead, a bucket of consecutive ones at a time, into one node (ConvertGradientsBackward) that
// converts the gradients it received with one multi-tensor copy and hands each to its parameter.
//
// Buckets follow the order the previous step first used the copies in, so a bucket's gradients
// arrive close together (a backward visits the layers in reverse) and the node runs as soon as the
// last of them does: what waits is at most one bucket's reduced gradients (kBucketBytes). The
// values are the engine's conversion's, bit for bit. gradient_buckets.cpp says which copies keep
// the edge of their own (a gradient hook, DDP's reducer among them, wants each gradient when it
// is computed) and how a copy used twice in a step still sums its gradients in fp32.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

class GradientBuckets {
 public:
  // Reduced-precision bytes a bucket collects before the next one starts (a copy larger than
  // this has a bucket of its own).
  static constexpr std::int64_t kBucketBytes = std::int64_t{32} << 20;

  // Whether `source`'s gradient may wait in a bucket: a plain leaf that requires grad, with no
  // hook on its gradient or its grad accumulator, on a device where a conversion of its own costs
  // a kernel launch: not the CPU, unless set_gradient_buckets_on_cpu (optamp/cast_cache.h) turned
  // buckets on there.
  static bool admits(const at::Tensor& source);

  // `copy` (made below autograd from `source`, which admits() allowed) gets the next input of the
  // current bucket as its gradient edge; the bucket hands that gradient, converted to `source`'s
  // dtype, to `source`'s own gradient edge. Call in the order the copies were used.
  void add(const at::Tensor& copy, const at::Tensor& source);

 private:
  std::shared_ptr<torch::autograd::Node> bucket_;
  std::int64_t bucket_bytes_ = 0;
};

// A new tensor over `copy`'s memory whose gradient edge is `source`'s own: what a second use of a
// bucketed copy in one step is given (gradient_buckets.cpp says why).
at::Tensor alias_with_own_edge(const at::Tensor& copy, const at::Tensor& source);

}  // namespace amp::detail
