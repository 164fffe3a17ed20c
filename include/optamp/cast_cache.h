#pragma once
// The cast cache: reduced-precision copies of parameters (leaf tensors that require grad), made
// once per weight version and reused by every op until the weights may have changed.

#include <cstddef>
#include <cstdint>

#include "optamp/export.h"

namespace amp {

// Drops every cached copy (also done automatically after each non-delayed scale_loss unscale
// and at the outermost amp::autocast exit).
OPTAMP_API void clear_cache();

// Live entries, for tests and diagnostics.
OPTAMP_API std::size_t cache_size();

// Number of tensor casts optamp performed (cache hits excluded), for tests and diagnostics.
OPTAMP_API std::int64_t cast_count();

}  // namespace amp
