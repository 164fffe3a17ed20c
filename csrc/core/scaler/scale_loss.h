#pragma once
// Internal: what the tensor-level scale_loss (optamp/core.h) shares with initialize
// (core/initialize.cpp): the model's names for parameters in error messages.

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace amp::detail {

// Optional: the model's name for a parameter (e.g. "fc.weight"), installed by initialize, which
// knows the model. Returns nullopt when unknown. The one place parameter names live: both fronts
// pass positional labels ("optimizer 0 param_groups[0].params[1]") and the messages add the name.
using ParamNamer = std::function<std::optional<std::string>(const at::Tensor&)>;
void set_param_namer(ParamNamer namer);
// "fc.weight (<where>)" when the namer knows `p`, else `where`: how error messages name a
// parameter (the floor error adds the shape: "fc.weight (<where>, shape [4, 2])").
std::string param_label(const at::Tensor& p, const std::string& where);

}  // namespace amp::detail
