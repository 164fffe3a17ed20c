#pragma once
// Casts that record no autograd node of their own.
//
// `source.to(dtype)` under autograd records a ToCopyBackward node; so do native autocast's casts.
// A cast made here instead takes the source's own gradient edge (its grad_fn, or a leaf's grad
// accumulator): the ops that use the cast record the edge they would have recorded had they used
// the source itself, and the autograd engine converts each gradient to the dtype its next node
// expects (validate_outputs), so the fp16/bf16 gradient arrives there as fp32, as ToCopyBackward
// would have delivered it. See autograd_cast.cpp for why and when.
#include <ATen/core/Tensor.h>

namespace amp::detail {

// Whether a cast or op made now gets autograd history: GradMode on *and* not inside a kernel
// (kernels run below autograd, with its keys excluded, while GradMode may still be on).
bool records_autograd_now();

// A dense tensor whose autograd is the engine's alone: not a Python subclass (torch.compile's
// fake and functional tensors), not functorch's, not nested or sparse, and carrying no
// forward-mode tangent. Only such tensors get casts and nodes made below autograd.
bool is_plain_for_autograd(const at::Tensor& t);

// `source` as `dtype`. With `records_autograd` (a training forward, outside any kernel) and a
// plain dense source that requires grad and is a leaf or a view of one (a parameter, `w.t()`),
// the copy borrows the source's gradient edge and no node is recorded; otherwise (activations
// included: autograd_cast.cpp says why) this is `source.to(dtype)`.
at::Tensor cast_for_autograd(const at::Tensor& source, c10::ScalarType dtype,
                             bool records_autograd);

// Gives `copy` (made below autograd) `source`'s gradient edge, as cast_for_autograd does.
void give_gradient_edge(const at::Tensor& copy, const at::Tensor& source);

}  // namespace amp::detail
