#pragma once
// Internal: how the tensor-level scale_loss (optamp/core.h) and the scalers' checks name a
// parameter in error messages.

#include <ATen/core/Tensor.h>

#include <string>

namespace amp::detail {

// "fc.weight (<where>)" when the session has the model's name for `p`, else `where`: how error
// messages name a parameter (the floor error adds the shape: "fc.weight (<where>, shape [4, 2])").
std::string param_label(const at::Tensor& p, const std::string& where);

}  // namespace amp::detail
