#pragma once
// The one walker over the tensors of an op's argument, shared by the casting kernels and the
// O2/O5 substitution kernels. On a boxed stack: Tensor and Tensor? (an IValue holding a tensor or
// None), Tensor[] and Tensor?[] (what `index` and `index_put` take). Unboxed (arguments as an
// at::_ops signature takes them): Tensor and Tensor?; any other argument passes through.
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <utility>

namespace amp::detail {

// Calls `fn(const at::Tensor&) -> std::optional<at::Tensor>` on every tensor in `value` and
// stores the tensor it returns, if any, in place of the one it was given.
template <typename Fn>
void rewrite_tensors_in(c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    if (auto replaced = fn(value.toTensor())) value = c10::IValue(std::move(*replaced));
  } else if (value.isTensorList()) {
    auto list = value.toTensorList();
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (auto replaced = fn(list.get(i))) list.set(i, std::move(*replaced));
    }
  } else if (value.isList()) {  // Tensor?[] (other lists hold no tensors and are skipped)
    auto generic = value.toList();
    if (!generic.elementType()->isSubtypeOf(*c10::OptionalType::ofTensor())) return;
    auto list = c10::impl::toTypedList<std::optional<at::Tensor>>(std::move(generic));
    for (std::size_t i = 0; i < list.size(); ++i) {
      std::optional<at::Tensor> item = list.get(i);
      if (!item) continue;
      if (auto replaced = fn(*item)) list.set(i, std::optional<at::Tensor>(std::move(*replaced)));
    }
  }
}

// Read only: `fn(const at::Tensor&)` on every tensor in `value`.
template <typename Fn>
void visit_tensors_in(const c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    fn(value.toTensor());
  } else if (value.isTensorList()) {
    const auto list = value.toTensorList();
    for (std::size_t i = 0; i < list.size(); ++i) fn(list.get(i));
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor()) fn(item.toTensor());
    }
  }
}

// The unboxed form: the argument as `fn(const at::Tensor&) -> std::optional<at::Tensor>`
// rewrites it (nullopt: kept as it came).
template <typename Fn>
at::Tensor rewrite_tensor_arg(const at::Tensor& t, Fn&& fn) {
  auto replaced = fn(t);
  return replaced ? std::move(*replaced) : t;
}
// A mutable tensor (`Tensor(a!)`: an in-place op's self, an out= argument) is the op's output:
// handed on as it came, as the boxed kernels skip written arguments.
template <typename Fn>
at::Tensor& rewrite_tensor_arg(at::Tensor& t, Fn&& /*fn*/) {
  return t;
}
template <typename Fn>
std::optional<at::Tensor> rewrite_tensor_arg(const std::optional<at::Tensor>& t, Fn&& fn) {
  if (!t) return t;
  return rewrite_tensor_arg(*t, std::forward<Fn>(fn));
}
template <typename T, typename Fn>
const T& rewrite_tensor_arg(const T& value, Fn&& /*fn*/) {
  return value;
}

// Unboxed, read only: `fn(const at::Tensor&)` on a Tensor or a present Tensor? argument.
template <typename Fn>
void visit_tensor_arg(const at::Tensor& t, Fn&& fn) {
  fn(t);
}
template <typename Fn>
void visit_tensor_arg(const std::optional<at::Tensor>& t, Fn&& fn) {
  if (t) fn(*t);
}
template <typename T, typename Fn>
void visit_tensor_arg(const T& /*not a tensor*/, Fn&& /*fn*/) {}

}  // namespace amp::detail
