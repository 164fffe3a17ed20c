#pragma once
// optamp: Apex-style opt-level automatic mixed precision for LibTorch.
//
//   #include <optamp/amp.h>
//   auto handle = amp::initialize(model, optimizer, "O1");
//
// This umbrella header pulls in the whole public API.

#include "optamp/opt_level.h"
#include "optamp/version.h"
