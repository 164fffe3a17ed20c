#pragma once
// The cast cache: reduced-precision copies of parameters (leaf tensors that require grad), made
// once per weight version and reused by every op until the weights may have changed.

#include <cstddef>

#include "optamp/export.h"

namespace amp {

// Drops every cached copy (also done automatically after each non-delayed scale_loss unscale
// and at the outermost amp::autocast exit).
OPTAMP_API void clear_cache();

// Live entries, for tests and diagnostics.
OPTAMP_API std::size_t cache_size();

}  // namespace amp
