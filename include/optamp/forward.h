#pragma once
// amp::forward: Apex's model boundary for LibTorch modules (docs/cpp.md, "The model boundary").
//
//   auto handle = amp::initialize(model, optimizer, "O2");
//   auto logits = amp::forward(model, x);   // x cast to fp16 on the way in, logits fp32 out
//
// Apex patches the forward of the models given to initialize so that floating inputs are cast to
// the model's dtype and floating outputs to fp32 (or cast_model_outputs), "so the user never
// needs to call .half()". Python's optamp.initialize wraps forward the same way. A LibTorch
// module's forward is a plain member function that nothing can wrap, so C++ calls it through
// amp::forward, which applies the same casts and otherwise is `model->forward(args...)`.
// model->forward(x) called directly runs without the boundary (fp16/bf16 outputs at O2/O3/O5).

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "optamp/export.h"
#include "optamp/opt_level.h"

namespace amp {

// The casts amp::forward applies to `model` on this thread now (Properties::model_boundary; at
// O2/O5 inputs are cast to the working copies' dtype only where ops see working copies, so under
// no_grad or on another thread they are cast to fp32, the masters' dtype). Nothing for a model
// initialize was not given, or when not initialized.
OPTAMP_API ModelBoundary model_boundary(const torch::nn::Module& model);

// A floating output of an initialized model cast to `dtype`, as amp::forward casts them. At O2/O5
// the reduced output stays with its fp32 cast, so that a loss of the fp32 logits (cross_entropy)
// reads the reduced ones without a second widened copy, as at O1 (docs/cpp.md).
OPTAMP_API at::Tensor cast_model_output(const at::Tensor& output, c10::ScalarType dtype);

namespace detail {

template <typename T>
struct is_std_vector : std::false_type {};
template <typename T, typename A>
struct is_std_vector<std::vector<T, A>> : std::true_type {};
template <typename T>
struct is_std_tuple : std::false_type {};
template <typename... Ts>
struct is_std_tuple<std::tuple<Ts...>> : std::true_type {};
template <typename A, typename B>
struct is_std_tuple<std::pair<A, B>> : std::true_type {};
template <typename T>
struct is_std_optional : std::false_type {};
template <typename T>
struct is_std_optional<std::optional<T>> : std::true_type {};

inline at::Tensor cast_floating(const at::Tensor& t, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined || !t.defined() || !t.is_floating_point() ||
      t.scalar_type() == dtype) {
    return t;
  }
  return t.to(dtype);
}

// The cast of a tensor at the boundary: cast_floating for inputs, cast_model_output for outputs.
using BoundaryCast = at::Tensor (*)(const at::Tensor&, c10::ScalarType);

// `value` with the floating tensors inside it (a tensor, or vectors, tuples, pairs and optionals
// of them, nested) cast to `dtype` by `cast`; anything else is handed on as it is.
template <typename T>
decltype(auto) cast_floating_in(T&& value, c10::ScalarType dtype, BoundaryCast cast) {
  using Value = std::decay_t<T>;
  if constexpr (std::is_same_v<Value, at::Tensor>) {
    return cast(value, dtype);
  } else if constexpr (is_std_vector<Value>::value) {
    std::vector<std::decay_t<decltype(cast_floating_in(value.front(), dtype, cast))>> out;
    out.reserve(value.size());
    for (auto& item : value) out.push_back(cast_floating_in(item, dtype, cast));
    return out;
  } else if constexpr (is_std_tuple<Value>::value) {
    return std::apply(
        [dtype, cast](auto&... items) { return Value(cast_floating_in(items, dtype, cast)...); },
        value);
  } else if constexpr (is_std_optional<Value>::value) {
    return value ? Value(cast_floating_in(*value, dtype, cast)) : Value();
  } else {
    return static_cast<T&&>(value);  // not a tensor container: passed through untouched
  }
}

template <typename Model>
decltype(auto) module_of(Model& model) {
  if constexpr (std::is_base_of_v<torch::nn::Module, Model>) {
    return (model);
  } else {
    return (*model);  // a torch::nn::ModuleHolder or a shared_ptr to a module
  }
}

}  // namespace detail

// model->forward(args...) with the boundary of amp::model_boundary(model): floating tensors in
// `args` (also inside vectors, tuples, pairs, optionals) are cast to its input dtype, floating
// tensors in the result to its output dtype. `model` is a ModuleHolder (`Net net;` from
// TORCH_MODULE, torch::nn::Sequential), a shared_ptr to a module, or a module. Casts record
// autograd, so gradients flow back to the inputs in their own dtype.
template <typename Model, typename... Args>
auto forward(Model& model, Args&&... args) {
  auto& module = detail::module_of(model);
  const ModelBoundary boundary = model_boundary(static_cast<const torch::nn::Module&>(module));
  if (!boundary.casts()) return module.forward(std::forward<Args>(args)...);
  auto output = module.forward(detail::cast_floating_in(std::forward<Args>(args), boundary.inputs,
                                                        &detail::cast_floating)...);
  return decltype(output)(
      detail::cast_floating_in(std::move(output), boundary.outputs, &cast_model_output));
}

}  // namespace amp
