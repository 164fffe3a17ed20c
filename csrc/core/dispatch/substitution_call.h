#pragma once
// One op call on the substitution key: whether substitution applies to it, and the working copy
// of each registered model tensor among its arguments. Shared by the boxed fallback and the
// unboxed kernels of the hottest ops (substitution_kernels.cpp), so both decide the same way.
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>

#include "dispatch/substitution.h"
#include "session.h"

namespace torch {
class Library;
}

namespace amp::detail {

// Whether `t` carries the substitution key (read atomically: initialize and reset change it while
// other threads dispatch). Views and detached aliases of a source carry it too (torch copies a
// tensor's key set to them), so this is only the first, constant-time filter.
bool carries_substitution_key(const at::Tensor& t);
// The registered buffer `t` is a view of (nullptr: none, or a parameter's view).
const WorkingCopySource* viewed_buffer(const WorkingCopySources& sources, const at::Tensor& t);

// The dispatch keys below the substitution key, to redispatch with.
inline c10::DispatchKeySet below_substitution(c10::DispatchKeySet keys) {
  return keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kSubstituteKey);
}

// Puts the key back on `impl` when it is a registered source (after set_data replaced its key
// set).
void remark_if_source(c10::TensorImpl* impl);
// Puts the key on `impl` or takes it off (a registration moved to another TensorImpl:
// tensor_swap.cpp).
void put_substitution_key(c10::TensorImpl* impl, bool on);
// Wraps autograd's VariableHooks so that every set_data calls remark_if_source (set_data_hook.cpp).
void install_set_data_hook();

// How many op calls reached the substitution key on this thread (a test and benchmark probe:
// ops without a registered tensor argument must never get there).
std::uint64_t substitution_calls_on_this_thread();

// The unboxed kernels of the hottest ops and of set_data, on the key (substitution_kernels.cpp).
void register_substitution_kernels(torch::Library& aten_on_key);

// Whether an argument is complex (a complex tensor or scalar). A call with one reads the fp32
// masters: working copies would make its result complex32 (fp16: an experimental type with few
// kernels, none for exp, log or sum on the CPU) or round the values that enter it to bf16 (an
// S4D layer's `1j * a_imag`, whose multiples of pi bf16 rounds to 9.4375 for 3 pi), where the
// complex arithmetic gains nothing from them.
inline bool is_complex_argument(const at::Tensor& t) { return t.defined() && t.is_complex(); }
inline bool is_complex_argument(const std::optional<at::Tensor>& t) {
  return t && is_complex_argument(*t);
}
inline bool is_complex_argument(const c10::Scalar& s) { return s.isComplex(); }
template <typename T>
bool is_complex_argument(const T& /*neither a tensor nor a scalar*/) {
  return false;
}

class SubstitutionCall {
 public:
  // Decides whether this call substitutes. While it does, the key is excluded on the thread (the
  // op's own inner calls see the working copies already, and the casts must not recurse).
  SubstitutionCall();
  bool active() const { return active_; }
  // The working copies' dtype while active.
  c10::ScalarType dtype() const { return dtype_; }
  // The working copy standing for `t`, or nullopt when `t` is not a registered source (or is
  // already in the working dtype). Throws when a source was cast after initialize.
  // A view of a registered buffer gets a cast of its own, made for this call.
  std::optional<at::Tensor> working_copy(const at::Tensor& t) const;
  // For a view op's arguments: a registered parameter's working copy; buffers (nullopt) keep
  // their own data, so that writes through the view reach them (substitution.cpp).
  std::optional<at::Tensor> view_working_copy(const at::Tensor& t) const;
  // A copy of `t` in the working dtype made for this call alone (not cached), for an argument
  // the op writes although its schema does not say so (the running statistics of batch norm);
  // nullopt as for working_copy.
  std::optional<at::Tensor> private_copy(const at::Tensor& t) const;

 private:
  // The constant-time filter both lookups start with: `t` carries the key (a source, or a view or
  // alias of one), is floating and not already in the working dtype.
  bool may_stand_for_a_source(const at::Tensor& t) const;
  // The registered source `t` is when this call substitutes it, else nullptr (throws as
  // working_copy does).
  const WorkingCopySource* source_of(const at::Tensor& t) const;
  // source_of without the filter, for a `t` that passed it.
  const WorkingCopySource* registered_source(const at::Tensor& t) const;

  bool active_ = false;
  c10::ScalarType dtype_ = c10::ScalarType::Undefined;
  std::shared_ptr<const Session> session_;  // its working_copy_sources, for this call
  std::optional<c10::impl::ExcludeDispatchKeyGuard> no_recursion_;
};

}  // namespace amp::detail
