#pragma once
// The boxed, schema-driven casting kernel registered per listed operator.
#include <ATen/core/boxing/OperatorKernel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <atomic>
#include <optional>
#include <vector>

#include "dispatch/policy_table.h"

namespace amp::detail {

// Whether the casting kernels cast or weigh `t`: floating, not float64 (Apex never touches
// doubles), not a wrapped number (a Python/C++ number passed where a Tensor is expected, `x + 0.5`,
// has no width of its own in type promotion).
bool is_castable(const at::Tensor& t);

// The widest floating width among a promote call's inputs (fp16 mixed with bf16 widens to fp32),
// and the width torch's own promotion would pick: it ranks 0-dim tensors below the others, so it
// picks the widest among the tensors with dimensions (the widest of all when there are none).
struct PromoteWidth {
  c10::ScalarType widest = c10::ScalarType::Undefined;
  c10::ScalarType widest_dimensioned = c10::ScalarType::Undefined;
  bool mixed = false;
  // Complex arguments: torch makes complex32 of an fp16 tensor and a complex scalar (or a 0-dim
  // or complex32 tensor), where it makes complex64 of bf16 (there is no complex bf16).
  bool half = false;          // an fp16 tensor (as ops see it) among the arguments
  bool complex = false;       // a complex tensor or wrapped complex scalar
  bool complex_wide = false;  // a complex64/complex128 tensor with dimensions
  void add(const at::Tensor& t);
  // A castable tensor's width: `seen`, the dtype ops see it in; `dimensioned`: dim() > 0.
  void add_castable(c10::ScalarType seen, bool dimensioned);
  c10::ScalarType torch_width() const;
  bool torch_agrees() const { return torch_width() == widest; }
  bool makes_complex32() const { return half && complex && !complex_wide; }
};

// What one call does, decided before any argument is touched (CastKernel::plan).
struct CallPlan {
  bool cast = false;         // false: redispatch as is
  bool native_owns = false;  // (when not casting) native autocast owns the call: stay out below
  CastPolicy policy = CastPolicy::kLower;
  c10::ScalarType target = c10::ScalarType::Undefined;  // lower: the level's; fp32: Float
  // (when not casting) a listed op that cannot run mixed widths, whose policy the no_grad gate
  // holds back or the level's rules leave out: plan_mixed_widening looks at its inputs.
  bool widen_if_mixed = false;
};

// What a planned call does with its arguments (CastKernel::route).
enum class CallRoute : std::uint8_t {
  kAsGiven,        // redispatched as they came (plan.native_owns: native autocast owns the call)
  kOwnAutocast,    // through the op's own autocast kernel, told the level's low dtype
  kDtypeArgument,  // an fp32-list op with a dtype argument left None: asked for an fp32 result
  kCastArguments,  // its read-only floating tensors cast to plan.target (cast_argument)
};

// A read-only floating argument (not fp64, not a wrapped number) of a call described without a
// stack: torch.compile's working-copy mode describes the calls it traces so (core.h,
// call_reads_masters).
struct DescribedTensor {
  c10::ScalarType seen;  // the dtype ops see it in (an O2/O5 model tensor: its working copy's)
  bool dimensioned;      // dim() > 0
};

// Whether `t` is castable and ops see it in another dtype than `dtype` (an O2/O5 model tensor:
// its working copy's).
bool seen_in_another_dtype(const at::Tensor& t, c10::ScalarType dtype);

// What CastKernel::route reads of a call's read-only tensors, from `Derived::visit(fn)` (`fn`
// on each of them): the boxed kernel's view of its stack and the unboxed kernels' view of their
// arguments share it. Derived adds self_dtype() and dtype_given().
template <typename Derived>
class VisitedArguments {
 public:
  PromoteWidth width() const {
    PromoteWidth width;
    derived().visit([&width](const at::Tensor& t) { width.add(t); });
    return width;
  }
  bool seen_other_than(c10::ScalarType dtype) const {
    bool other = false;
    derived().visit([&](const at::Tensor& t) { other = other || seen_in_another_dtype(t, dtype); });
    return other;
  }
  // The first defined tensor's device: it decides whether native autocast owns the call.
  std::optional<c10::DeviceType> device() const {
    std::optional<c10::DeviceType> device;
    derived().visit([&device](const at::Tensor& t) {
      if (!device && t.defined()) device = t.device().type();
    });
    return device;
  }

 private:
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
};

// For an op with a dtype argument: computes its fp32 result from the reduced inputs at
// stack[base...] without a widened copy, or nullopt where it does not apply (cast_kernel.cpp's
// kFp32Replacements).
using Fp32Replacement = std::optional<at::Tensor> (*)(const torch::jit::Stack&, std::size_t base);

// The native autocast key of each device other libraries register autocast kernels on
// (CastPolicy::kOwnAutocast); not PrivateUse1's, which is optamp's own.
struct NativeAutocastKey {
  c10::DeviceType device;
  c10::DispatchKey key;
};
inline constexpr NativeAutocastKey kNativeAutocastKeys[] = {
    {c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU},
    {c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA},
    {c10::DeviceType::XPU, c10::DispatchKey::AutocastXPU},
    {c10::DeviceType::MPS, c10::DispatchKey::AutocastMPS},
};

class CastKernel final : public c10::OperatorKernel {
 public:
  // Listed in no table until set_policy.
  explicit CastKernel(const c10::FunctionSchema& schema);
  // The op's row in one table; `banned_message`: the error of a kBanned policy (static storage).
  void set_policy(ListSet set, CastPolicy policy, const char* banned_message = nullptr);
  // A user registration (register_half_op, ...): the same policy whichever lists are in use.
  void set_policy_everywhere(CastPolicy policy);
  // nullopt: the op is not in that table (the kernel only redispatches).
  std::optional<CastPolicy> policy(ListSet set) const;
  // Whether any table or registration gave the op a policy.
  bool listed() const;

  // The boxed kernel (any schema).
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

  // The steps both the boxed kernel and the unboxed ones (unboxed_kernels.cpp) take:
  // the gate, the table and the banned check for a call whose first tensor is on `device`
  // (throws for a banned op);
  CallPlan plan(std::optional<c10::DeviceType> device) const;
  // then the arguments' part, into `plan`: what the call does with them. `args` is read only where
  // the plan needs it, through width() (a PromoteWidth over the read-only tensors), self_dtype()
  // (self's dtype where self is a floating tensor, else nullopt), seen_other_than(dtype) (a
  // castable read-only tensor ops see in another dtype) and dtype_given() (the op's dtype
  // argument is not None). The boxed kernel, the unboxed ones and described calls route alike.
  template <typename Args>
  CallRoute route(std::optional<c10::DeviceType> device, const Args& args, CallPlan& plan) const;
  // a promote call whose width is known: whether to cast, to what (plan.target);
  bool plan_promotion(const PromoteWidth& width, CallPlan& plan) const;
  // a call left uncast (plan.widen_if_mixed) whose width is known: whether to widen its inputs
  // after all (they mix widths among its tensors with dimensions), to what. Why: such calls run
  // in the dtypes they are given, but a listed op that torch does not promote by itself (mm,
  // conv, dot, layer_norm, group_norm, ...) given a reduced tensor and an fp32 one cannot run at
  // all. Under the gate: an activation made while autograd recorded meeting a master weight or a
  // buffer (torch.autocast and Apex cast such a call to fp16, the gate keeps fp32). At O2/O3/O5,
  // whose rules leave the fp32 list out: an fp32 activation (a tensor made in the forward and
  // added to a reduced one) meeting a layer norm's reduced weights, which torch.autocast's fp32
  // list and Apex's O1 run in fp32 (docs/casting.md).
  bool plan_mixed_widening(const PromoteWidth& width, CallPlan& plan) const;
  // whether the policy's rule applies under the no_grad gate (it casts nothing fp32 can keep).
  bool applies_under_the_gate(std::optional<CastPolicy> policy) const;
  // one argument under a casting plan: the cast tensor, or nullopt to keep it.
  std::optional<at::Tensor> cast_argument(const at::Tensor& t, const CallPlan& plan) const;
  // the verbosity-2 log line of a cast from `from` to the plan's target (made by cast_argument,
  // or by a fused replacement instead).
  void log_cast(c10::ScalarType from, const CallPlan& plan) const;
  bool has_dtype_argument() const { return dtype_index_ >= 0; }

 private:
  class StackArguments;  // route's view of a boxed stack (cast_kernel.cpp)
  // The boxed kernel's CallRoute::kOwnAutocast and kDtypeArgument calls.
  static void run_own_autocast_call(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                                    torch::jit::Stack* stack, const StackArguments& args,
                                    c10::DeviceType device, c10::ScalarType low);
  void run_with_fp32_dtype(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                           torch::jit::Stack* stack, const StackArguments& args) const;
  enum class SlotKind : std::uint8_t { kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };
  struct Slot {
    std::size_t index;
    SlotKind kind;
  };

  static constexpr std::uint8_t kUnlisted = 0xFF;
  std::array<std::atomic<std::uint8_t>, kNumListSets> policies_;  // a CastPolicy or kUnlisted
  std::atomic<const char*> banned_message_{nullptr};
  std::vector<Slot> slots_;  // read-only tensor arguments (written ones are never cast)
  std::size_t num_arguments_;
  int dtype_index_ = -1;                        // the op's `ScalarType? dtype` argument, if any
  int self_index_ = -1;                         // its `self` tensor argument (kMatchSelf's target)
  bool writes_self_ = false;                    // in place: `self` is written
  Fp32Replacement fp32_replacement_ = nullptr;  // the op's row in kFp32Replacements, if any
  bool promotes_natively_ = false;              // see promotes_natively() (policy_table.h)
  std::string name_;
};

// Whether eager hands the O2/O5 model tensors in a call of `op` (whose kernel is `kernel`) with
// the described arguments their fp32 masters: where the kernel casts the call to fp32 (an fp32
// rule that applies, a promotion or mixed widening to fp32), or runs the op's own autocast
// kernel. Elsewhere substitution hands them their working copies. torch.compile's working-copy
// mode asks (core::call_reads_masters).
bool described_call_reads_masters(const c10::OperatorHandle& op, const CastKernel& kernel,
                                  c10::DeviceType device,
                                  const std::vector<DescribedTensor>& tensors,
                                  std::optional<c10::ScalarType> self, bool dtype_given);

template <typename Args>
CallRoute CastKernel::route(std::optional<c10::DeviceType> device, const Args& args,
                            CallPlan& p) const {
  p = plan(device);
  if (p.widen_if_mixed) plan_mixed_widening(args.width(), p);
  if (!p.cast) return CallRoute::kAsGiven;
  if (p.policy == CastPolicy::kOwnAutocast) return CallRoute::kOwnAutocast;
  if (p.widen_if_mixed) return CallRoute::kCastArguments;  // its width is planned
  if (p.policy == CastPolicy::kPromote) {
    return plan_promotion(args.width(), p) ? CallRoute::kCastArguments : CallRoute::kAsGiven;
  }
  if (p.policy == CastPolicy::kMatchSelf) {
    // The other floating inputs take self's dtype, where some has another.
    const std::optional<c10::ScalarType> self =
        self_index_ >= 0 ? args.self_dtype() : std::optional<c10::ScalarType>();
    if (!self || !args.seen_other_than(*self)) return CallRoute::kAsGiven;
    p.target = *self;
    return CallRoute::kCastArguments;
  }
  if (p.policy != CastPolicy::kLower && p.policy != CastPolicy::kFp32Always && dtype_index_ >= 0) {
    // (fp32 (always) ops cast their inputs: the reduced ones are what they have no kernels for,
    // and some check the input's dtype before the dtype argument's, linalg_matrix_norm's "Low
    // precision dtypes not supported".) The caller chose the result dtype: that is the precision
    // asked for, and widening the inputs would make ops that refuse to narrow
    // (linalg_vector_norm, norm) fail. Native autocast's fp32_set_opt_dtype leaves such calls
    // alone too.
    return args.dtype_given() ? CallRoute::kAsGiven : CallRoute::kDtypeArgument;
  }
  return CallRoute::kCastArguments;
}

}  // namespace amp::detail
