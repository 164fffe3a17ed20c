#pragma once
// optamp: Apex-style opt-level automatic mixed precision for LibTorch.
//
//   #include <optamp/amp.h>
//   auto handle = amp::initialize(model, optimizer, "O1");
//
// This umbrella header pulls in the whole public API.

#include "optamp/ab.h"
#include "optamp/autocast.h"
#include "optamp/cast_cache.h"
#include "optamp/forward.h"
#include "optamp/fused_optimizers.h"
#include "optamp/initialize.h"
#include "optamp/loss_scaler.h"
#include "optamp/opt_level.h"
#include "optamp/policy.h"
#include "optamp/precision_probe.h"
#include "optamp/scale_loss.h"
#include "optamp/state_dict.h"
#include "optamp/version.h"
