// Unboxed casting kernels for hot operators (unboxed_kernels.h): one template over at::_ops's
// signature, instantiated per operator.
#include "dispatch/unboxed_kernels.h"

#include <ATen/Operators.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cache/autograd_cast.h"
#include "cache/cast_cache.h"
#include "cache/companion_casts.h"
#include "common/dtypes.h"
#include "dispatch/carried_state.h"
#include "dispatch/tensor_args.h"
#include "ops/fused_cross_entropy.h"
#include "ops/widened_gelu.h"
#include "ops/widened_softmax.h"

namespace amp::detail {
namespace {

// An operator whose listed cast has a fused replacement: Fused<Op>::call returns its result, or
// std::nullopt where the replacement does not apply and the ordinary cast follows.
template <typename Op>
struct Fused {
  template <typename... Args>
  static std::optional<at::Tensor> call(const CastKernel&, const CallPlan&, const Args&...) {
    return std::nullopt;
  }
};

// Apex's fp32 GELU of an fp16/bf16 input: one op computes it from the reduced input and also
// makes the copy the next lower op would cast (ops/widened_gelu.h).
template <>
struct Fused<at::_ops::gelu> {
  static std::optional<at::Tensor> call(const CastKernel& k, const CallPlan& p,
                                        const at::Tensor& self, c10::string_view approximate) {
    if (p.target != c10::ScalarType::Float) return std::nullopt;
    auto result = widened_gelu(self, approximate, records_autograd_now());
    if (result) k.log_cast(self.scalar_type(), p);
    return result;
  }
};

// Apex's fp32 cross_entropy of fp16/bf16 logits without a widened copy of the logits: the loss
// is log_softmax + nll_loss (torch's own decomposition for class-index targets), and log_softmax
// reads the reduced logits and writes fp32, its backward writes the reduced gradient: the cast
// path's fp32 copy of the logits (the largest activation of a language model) and the narrowing of
// its gradient are not made. optamp::widened_log_softmax (ops/widened_softmax.h says where it
// applies) does that for CUDA's bf16, which torch's kernel refuses, and runs the cast path's ops
// on the CPU; elsewhere log_softmax is asked for an fp32 result (on CUDA torch reads fp16 so;
// otherwise it widens inside log_softmax).
// On CUDA, [rows, classes] logits with int64 targets and no class weights take
// optamp::fused_cross_entropy instead (ops/fused_cross_entropy.h): no fp32 log-probabilities at
// all. Probability targets and label smoothing take the cast path.
// fp32 logits that a model boundary widened from reduced ones (O2/O5: Apex casts a model's
// outputs to fp32) are read reduced too, from the companion the boundary offered (its values
// exactly; core::cast_model_output): the loss then takes the same path as at O1, with no cast
// to count, and its gradient reaches the model's reduced output directly.
template <>
struct Fused<at::_ops::cross_entropy_loss> {
  static std::optional<at::Tensor> call(const CastKernel& k, const CallPlan& p,
                                        const at::Tensor& logits, const at::Tensor& target,
                                        const std::optional<at::Tensor>& weight, int64_t reduction,
                                        const c10::SymInt& ignore_index, double label_smoothing) {
    if (p.target != c10::ScalarType::Float || logits.dim() == 0 || target.is_floating_point() ||
        label_smoothing != 0.0 || logits.sym_sizes() == target.sym_sizes()) {
      return std::nullopt;
    }
    const bool reduced = is_reduced_float(logits.scalar_type());
    std::optional<at::Tensor> companion;
    if (!reduced) {
      if (logits.scalar_type() != c10::ScalarType::Float) return std::nullopt;
      companion = find_reduced_companion(logits);
      if (!companion) return std::nullopt;
    }
    const at::Tensor& self = reduced ? logits : *companion;
    std::optional<at::Tensor> cast_weight = weight;
    if (weight) {
      if (auto cast = k.cast_argument(*weight, p)) cast_weight = std::move(cast);
    }
    if (reduced) {
      k.log_cast(self.scalar_type(), p);
      count_cast();  // the widening of the logits, as the cast it replaces counted
    }
    const auto ignore = ignore_index.maybe_as_int();
    if (self.is_cuda() && (!weight || !weight->defined()) && ignore) {
      if (auto loss =
              fused_cross_entropy(self, target, reduction, *ignore, records_autograd_now())) {
        return loss;
      }
    }
    const int64_t class_dim = self.dim() == 1 ? 0 : 1;
    std::optional<at::Tensor> log_probs =
        widened_log_softmax(self, class_dim, records_autograd_now());
    if (!log_probs) {
      log_probs = at::_ops::log_softmax_int::call(self, class_dim, c10::ScalarType::Float);
    }
    return at::_ops::nll_loss_nd::call(*log_probs, target, cast_weight, reduction, ignore_index);
  }
};

template <typename Op, typename Signature = typename Op::schema>
struct Unboxed;

// CastKernel::route's view of an unboxed call's arguments. The hot ops have no dtype argument
// (register_unboxed checks) and their self, where they have one, comes first.
template <typename... Args>
struct UnboxedArguments : VisitedArguments<UnboxedArguments<Args...>> {
  explicit UnboxedArguments(const Args&... a) : args(a...) {}
  std::tuple<const Args&...> args;
  template <typename Fn>
  void visit(Fn&& fn) const {
    std::apply([&](const auto&... arg) { (visit_tensor_arg(arg, fn), ...); }, args);
  }
  std::optional<c10::ScalarType> self_dtype() const {
    std::optional<c10::ScalarType> self;
    bool first = true;
    visit([&](const at::Tensor& t) {
      if (first && t.defined() && t.is_floating_point()) self = t.scalar_type();
      first = false;
    });
    return self;
  }
  bool dtype_given() const { return false; }
};

template <typename Op, typename Ret, typename... Args>
struct Unboxed<Op, Ret(Args...)> {
  static Ret call(const CastKernel& k, c10::DispatchKeySet keys, Args... args) {
    const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kCastKey);
    const UnboxedArguments<Args...> described(args...);
    CallPlan p;
    const CallRoute route = k.route(described.device(), described, p);
    if (route == CallRoute::kAsGiven) {
      std::optional<c10::impl::ExcludeDispatchKeyGuard> stay_out;
      if (p.native_owns) stay_out.emplace(kCastKey);
      return Op::redispatch(below, args...);
    }
    // Aten's hot ops have no own autocast kernel of a library and no dtype argument.
    TORCH_INTERNAL_ASSERT(route == CallRoute::kCastArguments, Op::name);
    c10::impl::ExcludeDispatchKeyGuard no_recursion(kCastKey);
    if constexpr (std::is_same_v<Ret, at::Tensor>) {
      if (!p.widen_if_mixed) {  // (a mixed widening keeps the op's own kernel)
        if (auto fused = Fused<Op>::call(k, p, args...)) return *std::move(fused);
      }
    }
    auto cast = [&k, &p](const at::Tensor& t) { return k.cast_argument(t, p); };
    return Op::redispatch(below, rewrite_tensor_arg(args, cast)...);
  }

  static void register_on(torch::Library& library, const char* qualified,
                          const CastKernel* kernel) {
    library.impl(qualified,
                 torch::CppFunction([kernel](c10::DispatchKeySet keys, Args... args) -> Ret {
                   return call(*kernel, keys, std::forward<Args>(args)...);
                 }));
  }
};

struct HotOp {
  const char* name;
  const char* overload;
  void (*register_on)(torch::Library&, const char*, const CastKernel*);
  template <typename Op>
  static constexpr HotOp of() {
    return {Op::name, Op::overload_name, &Unboxed<Op>::register_on};
  }
};

// The listed operators a transformer or CNN step calls most, forward and backward (the backward's
// matmuls and adds come through here too, only to be passed on). None has a `dtype` argument
// (those keep the boxed kernel, which handles it). native_layer_norm: where layer_norm is not
// cast (O2/O5), the call it makes comes back through the key, once per layer norm.
// cross_entropy_loss: for its fused replacement above.
const HotOp kHotOps[] = {
    HotOp::of<at::_ops::mm>(),
    HotOp::of<at::_ops::addmm>(),
    HotOp::of<at::_ops::bmm>(),
    HotOp::of<at::_ops::baddbmm>(),
    HotOp::of<at::_ops::matmul>(),
    HotOp::of<at::_ops::linear>(),
    HotOp::of<at::_ops::add_Tensor>(),
    HotOp::of<at::_ops::sub_Tensor>(),
    HotOp::of<at::_ops::mul_Tensor>(),
    HotOp::of<at::_ops::div_Tensor>(),
    HotOp::of<at::_ops::layer_norm>(),
    HotOp::of<at::_ops::gelu>(),
    HotOp::of<at::_ops::conv2d>(),
    HotOp::of<at::_ops::scaled_dot_product_attention>(),
    HotOp::of<at::_ops::native_layer_norm>(),
    HotOp::of<at::_ops::cross_entropy_loss>(),
};

}  // namespace

bool register_unboxed(torch::Library& library, const c10::OperatorName& name,
                      const std::string& qualified, const CastKernel* kernel) {
  for (const HotOp& op : kHotOps) {
    if (name.name == op.name && name.overload_name == op.overload) {
      TORCH_INTERNAL_ASSERT(!kernel->has_dtype_argument(), qualified);
      op.register_on(library, qualified.c_str(), kernel);
      return true;
    }
  }
  return false;
}

}  // namespace amp::detail
