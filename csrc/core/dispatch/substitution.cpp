// The substitution key: which tensors carry it, the per-thread switch, the boxed fallback, and
// the fallthroughs. Ops whose job is to hand back a tensor's own data (detach, alias, clone,
// to/_to_copy, copy_, set_, item, equal, autograd metadata) get fallthrough kernels on the key,
// so `p.detach().clone()` stays fp32 and those ops pay nothing. View ops are substituted, so
// `x @ w.t()` reuses the cached copy instead of casting a fresh view each call.
#include "dispatch/substitution.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cache/cast_cache.h"
#include "dispatch/cast_decision.h"
#include "dispatch/registration.h"
#include "dispatch/substitution_call.h"
#include "dispatch/tensor_args.h"
#include "dispatch/thread_frames.h"

namespace amp::detail {
namespace {

// ---- the key on the tensors ----------------------------------------------------------------
// TensorImpl keeps its key set protected: torch itself sets it at construction (a backend's
// autocast key included) and copies it to views and detached aliases. A pointer to the member,
// formed through a derived class, is the one way to add a key to a live tensor. The update is
// atomic on our side: dispatch on other threads reads the key set while initialize or reset
// may change it.
struct KeySetAccess : c10::TensorImpl {
  static std::uint64_t* raw(c10::TensorImpl* impl) {
    c10::DispatchKeySet c10::TensorImpl::*member = &KeySetAccess::key_set_;
    return reinterpret_cast<std::uint64_t*>(&(impl->*member));
  }
};
static_assert(sizeof(c10::DispatchKeySet) == sizeof(std::uint64_t),
              "DispatchKeySet is expected to be one 64-bit word");

const std::uint64_t kKeyBit = c10::DispatchKeySet(kSubstituteKey).raw_repr();

void put_key(c10::TensorImpl* impl, bool on) {
  if (on) {
    __atomic_fetch_or(KeySetAccess::raw(impl), kKeyBit, __ATOMIC_RELAXED);
  } else {
    __atomic_fetch_and(KeySetAccess::raw(impl), ~kKeyBit, __ATOMIC_RELAXED);
  }
}

void put_key_on_all(const WorkingCopySources& sources, bool on) {
  for (const auto& entry : sources) {
    if (auto impl = entry.second.ref.lock()) put_key(impl.get(), on);
  }
}

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

// torch's fused optimizer steps write every tensor list they take (parameters, grads, states,
// step counts); the tensors they only read are the scale and the overflow flag. Substitution
// never applies to them, and falling through spares each step boxing its lists (6 lists of every
// parameter for AdamW): the parameters carry the key, so without this the step would reach the
// boxed fallback.
constexpr const char* kOptimizerStepOps[] = {
    "aten::_fused_adam_",
    "aten::_fused_adamw_",
    "aten::_fused_sgd_",
    "aten::_fused_adagrad_",
};

// Whether a call holding `level` (its session's rules) substitutes, and in which dtype.
bool substitution_active(const LevelRules& level, c10::ScalarType* dtype) {
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
  const CastDecision decision = level_decision(level, carried);
  if (decision.rules == RuleSet::kNone) return false;  // the no_grad gate
  *dtype = decision.low;
  return *dtype != c10::ScalarType::Undefined;
}

// Batch norm and instance norm (batch_norm, native_batch_norm, _batch_norm_impl_index,
// cudnn_batch_norm, instance_norm, ...) update their running statistics in place while training,
// and SyncBatchNorm's batch_norm_gather_stats_with_counts and batch_norm_update_stats always do,
// but their schemas do not mark those arguments written (`Tensor? running_mean`). A registered
// buffer there (a batch norm under keep_batchnorm_fp32=False, an InstanceNorm that tracks its
// statistics) used to get its cached working copy, which the kernel updated and the step then
// dropped: the fp32 buffer never moved, and evaluation used the initial statistics. Such a call
// hands each statistic a private copy and copies the update back into the fp32 buffer, as
// Apex's fp16 module updated its fp16 buffers. Outside training they are read like any argument.
bool is_running_statistic(const c10::Argument& arg) {
  return arg.name() == "running_mean" || arg.name() == "running_var";
}

// Whether a call with running statistics among its arguments updates them: its training flag,
// or always where it has none.
bool updates_running_statistics(const std::vector<c10::Argument>& args,
                                const torch::jit::Stack& stack, std::size_t base) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& name = args[i].name();
    if ((name == "training" || name == "train" || name == "use_input_stats") &&
        stack[base + i].isBool()) {
      return stack[base + i].toBool();
    }
  }
  return true;
}

// Ops without an unboxed kernel (substitution_kernels.cpp): every tensor argument that is not
// written is looked at.
void substitute_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  SubstitutionCall call;
  std::vector<std::pair<at::Tensor, at::Tensor>> updated_statistics;  // (fp32 buffer, its copy)
  if (call.active()) {
    const auto& args = op.schema().arguments();
    const std::size_t base = stack->size() - args.size();
    const bool updating = std::any_of(args.begin(), args.end(), is_running_statistic) &&
                          updates_running_statistics(args, *stack, base);
    auto working_copy = [&call](const at::Tensor& t) { return call.working_copy(t); };
    for (std::size_t i = 0; i < args.size(); ++i) {
      if (args[i].alias_info() && args[i].alias_info()->isWrite()) continue;
      c10::IValue& value = (*stack)[base + i];
      if (updating && is_running_statistic(args[i]) && value.isTensor()) {
        at::Tensor buffer = value.toTensor();
        if (auto copy = call.private_copy(buffer)) {
          updated_statistics.emplace_back(std::move(buffer), *copy);
          value = c10::IValue(std::move(*copy));
        }
        continue;
      }
      rewrite_tensors_in(value, working_copy);
    }
  }
  op.redispatchBoxed(below_substitution(keys), stack);
  if (!updated_statistics.empty()) {
    c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
    c10::NoGradGuard no_grad;
    for (auto& [buffer, copy] : updated_statistics) buffer.copy_(copy);
  }
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
    static auto* kernels =
        new torch::Library(torch::Library::IMPL, "aten", kSubstituteKey, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    auto falls_through = [](const std::string& op) {
      const auto named = [&op](const char* excluded) { return op == excluded; };
      return std::any_of(std::begin(kOwnDataOps), std::end(kOwnDataOps), named) ||
             std::any_of(std::begin(kOptimizerStepOps), std::end(kOptimizerStepOps), named);
    };
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (falls_through(name.name)) {
        kernels->impl(qualified(name).c_str(), torch::CppFunction::makeFallthrough());
      }
    }
    register_substitution_kernels(*kernels);
    install_set_data_hook();
  });
}

}  // namespace

namespace {
thread_local std::uint64_t t_substitution_calls = 0;
}  // namespace

std::uint64_t substitution_calls_on_this_thread() { return t_substitution_calls; }

SubstitutionCall::SubstitutionCall() : session_(current_session()) {
  ++t_substitution_calls;
  if (session_->working_copy_sources.empty() || !substitution_active(session_->rules, &dtype_)) {
    return;
  }
  active_ = true;
  no_recursion_.emplace(kSubstituteKey);
}

bool SubstitutionCall::substitutes(const at::Tensor& t) const {
  if (!carries_substitution_key(t) || t.scalar_type() == dtype_ || !t.is_floating_point()) {
    return false;
  }
  const auto& sources = session_->working_copy_sources;
  const auto source = sources.find(t.unsafeGetTensorImpl());
  if (source == sources.end()) return false;  // a view or detached alias of a source
  // The model was cast after initialize (model->to(torch::kDouble)): its masters are no longer
  // what the working copies stand for, and torch would fail further down with a mixed-dtype
  // error that does not say why.
  TORCH_CHECK_VALUE(t.scalar_type() == source->second.dtype,
                    "a model tensor registered by amp::initialize (O2/O5) must still be ",
                    dtype_name(source->second.dtype), ", got ", dtype_name(t.scalar_type()),
                    " of shape ", t.sizes(), kCastAfterInitialize);
  return true;
}

std::optional<at::Tensor> SubstitutionCall::working_copy(const at::Tensor& t) const {
  if (!substitutes(t)) return std::nullopt;
  c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
  return cast_through_cache(t, dtype_, /*always_cache=*/true).tensor;
}

std::optional<at::Tensor> SubstitutionCall::private_copy(const at::Tensor& t) const {
  if (!substitutes(t)) return std::nullopt;
  c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
  return t.to(dtype_);
}

bool carries_substitution_key(const at::Tensor& t) {
  return t.defined() &&
         (__atomic_load_n(KeySetAccess::raw(t.unsafeGetTensorImpl()), __ATOMIC_RELAXED) &
          kKeyBit) != 0;
}

void remark_if_source(c10::TensorImpl* impl) {
  if (impl != nullptr && current_session()->working_copy_sources.count(impl) != 0) {
    put_key(impl, true);
  }
}

WorkingCopySources make_working_copy_sources(const std::vector<at::Tensor>& tensors) {
  ensure_substitution_registered();
  WorkingCopySources sources;
  for (const auto& t : tensors) {
    sources.emplace(t.unsafeGetTensorImpl(),
                    WorkingCopySource{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
                                      t.scalar_type()});
  }
  return sources;
}

void move_substitution_key(const WorkingCopySources& from, const WorkingCopySources& to) {
  put_key_on_all(from, false);
  put_key_on_all(to, true);
}

c10::ScalarType working_copy_dtype_now(const Session& session) {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  if (session.working_copy_sources.empty() || !substitution_thread_on() ||
      !substitution_active(session.rules, &dtype)) {
    return c10::ScalarType::Undefined;
  }
  return dtype;
}

bool is_working_copy_source(const at::Tensor& t) {
  return t.defined() && current_session()->working_copy_sources.count(t.unsafeGetTensorImpl()) != 0;
}

c10::ScalarType dtype_ops_see(const at::Tensor& t) {
  const c10::ScalarType own = t.scalar_type();
  if (!carries_substitution_key(t) || !t.is_floating_point()) return own;
  const std::shared_ptr<const Session> session = current_session();
  if (session->working_copy_sources.count(t.unsafeGetTensorImpl()) == 0) return own;
  const c10::ScalarType working = working_copy_dtype_now(*session);
  return working == c10::ScalarType::Undefined ? own : working;
}

void activate_substitution_thread(bool on) {
  if (on) ensure_substitution_registered();
  set_substitution_key(on);
}

}  // namespace amp::detail
