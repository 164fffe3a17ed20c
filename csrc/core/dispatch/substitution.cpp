// The substitution key: which tensors carry it, the per-thread switch, the boxed fallback, and
// the fallthroughs. Ops whose job is to hand back a tensor's own data (detach, alias, clone,
// to/_to_copy, copy_, set_, item, equal, autograd metadata) get fallthrough kernels on the key,
// so `p.detach().clone()` stays fp32 and those ops pay nothing. View ops substitute parameters,
// so `x @ w.t()` reuses the cached copy instead of casting a fresh view each call, and hand
// buffers their own data, so that writes through the view reach them (returns_a_view).
#include "dispatch/substitution.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cache/cast_cache.h"
#include "common/dtypes.h"
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
    if (auto impl = entry.second.ref->lock()) put_key(impl.get(), on);
  }
}

constexpr const char* kOwnDataOps[] = {
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::clone",
    "aten::_to_copy",
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
    "aten::resolve_conj",  // Tensor.tolist() reads through these: it printed fp16-rounded values
    "aten::resolve_neg",
};

// Comparisons of a tensor's own values (`torch.allclose(w, saved)`, `assert_close`) that torch
// composes of other ops: a fallthrough would still substitute those inner calls, so these run
// with substitution off throughout. With the working copy they compared fp16-rounded values, and
// allclose of the fp16 copy and an fp32 tensor raised "Half did not match Float".
constexpr const char* kOwnValuesOps[] = {
    "aten::allclose",
    "aten::isclose",
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

// A normalization with running statistics (batch norm, instance norm) given an input wider than
// the working copies reads the fp32 masters. Its kernels take reduced input with fp32 weights
// (keep_batchnorm_fp32's case, the default) but not fp32 input with reduced weights ("mixed
// dtype (CPU): expect parameter to have scalar type of Float"), and an fp32 input is what the
// forward made or was given: an activation promoted by an fp32 tensor made in the forward, or a
// model input under cast_model_inputs=False, reaching a batch norm kept in the working dtype
// (keep_batchnorm_fp32=False) or a norm module of the user's that calls F.batch_norm with
// parameters of its own. Those calls failed where fp32 training runs; now they run in fp32, as
// the fp32 list's mixed calls do (layer_norm, group_norm), and update the buffers in place.
// `has_statistics`: the op has running-statistic arguments (is_running_statistic), looked up once
// per call by the fallback.
bool normalizes_a_wider_input(bool has_statistics, const torch::jit::Stack& stack, std::size_t base,
                              c10::ScalarType working) {
  if (!has_statistics) return false;
  const c10::IValue& input = stack[base];
  if (!input.isTensor()) return false;
  const at::Tensor& t = input.toTensor();
  return t.defined() && t.is_floating_point() && !carries_substitution_key(t) &&
         c10::elementSize(t.scalar_type()) > c10::elementSize(working);
}

// A view op (slice, select, narrow, split, as_strided, ...: a return aliasing an argument) hands
// registered buffers their own data, so that a write through the view (`buffer[0] = x`,
// `buffer[1:].copy_(y)`, `buffer[2].add_(1)`) reaches the buffer; it used to reach a view of the
// cached working copy and was lost with it. Reads of such a view still see the working dtype
// (SubstitutionCall::working_copy). Parameters' views stay views of the cached copy (`w.t()`
// in a matmul reuses it); writing through a parameter's view in a forward is autograd's error.
bool returns_a_view(const c10::FunctionSchema& schema) {
  const auto& returns = schema.returns();
  return std::any_of(returns.begin(), returns.end(), [](const c10::Argument& r) {
    return r.alias_info() != nullptr && !r.alias_info()->isWrite();
  });
}

// A complex tensor or scalar among a call's arguments (is_complex_argument).
bool has_complex_argument(const torch::jit::Stack& stack, std::size_t base) {
  return std::any_of(stack.begin() + static_cast<std::ptrdiff_t>(base), stack.end(),
                     [](const c10::IValue& value) {
                       if (value.isComplexDouble()) return true;
                       bool complex = false;
                       visit_tensors_in(value, [&complex](const at::Tensor& t) {
                         complex = complex || is_complex_argument(t);
                       });
                       return complex;
                     });
}

// Ops without an unboxed kernel (substitution_kernels.cpp): every tensor argument that is not
// written is looked at.
void substitute_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  SubstitutionCall call;
  std::vector<std::pair<at::Tensor, at::Tensor>> updated_statistics;  // (fp32 buffer, its copy)
  const auto& args = op.schema().arguments();
  const std::size_t base = stack->size() - args.size();
  const bool has_statistics =
      call.active() && std::any_of(args.begin(), args.end(), is_running_statistic);
  if (call.active() && !has_complex_argument(*stack, base) &&
      !normalizes_a_wider_input(has_statistics, *stack, base, call.dtype())) {
    const bool updating = has_statistics && updates_running_statistics(args, *stack, base);
    const bool view = returns_a_view(op.schema());
    auto working_copy = [&call, view](const at::Tensor& t) {
      return view ? call.view_working_copy(t) : call.working_copy(t);
    };
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

template <std::size_t N>
bool listed(const char* const (&ops)[N], const std::string& op) {
  return std::any_of(std::begin(ops), std::end(ops),
                     [&op](const char* name) { return op == name; });
}

void without_substitution(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard masters(kSubstituteKey);
  op.redispatchBoxed(below_substitution(keys), stack);
}

// Whether a conversion names only a dtype (`t.float()`, `t.to(torch.float)`: to.dtype; C++'s
// `t.to(other)`: to.other; `type_as`), which asks for values in that dtype, rather than a place
// (`t.to(device)` arrives as to.dtype_layout; `t.to(device, dtype)` and Python's `t.to(x)` as
// to.device).
bool names_only_a_dtype(const c10::OperatorHandle& op) {
  const auto& overload = op.schema().overload_name();
  return op.schema().name() == "aten::type_as" || overload == "dtype" || overload == "other";
}

// `to` and `type_as` are own-data ops, but where no conversion is needed they hand back the
// tensor itself, and the next op then read a registered tensor as its working copy: Hugging
// Face's rotary embeddings take `inv_freq.to(dtype=torch.float)` for fp32 angles and got them
// from the fp16 copy (0.1 rad off at position 4000 at O2, 0.4 at O5); Mamba's
// `-torch.exp(self.A_log.float())` and Gemma's `1 + self.weight.float()` even computed in fp16.
// torch.compile's trace makes a new tensor of the result, so compiled models read the values.
// Such a call now returns a copy of the tensor's own values (its gradient reaches the master),
// eager as compiled: for a buffer in every form; for a parameter where the call names only a
// dtype, since code reassigns `p.to(device)` to the module, which takes a Parameter only.
void own_data_conversion(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  const at::Tensor self = (*stack)[stack->size() - op.schema().arguments().size()].toTensor();
  op.redispatchBoxed(below_substitution(keys), stack);
  if (stack->back().isTensor() && stack->back().toTensor().is_same(self) &&
      dtype_ops_see(self) != self.scalar_type() &&
      (names_only_a_dtype(op) || is_registered_buffer(self))) {
    stack->back() = self.clone();  // own data: a fallthrough on the key
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
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (listed(kOwnDataOps, name.name) || listed(kOptimizerStepOps, name.name)) {
        kernels->impl(qualified(name).c_str(), torch::CppFunction::makeFallthrough());
      } else if (listed(kOwnValuesOps, name.name)) {
        kernels->impl(qualified(name).c_str(),
                      torch::CppFunction::makeFromBoxedFunction<&without_substitution>());
      } else if (name.name == "aten::to" || name.name == "aten::type_as") {
        kernels->impl(qualified(name).c_str(),
                      torch::CppFunction::makeFromBoxedFunction<&own_data_conversion>());
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

// By storage: autograd keeps a view's root, which is not the buffer where the buffer is itself a
// view (`torch.zeros(n, d).unsqueeze(0)`, the classic positional encoding). Only tensors that
// carry the key and are not sources get here (views and aliases of sources), so the scan over
// the sources is rare.
const WorkingCopySource* viewed_buffer(const WorkingCopySources& sources, const at::Tensor& t) {
  if (!t.is_view() || !t.has_storage()) return nullptr;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  for (const auto& entry : sources) {
    if (!entry.second.buffer) continue;
    const auto buffer = entry.second.ref->lock();
    if (buffer && buffer->has_storage() && buffer->storage().unsafeGetStorageImpl() == storage) {
      return &entry.second;
    }
  }
  return nullptr;
}

bool SubstitutionCall::may_stand_for_a_source(const at::Tensor& t) const {
  return carries_substitution_key(t) && t.scalar_type() != dtype_ && t.is_floating_point();
}

const WorkingCopySource* SubstitutionCall::source_of(const at::Tensor& t) const {
  return may_stand_for_a_source(t) ? registered_source(t) : nullptr;
}

const WorkingCopySource* SubstitutionCall::registered_source(const at::Tensor& t) const {
  const auto& sources = session_->working_copy_sources;
  const auto source = sources.find(t.unsafeGetTensorImpl());
  if (source == sources.end()) return nullptr;  // a view or detached alias of a source
  // The model was cast after initialize (model->to(torch::kDouble)): its masters are no longer
  // what the working copies stand for, and torch would fail further down with a mixed-dtype
  // error that does not say why.
  TORCH_CHECK_VALUE(t.scalar_type() == source->second.dtype,
                    "a model tensor registered by amp::initialize (O2/O5) must still be ",
                    dtype_name(source->second.dtype), ", got ", dtype_name(t.scalar_type()),
                    " of shape ", t.sizes(), kCastAfterInitialize);
  return &source->second;
}

std::optional<at::Tensor> SubstitutionCall::working_copy(const at::Tensor& t) const {
  if (!may_stand_for_a_source(t)) return std::nullopt;  // activations leave here
  if (registered_source(t) != nullptr) {
    c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
    return cast_through_cache(t, dtype_, /*always_cache=*/true).tensor;
  }
  // A view of a registered buffer (view ops hand a buffer its own data, below) is read as a
  // cast of itself, made for this call: the op sees the working dtype, and writes through the
  // view went to the buffer.
  if (viewed_buffer(session_->working_copy_sources, t) != nullptr) {
    c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
    return t.to(dtype_);
  }
  return std::nullopt;
}

std::optional<at::Tensor> SubstitutionCall::view_working_copy(const at::Tensor& t) const {
  const WorkingCopySource* source = source_of(t);
  if (source == nullptr || source->buffer) return std::nullopt;
  c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
  return cast_through_cache(t, dtype_, /*always_cache=*/true).tensor;
}

std::optional<at::Tensor> SubstitutionCall::private_copy(const at::Tensor& t) const {
  if (source_of(t) == nullptr) return std::nullopt;
  c10::impl::ExcludeDispatchKeyGuard no_casting(kCastKey);
  return t.to(dtype_);
}

bool carries_substitution_key(const at::Tensor& t) {
  return t.defined() &&
         (__atomic_load_n(KeySetAccess::raw(t.unsafeGetTensorImpl()), __ATOMIC_RELAXED) &
          kKeyBit) != 0;
}

void put_substitution_key(c10::TensorImpl* impl, bool on) { put_key(impl, on); }

void remark_if_source(c10::TensorImpl* impl) {
  if (impl != nullptr && current_session()->working_copy_sources.count(impl) != 0) {
    put_key(impl, true);
  }
}

// fp32, fp16 and bf16 tensors get working copies. A float64 buffer is a precision someone chose
// (a frequency table, a noise schedule), which native autocast never touches; its fp16/bf16 copy
// rounded `t * freqs` silently while the result stayed float64. A float8 buffer is an operand of
// its own kernels (`_scaled_mm` takes float8 only). A trainable float64 parameter (taken by
// initialize's check_model_dtypes) is its own master alike: ops read it as it is.
namespace {
bool has_working_copy_dtype(const at::Tensor& t) {
  const c10::ScalarType dtype = t.scalar_type();
  return dtype == c10::ScalarType::Float || is_reduced_float(dtype);
}
}  // namespace

WorkingCopySources make_working_copy_sources(const std::vector<at::Tensor>& tensors,
                                             const std::vector<at::Tensor>& parameters) {
  ensure_substitution_registered();
  std::unordered_set<const c10::TensorImpl*> parameter_impls;
  for (const auto& p : parameters) parameter_impls.insert(p.unsafeGetTensorImpl());
  WorkingCopySources sources;
  for (const auto& t : tensors) {
    if (!has_working_copy_dtype(t)) continue;
    sources.emplace(t.unsafeGetTensorImpl(),
                    WorkingCopySource{std::make_shared<TensorRef>(t), t.scalar_type(),
                                      parameter_impls.count(t.unsafeGetTensorImpl()) == 0});
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

namespace {
// functorch's grad transforms (torch.func.jvp, grad, vjp, jacrev) hand each op a TensorWrapper
// around every tensor the transformed function captures, a model's parameters among them. The
// wrapper carries a few of its value's keys, not the substitution key, while below the
// transform's layer the parameter itself meets substitution: the call gets its working copy.
// Weighed as fp32 wrappers, an O2 model's parameters made a layer norm widen its fp16 input and
// then get fp16 working copies beside it ("mixed dtype (CPU): expect parameter to have scalar
// type of Float" under torch.func.jvp).
//
// The wrapped tensor is TensorWrapper's first member (ATen/functorch/TensorWrapper.h, a header
// that cannot be included here: it needs nlohmann/json, which torch does not ship). Its pointer
// is read and only compared with the registered sources' keys, never followed: a layout a later
// torch changed would make the lookup miss, which is how wrappers were weighed before.
struct WrapperLayout : c10::TensorImpl {  // TensorWrapper's base and first member
  WrapperLayout() : c10::TensorImpl(c10::DispatchKeySet(), caffe2::TypeMeta(), std::nullopt) {}
  at::Tensor value;
};

std::ptrdiff_t wrapped_value_offset() {
  static const std::ptrdiff_t offset = [] {
    const WrapperLayout layout;
    return reinterpret_cast<const char*>(&layout.value) -
           reinterpret_cast<const char*>(static_cast<const c10::TensorImpl*>(&layout));
  }();
  return offset;
}

// The tensor a functorch TensorWrapper stands for, as a key for the sources (nullptr: not one).
const c10::TensorImpl* functorch_wrapped(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(c10::DispatchKey::FuncTorchGradWrapper)) return nullptr;
  const char* wrapper = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
  const c10::TensorImpl* target = nullptr;  // the intrusive_ptr's one member
  // NOLINTNEXTLINE(bugprone-sizeof-expression): the pointer itself is what is read
  std::memcpy(&target, wrapper + wrapped_value_offset(), sizeof(target));
  return target;
}

// The registered source `t` is, or the functorch wrapper `t` wraps (nullptr: neither). Views of
// registered buffers are the caller's to find (viewed_buffer): a wrapper has no storage to compare.
const WorkingCopySource* registered_source_of(const WorkingCopySources& sources,
                                              const at::Tensor& t, const c10::TensorImpl* wrapped) {
  const auto it = sources.find(wrapped != nullptr ? wrapped : t.unsafeGetTensorImpl());
  return it != sources.end() ? &it->second : nullptr;
}
}  // namespace

c10::ScalarType dtype_ops_see(const at::Tensor& t) {
  const c10::ScalarType own = t.scalar_type();
  if (!t.is_floating_point()) return own;
  const c10::TensorImpl* wrapped = functorch_wrapped(t);
  if (wrapped == nullptr && !carries_substitution_key(t)) return own;
  const std::shared_ptr<const Session> session = current_session();
  const auto& sources = session->working_copy_sources;
  if (registered_source_of(sources, t, wrapped) == nullptr &&
      (wrapped != nullptr || viewed_buffer(sources, t) == nullptr)) {
    return own;
  }
  const c10::ScalarType working = working_copy_dtype_now(*session);
  return working == c10::ScalarType::Undefined ? own : working;
}

bool is_registered_buffer(const at::Tensor& t) {
  const std::shared_ptr<const Session> session = current_session();
  const auto& sources = session->working_copy_sources;
  const c10::TensorImpl* wrapped = functorch_wrapped(t);
  if (const WorkingCopySource* source = registered_source_of(sources, t, wrapped)) {
    return source->buffer;
  }
  return wrapped == nullptr && viewed_buffer(sources, t) != nullptr;
}

at::Tensor own_data_past_substitution(const at::Tensor& t) {
  return is_registered_buffer(t) ? t.clone() : t.alias();  // clone: own data, a fallthrough
}

void activate_substitution_thread(bool on) {
  if (on) ensure_substitution_registered();
  set_substitution_key(on);
}

}  // namespace amp::detail
