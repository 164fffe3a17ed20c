// Unboxed kernels on the substitution key for the ops that take parameters in most models. The
// boxed fallback works for every op, but boxing the arguments onto a stack and unboxing them
// again below costs more than the substitution itself; these ops skip both. Each kernel makes
// the same decisions as the fallback (SubstitutionCall) and redispatches below the key.
#include "dispatch/substitution_call.h"  // first: the at::_ops headers below need Tensor's
#include "dispatch/tensor_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/baddbmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/conv1d_ops.h>
#include <ATen/ops/conv2d_ops.h>
#include <ATen/ops/conv3d_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/embedding_ops.h>
#include <ATen/ops/expand_ops.h>
#include <ATen/ops/group_norm_ops.h>
#include <ATen/ops/layer_norm_ops.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/matmul_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/permute_ops.h>
#include <ATen/ops/reshape_ops.h>
#include <ATen/ops/set_data_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/t_ops.h>
#include <ATen/ops/transpose_ops.h>
#include <ATen/ops/unsqueeze_ops.h>
#include <ATen/ops/view_ops.h>
#include <torch/library.h>

#include <string>

namespace amp::detail {
namespace {

// The kernel of op `Op` (one of ATen's at::_ops structs), from its signature. `kView`: a view op,
// which hands registered buffers their own data (substitution.cpp, returns_a_view).
template <class Op, bool kView, class Signature = typename Op::schema>
struct Substituted;

template <class Op, bool kView, class Ret, class... Args>
struct Substituted<Op, kView, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    const SubstitutionCall call;
    if (!call.active() || (is_complex_argument(args) || ...)) {
      return Op::redispatch(below_substitution(keys), args...);  // the masters (a complex call)
    }
    // Tensors as the op below should see them: through the call's working copies.
    auto working = [&call](const at::Tensor& t) {
      return kView ? call.view_working_copy(t) : call.working_copy(t);
    };
    return Op::redispatch(below_substitution(keys), rewrite_tensor_arg(args, working)...);
  }
};

template <class Op>
std::string op_name() {
  std::string name = Op::name;
  if (Op::overload_name[0] != '\0') name += std::string(".") + Op::overload_name;
  return name;
}

template <bool kView, class... Ops>
void register_unboxed(torch::Library& lib) {
  (lib.impl(op_name<Ops>().c_str(), TORCH_FN((Substituted<Ops, kView>::call))), ...);
}

// The dispatched form of set_data (TorchScript's aten::set_data; Tensor::set_data itself goes
// through the hook of set_data_hook.cpp) replaces the key set the same way.
void set_data_keeping_key(c10::DispatchKeySet keys, at::Tensor& self, const at::Tensor& data) {
  at::_ops::set_data::redispatch(below_substitution(keys), self, data);
  remark_if_source(self.unsafeGetTensorImpl());
}

}  // namespace

void register_substitution_kernels(torch::Library& aten_on_key) {
  // add_: LibTorch's Linear adds its bias in place on inputs of more than two dimensions.
  register_unboxed</*kView=*/false, at::_ops::linear, at::_ops::mm, at::_ops::addmm,
                   at::_ops::matmul, at::_ops::bmm, at::_ops::baddbmm, at::_ops::conv1d,
                   at::_ops::conv2d, at::_ops::conv3d, at::_ops::embedding, at::_ops::layer_norm,
                   at::_ops::group_norm, at::_ops::add_Tensor, at::_ops::add__Tensor,
                   at::_ops::sub_Tensor, at::_ops::mul_Tensor, at::_ops::div_Tensor>(aten_on_key);
  // reshape returns a view where it can (its schema says Tensor(a), as the boxed test asks).
  register_unboxed</*kView=*/true, at::_ops::t, at::_ops::transpose_int, at::_ops::view,
                   at::_ops::reshape, at::_ops::permute, at::_ops::unsqueeze, at::_ops::expand>(
      aten_on_key);
  aten_on_key.impl("aten::set_data", TORCH_FN(set_data_keeping_key));
}

}  // namespace amp::detail
