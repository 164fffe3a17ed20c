#pragma once
// The cast cache: reduced-precision copies of parameters (leaf tensors that require grad), made
// once per weight version and reused by every op until the weights may have changed. The copies
// a training forward used are then kept and refreshed in place at their next use, all at once
// (docs/casting.md, "The cast cache").

#include <cstddef>
#include <cstdint>

#include "optamp/export.h"

namespace amp {

// Drops every cached copy, kept ones included, and frees them. (After each non-delayed
// scale_loss unscale and at the outermost amp::autocast exit the entries only go stale: the
// copies the forward used are kept for their refresh.) Needed after weights change without
// either event (docs/casting.md, "The staleness rule"), or to free the kept copies' memory.
OPTAMP_API void clear_cache();

// Entries that would be served now (kept copies awaiting their refresh are not counted), for
// tests and diagnostics.
OPTAMP_API std::size_t cache_size();

// Number of tensor casts optamp performed (cache hits excluded), for tests and diagnostics.
OPTAMP_API std::int64_t cast_count();

}  // namespace amp
