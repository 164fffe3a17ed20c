#pragma once
// The one walker over the tensors of an op's argument on a boxed stack, shared by the casting
// kernel and the O2/O5 substitution fallback: Tensor and Tensor? (an IValue holding a tensor or
// None), Tensor[] and Tensor?[] (what `index` and `index_put` take).
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

}  // namespace amp::detail
