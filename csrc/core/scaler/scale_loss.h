#pragma once
// Internal: how the tensor-level scale_loss (optamp/core.h) and the scalers' checks name a
// parameter in error messages.

#include <ATen/core/Tensor.h>

#include <string>

namespace amp::detail {

// "fc.weight (<where>)" when the session has the model's name for `p`, else `where`: how error
// messages name a parameter (the floor error adds the shape: "fc.weight (<where>, shape [4, 2])").
std::string param_label(const at::Tensor& p, const std::string& where);

// What the guards recorded about a parameter between guards: its .grad holds scaled gradients
// (delay_unscale), or a guard reset it after an overflow since its last amp::step. Taken off a
// TensorImpl before torch.utils.swap_tensors hands it to another tensor, put back on the one the
// parameter holds afterwards (tensor_swap.h).
struct ScaledGradMarks {
  bool pending = false;
  bool overflowed = false;
};
ScaledGradMarks take_scaled_grad_marks(const c10::TensorImpl* impl);
void put_scaled_grad_marks(const at::Tensor& p, ScaledGradMarks marks);

}  // namespace amp::detail
