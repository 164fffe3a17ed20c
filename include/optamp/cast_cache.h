#pragma once
// The cast cache: reduced-precision copies of parameters (leaf tensors that require grad), made
// once per weight version and reused by every op until the weights may have changed. The copies
// a training forward used are then made again, all at once, at the next use of any of them
// (docs/casting.md, "The cast cache").

#include <cstddef>
#include <cstdint>

#include "optamp/export.h"

namespace amp {

// Drops every cached copy and forgets which to make together next. (After each non-delayed
// scale_loss unscale and at the outermost amp::autocast exit the copies are released too, and
// the cache remembers which the forward used.) Needed after weights change without either event
// (docs/casting.md, "The staleness rule").
OPTAMP_API void clear_cache();

// Entries that would be served now (those waiting for the next step's batch are not counted),
// for tests and diagnostics.
OPTAMP_API std::size_t cache_size();

// Number of tensor casts optamp performed (cache hits excluded), for tests and diagnostics.
OPTAMP_API std::int64_t cast_count();

// Converts the gradients of CPU parameters' batched copies a bucket at a time too, as a GPU's are
// (docs/casting.md, "Casts in the autograd graph"); returns the previous setting. Off by default:
// the CPU converts a gradient without a kernel launch, so there a bucket only costs its node and
// its inputs' metadata (C++ GPT step at O2: +1.6% host instructions at 2 layers, +2.8% at 12).
// For tests, which check on the CPU what a GPU step does, and for counting a GPU step's launches
// on the CPU (benchmarks/step_icount.py --launches).
OPTAMP_API bool set_gradient_buckets_on_cpu(bool enabled);

// Off: every gradient keeps its own conversion, on every device (on by default; returns the
// previous setting). A bucket delivers its gradients when its first layer's arrives, so code that
// reads a module's parameter gradients once the gradients of the module's inputs are computed
// would find none yet. FSDP2's fully_shard does (its reduce-scatter runs then, and a gradient
// that comes later is never reduced): Python's initialize turns buckets off for a model with
// sharded (DTensor) parameters, and reset turns them on again.
OPTAMP_API bool set_gradient_buckets(bool enabled);

}  // namespace amp
