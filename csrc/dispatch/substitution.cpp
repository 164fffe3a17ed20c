// The substitution fallback. Ops whose job is to hand back a tensor's own data (detach, alias,
// clone, to/_to_copy, copy_, set_, item, equal, autograd metadata) get fallthrough kernels on the
// key, so `p.detach().clone()` stays fp32 and those ops pay nothing. View ops are substituted, so
// `x @ w.t()` reuses the cached copy instead of casting a fresh view each call.
#include "dispatch/substitution.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "cache/cast_cache.h"
#include "dispatch/cast_state.h"
#include "dispatch/registration.h"
#include "dispatch/tensor_args.h"

namespace amp::detail {
namespace {

// A registered model tensor and its dtype at initialize (the master's, fp32 normally).
struct Source {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  c10::ScalarType dtype;
};
using SourceMap = std::unordered_map<const c10::TensorImpl*, Source>;

// Read on every op at O2, written only by initialize/reset: an immutable snapshot swapped
// atomically, so readers take no lock.
std::shared_ptr<const SourceMap>& sources_slot() {
  static auto* slot = new std::shared_ptr<const SourceMap>(std::make_shared<SourceMap>());
  return *slot;
}

std::shared_ptr<const SourceMap> load_sources() { return std::atomic_load(&sources_slot()); }

constexpr const char* kOwnDataOps[] = {
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::clone",
    "aten::_to_copy",
    "aten::to",
    "aten::copy_",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::set_",
    "aten::lift",
    "aten::lift_fresh",
    "aten::lift_fresh_copy",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::requires_grad_",
    "aten::retain_grad",
    "aten::retains_grad",
    "aten::_version",
    "aten::output_nr",
    "aten::is_leaf",
    "aten::_base",
    "aten::data",
    "aten::_fw_primal",
    "aten::_make_dual",
    "aten::_has_compatible_shallow_copy_type",
    "aten::cpu",
    "aten::cuda",
    "aten::contiguous",
    "aten::equal",
};

bool substitution_active(c10::ScalarType* dtype) {
  thread_cast_state();  // catches up with resets and frames ended on other threads
  const CarriedMode carried = carried_mode();
  if (carried.mode == kDisabled) return false;
  // Inside a kernel (below autograd) the tensors are the kernel's business: an op excluded from
  // substitution (equal, clone, ...) must see fp32 all the way down.
  if (c10::impl::tls_local_dispatch_key_set().excluded_.has_any(c10::autograd_dispatch_keyset)) {
    return false;
  }
  if (carried.mode == kRegion) {
    *dtype = carried.dtype;
    return true;
  }
  if (level_decision_rules() == RuleSet::kNone) return false;  // the no_grad gate
  *dtype = level_low_dtype();
  return *dtype != c10::ScalarType::Undefined;
}

void substitute_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kSubstituteKey);
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  const auto sources = load_sources();
  if (sources->empty() || !substitution_active(&dtype)) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const auto& args = op.schema().arguments();
  const std::size_t base = stack->size() - args.size();
  c10::impl::ExcludeDispatchKeyGuard no_recursion(kSubstituteKey);
  auto working_copy = [&](const at::Tensor& t) -> std::optional<at::Tensor> {
    if (!t.defined() || t.scalar_type() == dtype || !t.is_floating_point()) return std::nullopt;
    const auto source = sources->find(t.unsafeGetTensorImpl());
    if (source == sources->end()) return std::nullopt;
    // The model was cast after initialize (model->to(torch::kDouble)): its masters are no longer
    // what the working copies stand for, and torch would fail further down with a mixed-dtype
    // error that does not say why.
    TORCH_CHECK_VALUE(t.scalar_type() == source->second.dtype,
                      "a model tensor registered by amp::initialize (O2/O5) must still be ",
                      dtype_name(source->second.dtype), ", got ", dtype_name(t.scalar_type()),
                      " of shape ", t.sizes(),
                      ": the model was cast after initialize (e.g. model->to(torch::kDouble)), "
                      "which optamp does not follow. Call amp::reset(), cast the model, and "
                      "initialize again (or cast before initialize); moving it to another device "
                      "is fine.");
    c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
    return cast_through_cache(t, dtype, /*always_cache=*/true).tensor;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) continue;
    rewrite_tensors_in((*stack)[base + i], working_copy);
  }
  op.redispatchBoxed(below, stack);
}

void ensure_substitution_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kSubstituteKey),
                "optamp's O2/O5 need the dispatch key ", kSubstituteKey,
                " for parameter "
                "substitution, but another library registered a fallback on it (a device backend "
                "using that key is loaded). Use O1/O4, or run without that backend.");
    static auto* fallback =
        new torch::Library(torch::Library::IMPL, "_", kSubstituteKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&substitute_fallback>());
    static auto* own_data =
        new torch::Library(torch::Library::IMPL, "aten", kSubstituteKey, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      for (const char* excluded : kOwnDataOps) {
        if (name.name != excluded) continue;
        own_data->impl(qualified(name).c_str(), torch::CppFunction::makeFallthrough());
      }
    }
  });
}

}  // namespace

void set_working_copy_sources(const std::vector<at::Tensor>& tensors) {
  ensure_substitution_registered();
  auto map = std::make_shared<SourceMap>();
  for (const auto& t : tensors) {
    map->emplace(
        t.unsafeGetTensorImpl(),
        Source{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), t.scalar_type()});
  }
  std::atomic_store(&sources_slot(), std::shared_ptr<const SourceMap>(std::move(map)));
}

void clear_working_copy_sources() {
  std::atomic_store(&sources_slot(),
                    std::shared_ptr<const SourceMap>(std::make_shared<SourceMap>()));
}

void activate_substitution_thread(bool on) {
  if (on) ensure_substitution_registered();
  c10::impl::tls_set_dispatch_key_included(kSubstituteKey, on);
  c10::impl::tls_set_dispatch_key_excluded(kSubstituteKey, !on);
}

bool substitution_thread_on() { return c10::impl::tls_is_dispatch_key_included(kSubstituteKey); }

}  // namespace amp::detail
