#pragma once
// Internal: what the tensor-level scale_loss (optamp/core.h) shares with initialize and with the
// torch::optim front.

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace amp::detail {

// For amp::step: refuses (c10::Error naming labels[i]) a parameter that still holds scaled
// gradients, and returns whether any of `params` overflowed in a guard since its last step
// (forgetting it).
bool take_step_overflows(const std::vector<at::Tensor>& params,
                         const std::vector<std::string>& labels);

// Optional: a better name for a parameter in the floor error (e.g. "fc.weight"), installed by
// initialize, which knows the model. Returns nullopt when unknown.
using ParamNamer = std::function<std::optional<std::string>(const at::Tensor&)>;
void set_param_namer(ParamNamer namer);

}  // namespace amp::detail
