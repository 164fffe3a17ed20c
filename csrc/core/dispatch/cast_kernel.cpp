// The casting kernel: read the schema once, then per call rewrite the Tensor / Tensor? /
// Tensor[] / Tensor?[] slots of the boxed stack and redispatch below optamp's key.
#include "dispatch/cast_kernel.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <iostream>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "cache/autograd_cast.h"
#include "cache/cast_cache.h"
#include "common/dtypes.h"
#include "dispatch/cast_decision.h"
#include "dispatch/substitution.h"
#include "dispatch/tensor_args.h"
#include "ops/widened_softmax.h"

namespace amp::detail {
namespace {

using c10::ScalarType;

// A Python/C++ number passed where a Tensor is expected (`x + 0.5`): it has no width of its
// own in type promotion, so it is neither cast nor counted when promoting.
bool is_wrapped_number(const at::Tensor& t) { return t.unsafeGetTensorImpl()->is_wrapped_number(); }

// verbosity=2: each distinct (from, to, op) cast is logged once.
void log_cast_once(ScalarType from, ScalarType to, const std::string& op) {
  static std::mutex mutex;
  static std::unordered_set<std::string> seen;
  std::string line = std::string(c10::toString(from)) + "->" + c10::toString(to) + " " + op;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) std::cerr << "optamp: " << line << "\n";
}

// Visits every tensor in the read-only slots; `fn(tensor) -> optional<replacement>`.
template <typename Slots, typename Fn>
void rewrite_tensors(const Slots& slots, torch::jit::Stack& stack, std::size_t base, Fn&& fn) {
  for (const auto& slot : slots) rewrite_tensors_in(stack[base + slot.index], fn);
}

// Ops with a dtype argument whose fp32 result a replacement computes straight from the reduced
// input, where the boxed kernel would otherwise ask the op for dtype=float32 (which, for bf16 on
// CUDA and on the CPU, widens the input into a copy first): the fp32 list's log_softmax (a
// language model's logits, [batch, tokens, vocab]) and softmax (attention scores written out,
// [batch, heads, tokens, keys]) as optamp's own ops (ops/widened_softmax.h; log_softmax's is the
// cross_entropy replacement's). A replacement returns nullopt where it does not apply.

// log_softmax.int(Tensor self, int dim, ScalarType? dtype), softmax.int(the same)
std::optional<at::Tensor> log_softmax_from_reduced(const torch::jit::Stack& stack,
                                                   std::size_t base) {
  return widened_log_softmax(stack[base].toTensor(), stack[base + 1].toInt(),
                             records_autograd_now());
}
std::optional<at::Tensor> softmax_from_reduced(const torch::jit::Stack& stack, std::size_t base) {
  return widened_softmax(stack[base].toTensor(), stack[base + 1].toInt(), records_autograd_now());
}

struct Fp32ReplacementRow {
  const char* name;  // "aten::<name>.<overload>"
  Fp32Replacement replacement;
};
constexpr Fp32ReplacementRow kFp32Replacements[] = {
    {"aten::log_softmax.int", &log_softmax_from_reduced},
    {"aten::softmax.int", &softmax_from_reduced},
};

Fp32Replacement fp32_replacement_of(const std::string& name) {
  for (const auto& row : kFp32Replacements) {
    if (name == row.name) return row.replacement;
  }
  return nullptr;
}

// Native autocast's per-thread dtype and cache switch for one call, restored after it.
class NativeAutocastSettings {
 public:
  NativeAutocastSettings(c10::DeviceType device, ScalarType low)
      : device_(device),
        dtype_(at::autocast::get_autocast_dtype(device)),
        cache_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_dtype(device, low);
    // Native autocast empties its cast cache only when a torch.autocast region ends, and optamp
    // never enters one: a cached cast of a weight would outlive the optimizer step that changes
    // the weight in place.
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NativeAutocastSettings() {
    at::autocast::set_autocast_dtype(device_, dtype_);
    at::autocast::set_autocast_cache_enabled(cache_);
  }
  NativeAutocastSettings(const NativeAutocastSettings&) = delete;
  NativeAutocastSettings& operator=(const NativeAutocastSettings&) = delete;

 private:
  c10::DeviceType device_;
  ScalarType dtype_;
  bool cache_;
};

// A CastPolicy::kOwnAutocast call: the op's own autocast key for `device` (a library's kernel,
// such as torchvision's roi_align), nullopt where it has none there.
std::optional<c10::DispatchKey> own_autocast_key(const c10::OperatorHandle& op,
                                                 c10::DeviceType device) {
  for (const NativeAutocastKey& native : kNativeAutocastKeys) {
    if (native.device == device && op.hasKernelForDispatchKey(native.key)) return native.key;
  }
  return std::nullopt;
}

// Runs the op's kernel on `key` with `low` as native autocast's dtype for the call and its cast
// cache off, as torch.autocast would run it. The caller has excluded optamp's key.
void run_own_autocast(const c10::OperatorHandle& op, c10::DispatchKey key,
                      c10::DispatchKeySet below, torch::jit::Stack* stack, c10::DeviceType device,
                      ScalarType low) {
  NativeAutocastSettings settings(device, low);
  // The kernel casts, excludes its own key and calls the op again; optamp's key is excluded by
  // the caller, so that call goes straight to the backend.
  const auto after = below & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key);
  op.redispatchBoxed(c10::DispatchKeySet(key) | after, stack);
}

// Schemas store a ScalarType argument under its "fake" type (int); the real type says what it is.
bool is_scalar_type_arg(const c10::Argument& arg) {
  c10::TypePtr real = arg.real_type();
  if (auto opt = real->cast<c10::OptionalType>()) real = opt->getElementType();
  return real->kind() == c10::TypeKind::ScalarTypeType;
}

}  // namespace

bool is_castable(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != ScalarType::Double &&
         !is_wrapped_number(t);
}

bool seen_in_another_dtype(const at::Tensor& t, ScalarType dtype) {
  return is_castable(t) && dtype_ops_see(t) != dtype;
}

void CastKernel::set_policy(ListSet set, CastPolicy policy, const char* banned_message) {
  if (banned_message != nullptr) banned_message_.store(banned_message);
  policies_[static_cast<int>(set)].store(static_cast<std::uint8_t>(policy));
}

void CastKernel::set_policy_everywhere(CastPolicy policy) {
  for (auto& p : policies_) p.store(static_cast<std::uint8_t>(policy));
}

std::optional<CastPolicy> CastKernel::policy(ListSet set) const {
  const std::uint8_t stored = policies_[static_cast<int>(set)].load(std::memory_order_relaxed);
  if (stored == kUnlisted) return std::nullopt;
  return static_cast<CastPolicy>(stored);
}

bool CastKernel::listed() const {
  for (const auto& p : policies_) {
    if (p.load(std::memory_order_relaxed) != kUnlisted) return true;
  }
  return false;
}

CastKernel::CastKernel(const c10::FunctionSchema& schema)
    : num_arguments_(schema.arguments().size()), name_(schema.name()) {
  for (auto& p : policies_) p.store(kUnlisted);
  promotes_natively_ = promotes_natively(schema.name().c_str(), schema.overload_name().c_str());
  if (!schema.overload_name().empty()) name_ += "." + schema.overload_name();
  fp32_replacement_ = fp32_replacement_of(name_);
  const auto& args = schema.arguments();
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto& arg = args[i];
    if (arg.name() == "self" && arg.type()->kind() == c10::TypeKind::TensorType) {
      self_index_ = static_cast<int>(i);
      writes_self_ = arg.alias_info() && arg.alias_info()->isWrite();
    }
    if (arg.alias_info() && arg.alias_info()->isWrite()) continue;  // in-place / out=
    const c10::TypePtr& type = arg.type();
    if (arg.name() == "dtype" && is_scalar_type_arg(arg)) {
      dtype_index_ = static_cast<int>(i);  // `ScalarType? dtype` or a required `ScalarType dtype`
    } else if (type->kind() == c10::TypeKind::TensorType) {
      slots_.push_back({i, SlotKind::kTensor});
    } else if (auto opt = type->cast<c10::OptionalType>()) {
      if (opt->getElementType()->kind() == c10::TypeKind::TensorType) {
        slots_.push_back({i, SlotKind::kOptionalTensor});
      }
    } else if (auto list = type->cast<c10::ListType>()) {
      const auto& elem = list->getElementType();
      if (elem->kind() == c10::TypeKind::TensorType) {
        slots_.push_back({i, SlotKind::kTensorList});
      } else if (auto opt_elem = elem->cast<c10::OptionalType>()) {
        if (opt_elem->getElementType()->kind() == c10::TypeKind::TensorType) {
          slots_.push_back({i, SlotKind::kOptionalTensorList});
        }
      }
    }
  }
}

void PromoteWidth::add(const at::Tensor& t) {
  // Doubles are left out, as Apex (it promotes only a mix of fp16 and fp32) and torch.autocast
  // (fp64 is not eligible) leave them: torch's own promotion places them, ranking a 0-dim one
  // below tensors with dimensions. Counted, a 0-dim fp64 factor (torchdiffeq's rtol beside its
  // fp32 state) made `rtol * y` fp64 and the next linear fail on fp64 beside fp16 weights.
  if (t.defined() && t.is_complex()) {
    complex = true;
    complex_wide = complex_wide || (t.dim() > 0 && t.scalar_type() != ScalarType::ComplexHalf);
    return;
  }
  if (is_castable(t)) add_castable(dtype_ops_see(t), t.dim() > 0);
}

void PromoteWidth::add_castable(ScalarType s, bool dimensioned) {
  half = half || s == ScalarType::Half;
  auto widen = [](ScalarType a, ScalarType b) {
    if (a == ScalarType::Undefined || a == b) return b;
    return (is_reduced_float(a) && is_reduced_float(b)) ? ScalarType::Float
                                                        : c10::promoteTypes(a, b);
  };
  mixed = mixed || (widest != ScalarType::Undefined && s != widest);
  widest = widen(widest, s);
  if (dimensioned) widest_dimensioned = widen(widest_dimensioned, s);
}

ScalarType PromoteWidth::torch_width() const {
  return widest_dimensioned == ScalarType::Undefined ? widest : widest_dimensioned;
}

// fp32 (always) and match self in place apply in a backward pass too: their ops could only fail
// held back (no reduced kernel; a source of another width than the tensor it is written into,
// which match self casts to that tensor's dtype: the values land in that dtype either way). Out
// of place, match self would narrow an fp32 source to a reduced self's dtype: under the gate such
// a call is widened instead (plan_mixed_widening). The fp32 lists apply outside a backward pass
// only: a backward's ops run in the dtypes the forward's casts recorded (an fp16 bias gradient's
// `sum` widened would come back fp32 and be converted again), as under native autocast and Apex.
bool CastKernel::applies_under_the_gate(std::optional<CastPolicy> policy) const {
  if (policy == CastPolicy::kFp32Always) return true;
  if (policy == CastPolicy::kMatchSelf) return writes_self_;
  const bool fp32_list = policy == CastPolicy::kFp32 || policy == CastPolicy::kFp32Loss;
  return fp32_list && torch::autograd::get_current_graph_task_id() == -1;
}

CallPlan CastKernel::plan(std::optional<c10::DeviceType> device) const {
  CastDecision decision = device ? decide(*device) : CastDecision{};
  const std::optional<CastPolicy> listed = policy(decision.lists);
  // Ops whose rule only widens reduced input (the fp32 lists, fp32 (always)) or only makes a
  // source match the tensor written (match self) apply it under the no_grad gate too
  // (applies_under_the_gate). The gate keeps what runs in fp32 in fp32 (validation on the
  // masters, EMA updates, optimizer steps), and these rules leave fp32 computations alone; what
  // they cast is an fp16/bf16 tensor made while autograd recorded. SwAV's Sinkhorn takes
  // `exp(scores / 0.05)` of the detached fp16 prototype scores under no_grad, which overflowed
  // to inf (Apex and native autocast cast there; SwAV was trained with Apex's O1); a memory bank
  // takes detached fp16 features into its fp32 rows by `index_copy_` under no_grad. An op
  // without reduced kernels could only fail held back (a custom Function's forward or backward,
  // a metric of an fp16 output).
  if (decision.rules == RuleSet::kNone && decision.gated != RuleSet::kNone &&
      applies_under_the_gate(listed)) {
    decision.rules = decision.gated;
  }
  CallPlan p;
  p.policy = listed.value_or(CastPolicy::kLower);
  if (!listed || !policy_applies(p.policy, decision.rules)) {
    p.native_owns = decision.native_owns;
    // A level casts on this thread, but not this call: the no_grad gate holds its rules back, or
    // they leave this policy out (the fp32 list at O2/O3/O5; promote and the fp32 losses at O3).
    // The call runs as given where it can.
    // Where the model's tensors are reduced (O2/O5's working copies, O3's model) an op some
    // table lists (this kernel's) is widened too where the chosen lists leave it out: those
    // tensors meet fp32 ones whichever lists cast, and torch's lists have no CPU row for
    // layer_norm nor promote rows for dot, mv, ... (a LayerNorm of a sum with an fp32
    // positional encoding failed under op_lists="torch": "mixed dtype (CPU)"). O1/O4 keep the
    // chosen lists' calls.
    const bool level_casts = decision.rules != RuleSet::kNone || decision.gated != RuleSet::kNone;
    const bool reduced_model =
        decision.rules != RuleSet::kFullLists && decision.gated != RuleSet::kFullLists;
    p.widen_if_mixed = (listed || reduced_model) && level_casts && !promotes_natively_;
    return p;
  }
  // NotImplementedError in Python, as Apex raised (a RuntimeError subclass, c10::Error in C++).
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(p.policy == CastPolicy::kBanned && decision.rules == RuleSet::kFullLists),
      banned_message_.load() != nullptr ? banned_message_.load()
                                        : "this op is banned under optamp casting");
  p.cast = true;
  // fp32, fp32 losses, and banned treated as a loss at O2/O5 compute in fp32; an op's own
  // autocast kernel is told the level's low dtype.
  const bool low = p.policy == CastPolicy::kLower || p.policy == CastPolicy::kOwnAutocast;
  p.target = low ? decision.low : ScalarType::Float;
  return p;
}

bool CastKernel::plan_promotion(const PromoteWidth& width, CallPlan& p) const {
  // fp16 meeting a complex value is widened, so the result is complex64 as bf16's is: complex32
  // is an experimental type the CPU cannot exponentiate, sum or take the log of (an LRU's
  // `1j * exp(theta_log)` at O2, where the exp of the working copy is fp16).
  if (width.makes_complex32()) {
    p.target = ScalarType::Float;
    return true;
  }
  // Ops that promote by themselves are left to it where torch picks the same dtype (a cast first
  // would only add an op and an autograd node; see policy_table.h).
  if (!width.mixed || (promotes_natively_ && width.torch_agrees())) return false;
  p.target = width.widest;
  return true;
}

// NOLINTNEXTLINE(readability-convert-member-functions-to-static): one of the kernel's plan steps
bool CastKernel::plan_mixed_widening(const PromoteWidth& width, CallPlan& p) const {
  // A 0-dim tensor of another width than the tensors with dimensions takes theirs, the dtype
  // torch's promotion would give the call (it ranks 0-dim tensors below the others); these ops
  // do not promote by themselves ("prelu: Type promoting not supported": `F.prelu(x, a)` with a
  // 0-dim fp32 slope, fp16 x, under no_grad). Among 0-dim tensors alone, the widest.
  if (!width.mixed) return false;
  p.cast = true;
  p.policy = CastPolicy::kPromote;
  p.target = width.torch_width();
  return true;
}

std::optional<at::Tensor> CastKernel::cast_argument(const at::Tensor& t, const CallPlan& p) const {
  if (!is_castable(t)) return std::nullopt;
  if (t.scalar_type() == p.target) {
    // A model tensor that ops see as its working copy (O2/O5), wanted in its own dtype (a promote
    // call's widening, or an fp32-list op in an amp::autocast region): the master itself, through
    // an alias, which substitution does not replace. Left as it is, substitution below handed
    // the op the reduced copy beside widened activations (a layer norm of an O2 model in a
    // region failed: "mixed dtype (CPU): expect parameter to have scalar type of Float").
    if (dtype_ops_see(t) != p.target) return own_data_past_substitution(t);
    return std::nullopt;
  }
  if (p.policy != CastPolicy::kLower && p.policy != CastPolicy::kPromote &&
      p.policy != CastPolicy::kMatchSelf && !is_reduced_float(t.scalar_type())) {
    return std::nullopt;  // fp32 policy: only reduced inputs are widened
  }
  log_cast(t.scalar_type(), p);
  return cast_through_cache(t, p.target).tensor;
}

void CastKernel::log_cast(ScalarType from, const CallPlan& p) const {
  if (verbosity() >= 2) log_cast_once(from, p.target, name_);
}

// route's view of a boxed call: the read-only tensor slots of the stack.
class CastKernel::StackArguments : public VisitedArguments<StackArguments> {
 public:
  StackArguments(const CastKernel& kernel, torch::jit::Stack& stack, std::size_t base)
      : kernel_(kernel), stack_(stack), base_(base) {}
  std::size_t base() const { return base_; }
  std::optional<ScalarType> self_dtype() const {
    const at::Tensor& self = stack_[base_ + kernel_.self_index_].toTensor();
    if (!self.defined() || !self.is_floating_point()) return std::nullopt;
    return self.scalar_type();
  }
  bool dtype_given() const { return !stack_[base_ + kernel_.dtype_index_].isNone(); }
  bool any_reduced() const {
    bool reduced = false;
    visit([&](const at::Tensor& t) {
      reduced = reduced || (t.defined() && is_reduced_float(t.scalar_type()));
    });
    return reduced;
  }
  template <typename Fn>  // `fn(tensor) -> optional<replacement>` on every read-only tensor
  void rewrite(Fn&& fn) const {
    rewrite_tensors(kernel_.slots_, stack_, base_, fn);
  }
  template <typename Fn>  // `fn(tensor)` on every read-only tensor
  void visit(Fn&& fn) const {
    rewrite([&](const at::Tensor& t) -> std::optional<at::Tensor> {
      fn(t);
      return std::nullopt;
    });
  }

 private:
  const CastKernel& kernel_;
  torch::jit::Stack& stack_;
  std::size_t base_;
};

namespace {

// route's view of a described call (DescribedTensor).
struct DescribedArguments {
  const std::vector<DescribedTensor>& tensors;
  std::optional<ScalarType> self;
  bool given;
  PromoteWidth width() const {
    PromoteWidth width;
    for (const auto& t : tensors) width.add_castable(t.seen, t.dimensioned);
    return width;
  }
  std::optional<ScalarType> self_dtype() const { return self; }
  bool seen_other_than(ScalarType dtype) const {
    return std::any_of(tensors.begin(), tensors.end(),
                       [dtype](const DescribedTensor& t) { return t.seen != dtype; });
  }
  bool dtype_given() const { return given; }
};

}  // namespace

bool described_call_reads_masters(const c10::OperatorHandle& op, const CastKernel& kernel,
                                  c10::DeviceType device,
                                  const std::vector<DescribedTensor>& tensors,
                                  std::optional<ScalarType> self, bool dtype_given) {
  CallPlan p;
  switch (kernel.route(device, DescribedArguments{tensors, self, dtype_given}, p)) {
    case CallRoute::kOwnAutocast:
      return own_autocast_key(op, device).has_value();
    case CallRoute::kCastArguments:
      return p.target == ScalarType::Float;  // cast_argument: a master in its own dtype
    default:
      return false;
  }
}

void CastKernel::operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                            torch::jit::Stack* stack) {
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kCastKey);
  const StackArguments args(*this, *stack, stack->size() - num_arguments_);
  const std::optional<c10::DeviceType> device = args.device();  // native autocast's, or not
  CallPlan p;
  const CallRoute route_taken = route(device, args, p);
  if (route_taken == CallRoute::kAsGiven) {
    std::optional<c10::impl::ExcludeDispatchKeyGuard> stay_out;
    if (p.native_owns) stay_out.emplace(kCastKey);
    op.redispatchBoxed(below, stack);
    return;
  }
  // Casts must not come back into optamp's kernels (nor should composite ops' inner calls).
  c10::impl::ExcludeDispatchKeyGuard no_recursion(kCastKey);
  switch (route_taken) {
    case CallRoute::kOwnAutocast:
      run_own_autocast_call(op, below, stack, args, *device, p.target);
      return;
    case CallRoute::kDtypeArgument:
      run_with_fp32_dtype(op, below, stack, args);
      return;
    default:
      args.rewrite([&](const at::Tensor& t) { return cast_argument(t, p); });
      op.redispatchBoxed(below, stack);
  }
}

void CastKernel::run_own_autocast_call(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                                       torch::jit::Stack* stack, const StackArguments& args,
                                       c10::DeviceType device, ScalarType low) {
  const std::optional<c10::DispatchKey> key = own_autocast_key(op, device);
  if (!key) {
    op.redispatchBoxed(below, stack);  // none for this device: as native autocast runs it
    return;
  }
  // Model tensors at O2/O5 go in as their masters (an alias past substitution), to be cast by
  // the kernel like the other inputs: its inner call would otherwise meet substitution, which
  // hands the op a working copy beside the inputs the kernel widened.
  args.rewrite([](const at::Tensor& t) -> std::optional<at::Tensor> {
    if (!t.defined() || dtype_ops_see(t) == t.scalar_type()) return std::nullopt;
    return own_data_past_substitution(t);
  });
  run_own_autocast(op, *key, below, stack, device, low);
}

void CastKernel::run_with_fp32_dtype(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                                     torch::jit::Stack* stack, const StackArguments& args) const {
  // Ops with a dtype argument compute in fp32 without a separate input cast.
  const std::size_t base = args.base();
  const bool any_reduced = args.any_reduced();
  if (any_reduced && fp32_replacement_ != nullptr) {
    if (auto result = fp32_replacement_(*stack, base)) {  // no cast: none to log or count
      torch::jit::drop(*stack, num_arguments_);
      torch::jit::push(*stack, *std::move(result));
      return;
    }
  }
  if (any_reduced) (*stack)[base + dtype_index_] = c10::IValue(ScalarType::Float);
  op.redispatchBoxed(below, stack);
}

}  // namespace amp::detail
