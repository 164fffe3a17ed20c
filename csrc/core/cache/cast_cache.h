#pragma once
// Cached reduced-precision copies of parameters.
//
// Why a cache: a model's weights are cast once per weight version instead of once per use, so
// a weight used by several ops (tied embeddings, a layer applied per time step, micro-batches
// under gradient accumulation) costs one cast and one copy in memory. Only leaves that require
// grad are cached (parameters): activations change every call and would only grow the cache.
//
// Why entries are keyed by TensorImpl* with a weak reference and the version counter: an
// address can be reused after a parameter dies (the weak reference tells), and in-place updates
// through the tensor itself bump the version. Updates through `p.data()` (LibTorch's C++
// optimizers) do not, so the cache is also cleared on the "weights may change" event (end of a
// non-delayed scale_loss unscale) and at the outermost amp::autocast exit.
//
// Entries made under no_grad have no autograd history and are never served to code that
// records autograd, and vice versa: the grad mode is part of the key.
//
// Why the copies of a step are re-cast all at once (invalidate_cache): a step casts the same
// parameters as the step before. One batch (batched_cast.h) costs a few kernel launches on a GPU
// where a cast per parameter costs an allocation and a launch each: host work that an eager GPU
// step of a small model waits on.
#include <ATen/core/Tensor.h>

#include <cstddef>

namespace amp::detail {

struct CastResult {
  at::Tensor tensor;
  bool performed_cast;  // false on a cache hit
};

// `source` cast to `dtype`; cacheable sources go through the cache. The caller has excluded
// optamp's dispatch key (the .to() must not re-enter the casting kernels).
// `always_cache`: registered model tensors (O2/O5 working copies) are cached even when they
// don't require grad (buffers).
CastResult cast_through_cache(const at::Tensor& source, c10::ScalarType dtype,
                              bool always_cache = false);

// Counts a cast performed outside the cache (the public counter is amp::cast_count()).
void count_cast();

// The weights may change (the end of a non-delayed scale_loss unscale, the outermost
// amp::autocast exit): every copy is released, with this thread's companion copies. The copies a
// training forward used are re-cast all at once by the next use of any of them.
// amp::clear_cache() also forgets which those were.
void invalidate_cache();

// Entries waiting for their re-cast (tests).
std::size_t cache_entries_waiting_for_recast();

// Drops every cached copy of `source` (tensor_swap.h).
void forget_casts_of(const c10::TensorImpl* source);

}  // namespace amp::detail
