// O1/O4 op-level casting on optamp's dispatch key (docs/casting.md, docs/design.md).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>
#include <torch/nn/functional/normalization.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cache/cast_cache.h"
#include "core/step_events.h"
#include "dispatch/cast_state.h"
#include "dispatch/policy_table.h"
#include "dispatch/registration.h"
#include "optamp/amp.h"
#include "test_util.h"

// A custom op library for the registration tests: a pure function and an in-place one.
TORCH_LIBRARY(optamp_test, m) {
  m.def("twice(Tensor x) -> Tensor");
  m.def("twice.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("accumulate_(Tensor(a!) self, Tensor other) -> Tensor(a!)");
  m.def("first_defined(Tensor?[] xs) -> Tensor");  // a Tensor?[] argument, for the walker
}
TORCH_LIBRARY_IMPL(optamp_test, CompositeExplicitAutograd, m) {
  m.impl("twice", [](const at::Tensor& x) { return x * 2; });
  m.impl("twice.out", [](const at::Tensor& x, at::Tensor& out) -> at::Tensor& {
    return at::mul_out(out, x, 2);
  });
  m.impl("accumulate_", [](at::Tensor& self, const at::Tensor& other) -> at::Tensor& {
    return self.add_(other.to(self.scalar_type()));
  });
  m.impl("first_defined", [](const c10::List<std::optional<at::Tensor>>& xs) {
    for (const std::optional<at::Tensor>& x : xs) {
      if (x && x->defined()) return x->clone();
    }
    return at::Tensor();
  });
}

namespace amp {
namespace {

using at::ScalarType;

at::Tensor call_twice(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::twice", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor call_first_defined(const c10::List<std::optional<at::Tensor>>& xs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::first_defined", "")
                       .typed<at::Tensor(const c10::List<std::optional<at::Tensor>>&)>();
  return op.call(xs);
}

class Casting : public ::testing::Test {
 protected:
  void enable(const char* level, Options options = {}) {
    detail::set_level_rules(resolve(level, options));
    detail::activate_thread(true);
  }
  void TearDown() override {
    detail::activate_thread(false);
    detail::clear_level_rules();
    clear_cache();
  }
  static at::Tensor randn(at::IntArrayRef shape, ScalarType dtype = at::kFloat) {
    return at::randn(shape, at::TensorOptions().dtype(dtype));
  }
};

// ---- table-driven: representative inputs for every op in every list ----------------------

// The device the table cases build their inputs on (CPU, or CUDA in the *_CUDA twins).
at::Device g_case_device = at::kCPU;
at::TensorOptions on_device(ScalarType t) { return at::dtype(t).device(g_case_device); }
at::Tensor targets(std::initializer_list<int64_t> v) {
  return at::tensor(v, at::kLong).to(g_case_device);
}

// One representative call of one table entry. `name` is the entry ("op" or "op.overload", in
// aten::), and the call must dispatch exactly that overload at the top level:
// EveryTableEntryHasACaseThatCallsIt checks both against builtin_table().
struct OpCase {
  const char* name;
  std::function<at::Tensor(ScalarType)> run;  // builds inputs of the given dtype, runs the op
  // The op's result dtype whatever it computes in (comparisons: bool); Undefined = the dtype
  // the policy computes in.
  ScalarType result = ScalarType::Undefined;
};

// +1/-1 targets of the margin losses, in dtype t.
at::Tensor signs(ScalarType t) {
  return at::tensor({1.0, -1.0, 1.0, -1.0}, on_device(at::kFloat)).to(t);
}

// Batch sizes of a packed sequence of lengths {3, 2} (5 rows): always a CPU int64 tensor.
at::Tensor packed_batch_sizes() { return at::tensor({2, 2, 1}, at::kLong); }

// at::rnn_tanh / at::rnn_relu share their two signatures: one layer without biases, input or
// packed (".data") form by the case name.
using SimpleRnnInput = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                              at::TensorList, bool, int64_t, double,
                                                              bool, bool, bool);
using SimpleRnnData = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, at::TensorList,
                                                             bool, int64_t, double, bool, bool);
OpCase simple_rnn_input_case(const char* name, SimpleRnnInput input_form) {
  return {name, [input_form](ScalarType t) {
            auto r = [t](at::IntArrayRef s) { return at::randn(s, on_device(t)); };
            return std::get<0>(input_form(r({3, 2, 3}), r({1, 2, 4}), {r({4, 3}), r({4, 4})}, false,
                                          1, 0.0, true, false, false));
          }};
}
OpCase simple_rnn_data_case(const char* name, SimpleRnnData data_form) {
  return {name, [data_form](ScalarType t) {
            auto r = [t](at::IntArrayRef s) { return at::randn(s, on_device(t)); };
            return std::get<0>(data_form(r({5, 3}), packed_batch_sizes(), r({1, 2, 4}),
                                         {r({4, 3}), r({4, 4})}, false, 1, 0.0, true, false));
          }};
}

std::vector<OpCase> lower_cases() {
  auto r = [](at::IntArrayRef s, ScalarType t) { return at::randn(s, on_device(t)); };
  return {
      {"conv1d",
       [r](ScalarType t) {
         return at::conv1d(r({1, 2, 8}, t), r({3, 2, 3}, t));
       }},
      {"conv2d",
       [r](ScalarType t) {
         return at::conv2d(r({1, 2, 6, 6}, t), r({3, 2, 3, 3}, t));
       }},
      {"conv3d",
       [r](ScalarType t) {
         return at::conv3d(r({1, 2, 4, 4, 4}, t), r({3, 2, 3, 3, 3}, t));
       }},
      {"conv1d.padding",
       [r](ScalarType t) {
         return at::conv1d(r({1, 2, 8}, t), r({3, 2, 3}, t), {}, 1, "same");
       }},
      {"conv2d.padding",
       [r](ScalarType t) {
         return at::conv2d(r({1, 2, 6, 6}, t), r({3, 2, 3, 3}, t), {}, 1, "same");
       }},
      {"conv3d.padding",
       [r](ScalarType t) {
         return at::conv3d(r({1, 2, 4, 4, 4}, t), r({3, 2, 3, 3, 3}, t), {}, 1, "valid");
       }},
      {"convolution",
       [r](ScalarType t) {
         return at::convolution(r({1, 2, 6, 6}, t), r({3, 2, 3, 3}, t), r({3}, t), {1, 1}, {0, 0},
                                {1, 1}, /*transposed=*/false, {0, 0}, /*groups=*/1);
       }},
      {"_convolution",
       [r](ScalarType t) {
         return at::_convolution(r({1, 2, 6, 6}, t), r({3, 2, 3, 3}, t), r({3}, t), {1, 1}, {0, 0},
                                 {1, 1}, /*transposed=*/false, {0, 0}, /*groups=*/1,
                                 /*benchmark=*/false, /*deterministic=*/false,
                                 /*cudnn_enabled=*/true, /*allow_tf32=*/false);
       }},
      {"conv_transpose1d",
       [r](ScalarType t) {
         return at::conv_transpose1d(r({1, 2, 5}, t), r({2, 3, 3}, t));
       }},
      {"conv_transpose2d.input",
       [r](ScalarType t) {
         return at::conv_transpose2d(r({1, 2, 4, 4}, t), r({2, 3, 3, 3}, t));
       }},
      {"conv_transpose3d.input",
       [r](ScalarType t) {
         return at::conv_transpose3d(r({1, 2, 3, 3, 3}, t), r({2, 3, 2, 2, 2}, t));
       }},
      {"conv_tbc",
       [r](ScalarType t) {
         return at::conv_tbc(r({5, 1, 2}, t), r({3, 2, 4}, t), r({4}, t));
       }},
      {"linear",
       [r](ScalarType t) {
         return at::linear(r({2, 4}, t), r({3, 4}, t), r({3}, t));
       }},
      {"prelu",
       [r](ScalarType t) {
         return at::prelu(r({2, 3}, t), r({1}, t));
       }},
      {"addmm",
       [r](ScalarType t) {
         return at::addmm(r({2, 2}, t), r({2, 3}, t), r({3, 2}, t));
       }},
      {"_addmm_activation",
       [r](ScalarType t) {
         return at::_addmm_activation(r({2, 2}, t), r({2, 3}, t), r({3, 2}, t), 1, 1, true);
       }},
      {"addmv",
       [r](ScalarType t) {
         return at::addmv(r({2}, t), r({2, 3}, t), r({3}, t));
       }},
      {"addr",
       [r](ScalarType t) {
         return at::addr(r({2, 3}, t), r({2}, t), r({3}, t));
       }},
      {"matmul",
       [r](ScalarType t) {
         return at::matmul(r({2, 3}, t), r({3, 2}, t));
       }},
      {"mm",
       [r](ScalarType t) {
         return at::mm(r({2, 3}, t), r({3, 2}, t));
       }},
      {"mv",
       [r](ScalarType t) {
         return at::mv(r({2, 3}, t), r({3}, t));
       }},
      {"addbmm",
       [r](ScalarType t) {
         return at::addbmm(r({2, 2}, t), r({3, 2, 4}, t), r({3, 4, 2}, t));
       }},
      {"baddbmm",
       [r](ScalarType t) {
         return at::baddbmm(r({3, 2, 2}, t), r({3, 2, 4}, t), r({3, 4, 2}, t));
       }},
      {"bmm",
       [r](ScalarType t) {
         return at::bmm(r({3, 2, 4}, t), r({3, 4, 2}, t));
       }},
      {"chain_matmul",  // deprecated (warns once), still dispatched
       [r](ScalarType t) {
         return at::chain_matmul({r({2, 3}, t), r({3, 4}, t), r({4, 2}, t)});
       }},
      {"linalg_multi_dot",
       [r](ScalarType t) {
         return at::linalg_multi_dot({r({2, 3}, t), r({3, 4}, t), r({4, 2}, t)});
       }},
      {"einsum",
       [r](ScalarType t) {
         return at::einsum("ij,jk->ik", {r({2, 3}, t), r({3, 2}, t)});
       }},
      {"scaled_dot_product_attention",
       [r](ScalarType t) {
         return at::scaled_dot_product_attention(r({1, 2, 4, 8}, t), r({1, 2, 4, 8}, t),
                                                 r({1, 2, 4, 8}, t));
       }},
      {"_native_multi_head_attention",  // what nn.MultiheadAttention's fast path calls
       [r](ScalarType t) {
         auto q = r({2, 3, 8}, t);  // batch 2, 3 tokens, embed_dim 8, 2 heads
         return std::get<0>(at::_native_multi_head_attention(q, q, q, 8, 2, r({24, 8}, t),
                                                             r({24}, t), r({8, 8}, t), r({8}, t)));
       }},
      {"lstm_cell",
       [r](ScalarType t) {
         return std::get<0>(at::lstm_cell(r({2, 3}, t), {r({2, 4}, t), r({2, 4}, t)}, r({16, 3}, t),
                                          r({16, 4}, t)));
       }},
      {"gru_cell",
       [r](ScalarType t) {
         return at::gru_cell(r({2, 3}, t), r({2, 4}, t), r({12, 3}, t), r({12, 4}, t));
       }},
      {"rnn_tanh_cell",
       [r](ScalarType t) {
         return at::rnn_tanh_cell(r({2, 3}, t), r({2, 4}, t), r({4, 3}, t), r({4, 4}, t));
       }},
      {"rnn_relu_cell",
       [r](ScalarType t) {
         return at::rnn_relu_cell(r({2, 3}, t), r({2, 4}, t), r({4, 3}, t), r({4, 4}, t));
       }},
      // Whole layers: one layer without biases, sequence 3, batch 2, input 3, hidden 4. The
      // ".data" form takes a packed sequence (rows of all steps, CPU batch sizes).
      {"lstm.input",
       [r](ScalarType t) {
         return std::get<0>(at::lstm(r({3, 2, 3}, t), {r({1, 2, 4}, t), r({1, 2, 4}, t)},
                                     {r({16, 3}, t), r({16, 4}, t)}, false, 1, 0.0, true, false,
                                     false));
       }},
      {"lstm.data",
       [r](ScalarType t) {
         return std::get<0>(at::lstm(r({5, 3}, t), packed_batch_sizes(),
                                     {r({1, 2, 4}, t), r({1, 2, 4}, t)},
                                     {r({16, 3}, t), r({16, 4}, t)}, false, 1, 0.0, true, false));
       }},
      {"gru.input",
       [r](ScalarType t) {
         return std::get<0>(at::gru(r({3, 2, 3}, t), r({1, 2, 4}, t),
                                    {r({12, 3}, t), r({12, 4}, t)}, false, 1, 0.0, true, false,
                                    false));
       }},
      {"gru.data",
       [r](ScalarType t) {
         return std::get<0>(at::gru(r({5, 3}, t), packed_batch_sizes(), r({1, 2, 4}, t),
                                    {r({12, 3}, t), r({12, 4}, t)}, false, 1, 0.0, true, false));
       }},
      simple_rnn_input_case("rnn_tanh.input", &at::rnn_tanh),
      simple_rnn_data_case("rnn_tanh.data", &at::rnn_tanh),
      simple_rnn_input_case("rnn_relu.input", &at::rnn_relu),
      simple_rnn_data_case("rnn_relu.data", &at::rnn_relu),
  };
}

std::vector<OpCase> fp32_cases() {
  auto r = [](at::IntArrayRef s, ScalarType t) { return at::rand(s, on_device(t)) + 0.5; };
  auto u = [r](const char* name, at::Tensor (*fn)(const at::Tensor&)) {
    return OpCase{name, [r, fn](ScalarType t) { return fn(r({2, 3}, t)); }};
  };
  // The ".vec" upsample overloads (what F.interpolate calls) take optional sizes and optional
  // scale factors; spelling the scales' type keeps the "" overload (sizes, optional<double>
  // scales) out of overload resolution.
  const std::optional<at::ArrayRef<double>> no_scales;
  const std::vector<int64_t> s1{8}, s2{4, 4}, s3{4, 4, 4};
  return {
      {"upsample_nearest1d",
       [r](ScalarType t) {
         return at::upsample_nearest1d(r({1, 1, 4}, t), {8});
       }},
      {"upsample_nearest1d.vec",
       [=](ScalarType t) {
         return at::upsample_nearest1d(r({1, 1, 4}, t), s1, no_scales);
       }},
      {"upsample_nearest2d",
       [r](ScalarType t) {
         return at::upsample_nearest2d(r({1, 1, 2, 2}, t), {4, 4});
       }},
      {"upsample_nearest2d.vec",
       [=](ScalarType t) {
         return at::upsample_nearest2d(r({1, 1, 2, 2}, t), s2, no_scales);
       }},
      {"upsample_nearest3d",
       [r](ScalarType t) {
         return at::upsample_nearest3d(r({1, 1, 2, 2, 2}, t), {4, 4, 4});
       }},
      {"upsample_nearest3d.vec",
       [=](ScalarType t) {
         return at::upsample_nearest3d(r({1, 1, 2, 2, 2}, t), s3, no_scales);
       }},
      {"upsample_linear1d",
       [r](ScalarType t) {
         return at::upsample_linear1d(r({1, 1, 4}, t), {8}, false);
       }},
      {"upsample_linear1d.vec",
       [=](ScalarType t) {
         return at::upsample_linear1d(r({1, 1, 4}, t), s1, false, no_scales);
       }},
      {"upsample_bilinear2d",
       [r](ScalarType t) {
         return at::upsample_bilinear2d(r({1, 1, 2, 2}, t), {4, 4}, false);
       }},
      {"upsample_bilinear2d.vec",
       [=](ScalarType t) {
         return at::upsample_bilinear2d(r({1, 1, 2, 2}, t), s2, false, no_scales);
       }},
      {"upsample_bicubic2d",
       [r](ScalarType t) {
         return at::upsample_bicubic2d(r({1, 1, 2, 2}, t), {4, 4}, false);
       }},
      {"upsample_bicubic2d.vec",
       [=](ScalarType t) {
         return at::upsample_bicubic2d(r({1, 1, 2, 2}, t), s2, false, no_scales);
       }},
      {"upsample_trilinear3d",
       [r](ScalarType t) {
         return at::upsample_trilinear3d(r({1, 1, 2, 2, 2}, t), {4, 4, 4}, false);
       }},
      {"upsample_trilinear3d.vec",
       [=](ScalarType t) {
         return at::upsample_trilinear3d(r({1, 1, 2, 2, 2}, t), s3, false, no_scales);
       }},
      {"_upsample_nearest_exact1d",
       [r](ScalarType t) {
         return at::_upsample_nearest_exact1d(r({1, 1, 4}, t), {8});
       }},
      {"_upsample_nearest_exact1d.vec",
       [=](ScalarType t) {
         return at::_upsample_nearest_exact1d(r({1, 1, 4}, t), s1, no_scales);
       }},
      {"_upsample_nearest_exact2d",
       [r](ScalarType t) {
         return at::_upsample_nearest_exact2d(r({1, 1, 2, 2}, t), {4, 4});
       }},
      {"_upsample_nearest_exact2d.vec",
       [=](ScalarType t) {
         return at::_upsample_nearest_exact2d(r({1, 1, 2, 2}, t), s2, no_scales);
       }},
      {"_upsample_nearest_exact3d",
       [r](ScalarType t) {
         return at::_upsample_nearest_exact3d(r({1, 1, 2, 2, 2}, t), {4, 4, 4});
       }},
      {"_upsample_nearest_exact3d.vec",
       [=](ScalarType t) {
         return at::_upsample_nearest_exact3d(r({1, 1, 2, 2, 2}, t), s3, no_scales);
       }},
      {"_upsample_bilinear2d_aa",
       [r](ScalarType t) {
         return at::_upsample_bilinear2d_aa(r({1, 1, 4, 4}, t), {2, 3}, false);
       }},
      {"_upsample_bilinear2d_aa.vec",
       [r, no_scales](ScalarType t) {
         const std::vector<int64_t> size{2, 3};
         return at::_upsample_bilinear2d_aa(r({1, 1, 4, 4}, t), size, false, no_scales);
       }},
      {"_upsample_bicubic2d_aa",
       [r](ScalarType t) {
         return at::_upsample_bicubic2d_aa(r({1, 1, 4, 4}, t), {2, 3}, false);
       }},
      {"_upsample_bicubic2d_aa.vec",
       [r, no_scales](ScalarType t) {
         const std::vector<int64_t> size{2, 3};
         return at::_upsample_bicubic2d_aa(r({1, 1, 4, 4}, t), size, false, no_scales);
       }},
      {"avg_pool3d",  // local_response_norm's pooling; no fp16/bf16 CPU kernel
       [r](ScalarType t) {
         return at::avg_pool3d(r({1, 1, 4, 4, 4}, t), {2, 2, 2});
       }},
      {"grid_sampler",
       [r](ScalarType t) {
         return at::grid_sampler(r({1, 1, 3, 3}, t), r({1, 2, 2, 2}, t) - 1.0, 0, 0, false);
       }},
      {"softplus",
       [r](ScalarType t) {
         return at::softplus(r({2, 3}, t));
       }},
      {"softmax.int",
       [r](ScalarType t) {
         return at::softmax(r({2, 3}, t), 1);
       }},
      {"log_softmax.int",
       [r](ScalarType t) {
         return at::log_softmax(r({2, 3}, t), 1);
       }},
      {"gelu",
       [r](ScalarType t) {
         return at::gelu(r({2, 3}, t));
       }},
      {"layer_norm",
       [r](ScalarType t) {
         return at::layer_norm(r({2, 3}, t), {3});
       }},
      {"group_norm",
       [r](ScalarType t) {
         return at::group_norm(r({2, 4, 3}, t), 2);
       }},
      {"cosine_similarity",
       [r](ScalarType t) {
         return at::cosine_similarity(r({2, 3}, t), r({2, 3}, t));
       }},
      u("acos", [](const at::Tensor& x) { return at::acos(x - 1.0); }),
      u("asin", [](const at::Tensor& x) { return at::asin(x - 1.0); }),
      u("cosh", [](const at::Tensor& x) { return at::cosh(x); }),
      u("erfinv", [](const at::Tensor& x) { return at::erfinv(x - 1.0); }),
      u("exp", [](const at::Tensor& x) { return at::exp(x); }),
      u("expm1", [](const at::Tensor& x) { return at::expm1(x); }),
      u("log", [](const at::Tensor& x) { return at::log(x); }),
      u("log10", [](const at::Tensor& x) { return at::log10(x); }),
      u("log2", [](const at::Tensor& x) { return at::log2(x); }),
      u("log1p", [](const at::Tensor& x) { return at::log1p(x); }),
      u("reciprocal", [](const at::Tensor& x) { return at::reciprocal(x); }),
      u("rsqrt", [](const at::Tensor& x) { return at::rsqrt(x); }),
      u("sinh", [](const at::Tensor& x) { return at::sinh(x); }),
      u("tan", [](const at::Tensor& x) { return at::tan(x); }),
      u("pow.Tensor_Scalar", [](const at::Tensor& x) { return at::pow(x, 2); }),
      u("pow.Tensor_Tensor", [](const at::Tensor& x) { return at::pow(x, x); }),
      u("pow.Scalar", [](const at::Tensor& x) { return at::pow(2.0, x); }),
      u("cumprod", [](const at::Tensor& x) { return at::cumprod(x, 1); }),
      u("cumsum", [](const at::Tensor& x) { return at::cumsum(x, 1); }),
      u("dist", [](const at::Tensor& x) { return at::dist(x, x * 2); }),
      u("norm.Scalar", [](const at::Tensor& x) { return at::norm(x); }),
      u("norm.ScalarOpt_dim",
        [](const at::Tensor& x) {
          return at::norm(x, std::optional<at::Scalar>(2), at::IntArrayRef{1});
        }),
      // The two overloads with a required `dtype`: the result has the caller's dtype; fp32 is
      // the only one that works under the policy (see ExplicitLowDtypeOfNormIsRespected).
      u("norm.ScalarOpt_dim_dtype",
        [](const at::Tensor& x) {
          return at::norm(x, std::optional<at::Scalar>(2), at::IntArrayRef{1}, false, at::kFloat);
        }),
      u("norm.ScalarOpt_dtype",
        [](const at::Tensor& x) { return at::norm(x, std::optional<at::Scalar>(2), at::kFloat); }),
      u("linalg_vector_norm", [](const at::Tensor& x) { return at::linalg_vector_norm(x); }),
      u("prod", [](const at::Tensor& x) { return at::prod(x); }),
      u("prod.dim_int", [](const at::Tensor& x) { return at::prod(x, 1); }),
      u("std", [](const at::Tensor& x) { return at::std(x, /*unbiased=*/true); }),
      u("std.dim", [](const at::Tensor& x) { return at::std(x, at::IntArrayRef{1}, true); }),
      u("std.correction",
        [](const at::Tensor& x) {
          return at::std(x, at::IntArrayRef{1}, std::optional<at::Scalar>(1));
        }),
      u("sum", [](const at::Tensor& x) { return at::sum(x); }),
      u("sum.dim_IntList", [](const at::Tensor& x) { return at::sum(x, {1}); }),
      u("var", [](const at::Tensor& x) { return at::var(x, /*unbiased=*/true); }),
      u("var.dim", [](const at::Tensor& x) { return at::var(x, at::IntArrayRef{1}, true); }),
      u("var.correction",
        [](const at::Tensor& x) {
          return at::var(x, at::IntArrayRef{1}, std::optional<at::Scalar>(1));
        }),
      u("renorm", [](const at::Tensor& x) { return at::renorm(x, 2, 0, 1); }),
      // losses
      {"nll_loss",
       [r](ScalarType t) {
         return at::nll_loss(r({4, 3}, t), targets({0, 1, 2, 1}));
       }},
      {"nll_loss2d",
       [r](ScalarType t) {
         return at::nll_loss2d(r({2, 3, 2, 2}, t),
                               targets({0, 1, 2, 1, 2, 0, 1, 1}).view({2, 2, 2}));
       }},
      {"nll_loss_nd",
       [r](ScalarType t) {
         return at::nll_loss_nd(r({4, 3}, t), targets({0, 1, 2, 1}));
       }},
      {"cross_entropy_loss",
       [r](ScalarType t) {
         return at::cross_entropy_loss(r({4, 3}, t), targets({0, 1, 2, 1}));
       }},
      {"mse_loss", [r](ScalarType t) { return at::mse_loss(r({4}, t), r({4}, t)); }},
      {"l1_loss", [r](ScalarType t) { return at::l1_loss(r({4}, t), r({4}, t)); }},
      {"smooth_l1_loss", [r](ScalarType t) { return at::smooth_l1_loss(r({4}, t), r({4}, t)); }},
      {"huber_loss", [r](ScalarType t) { return at::huber_loss(r({4}, t), r({4}, t)); }},
      {"kl_div", [r](ScalarType t) { return at::kl_div(r({4}, t), r({4}, t)); }},
      {"binary_cross_entropy_with_logits",
       [r](ScalarType t) {
         return at::binary_cross_entropy_with_logits(r({4}, t), r({4}, t) - 0.5);
       }},
      {"soft_margin_loss",
       [r](ScalarType t) { return at::soft_margin_loss(r({4}, t), r({4}, t)); }},
      {"multi_margin_loss",
       [r](ScalarType t) {
         return at::multi_margin_loss(r({4, 3}, t), targets({0, 1, 2, 1}));
       }},
      {"multilabel_margin_loss",
       [r](ScalarType t) {
         return at::multilabel_margin_loss(r({2, 3}, t),
                                           targets({0, 2, -1, 1, -1, 0}).view({2, 3}));
       }},
      {"hinge_embedding_loss",
       [r](ScalarType t) { return at::hinge_embedding_loss(r({4}, t), signs(t)); }},
      {"margin_ranking_loss",
       [r](ScalarType t) { return at::margin_ranking_loss(r({4}, t), r({4}, t), signs(t)); }},
      {"cosine_embedding_loss",
       [r](ScalarType t) {
         return at::cosine_embedding_loss(r({4, 3}, t), r({4, 3}, t), signs(t));
       }},
      {"poisson_nll_loss",
       [r](ScalarType t) {
         return at::poisson_nll_loss(r({4}, t), r({4}, t), /*log_input=*/true, /*full=*/false,
                                     /*eps=*/1e-8, at::Reduction::Mean);
       }},
      {"triplet_margin_loss",
       [r](ScalarType t) {
         return at::triplet_margin_loss(r({4, 3}, t), r({4, 3}, t), r({4, 3}, t));
       }},
      // ctc: log-probs made in fp32 (log_softmax is itself fp32 under the policy), then handed
      // over in dtype t; 5 time steps, batch 2, 4 classes, targets of length 2.
      {"ctc_loss.IntList",
       [](ScalarType t) {
         auto log_probs = at::log_softmax(at::randn({5, 2, 4}, on_device(at::kFloat)), 2).to(t);
         return at::ctc_loss(log_probs, targets({1, 2, 1, 3}).view({2, 2}), at::IntArrayRef{5, 5},
                             at::IntArrayRef{2, 2});
       }},
      {"ctc_loss.Tensor",
       [](ScalarType t) {
         auto log_probs = at::log_softmax(at::randn({5, 2, 4}, on_device(at::kFloat)), 2).to(t);
         return at::ctc_loss(log_probs, targets({1, 2, 1, 3}).view({2, 2}), targets({5, 5}),
                             targets({2, 2}));
       }},
  };
}

std::vector<OpCase> promote_cases() {
  // Mixed widths: the first input in the low dtype, the second in fp32.
  auto lo = [](at::IntArrayRef s, ScalarType t) { return at::rand(s, on_device(t)) + 0.5; };
  auto hi = [](at::IntArrayRef s) { return at::rand(s, on_device(at::kFloat)) + 0.5; };
  auto compare = [=](const char* name, at::Tensor (*fn)(const at::Tensor&, const at::Tensor&)) {
    return OpCase{name, [=](ScalarType t) { return fn(lo({3}, t), hi({3})); }, at::kBool};
  };
  return {
      {"addcdiv", [=](ScalarType t) { return at::addcdiv(lo({3}, t), hi({3}), lo({3}, t)); }},
      {"addcmul", [=](ScalarType t) { return at::addcmul(lo({3}, t), hi({3}), lo({3}, t)); }},
      {"atan2", [=](ScalarType t) { return at::atan2(lo({3}, t), hi({3})); }},
      {"cross",
       [=](ScalarType t) {
         return at::cross(lo({2, 3}, t), hi({2, 3}), 1);
       }},
      {"linalg_cross",
       [=](ScalarType t) {
         return at::linalg_cross(lo({2, 3}, t), hi({2, 3}));
       }},
      {"bilinear",
       [=](ScalarType t) {
         return at::bilinear(lo({2, 3}, t), hi({2, 4}), hi({5, 3, 4}), {});
       }},
      {"dot", [=](ScalarType t) { return at::dot(lo({3}, t), hi({3})); }},
      {"vdot", [=](ScalarType t) { return at::vdot(lo({3}, t), hi({3})); }},
      {"add.Tensor", [=](ScalarType t) { return at::add(lo({3}, t), hi({3})); }},
      {"sub.Tensor", [=](ScalarType t) { return at::sub(lo({3}, t), hi({3})); }},
      {"mul.Tensor", [=](ScalarType t) { return at::mul(lo({3}, t), hi({3})); }},
      {"div.Tensor", [=](ScalarType t) { return at::div(lo({3}, t), hi({3})); }},
      // Comparisons return bool whatever they compare in: the widening shows in cast_count().
      compare("eq.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::eq(a, b); }),
      compare("ne.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::ne(a, b); }),
      compare("lt.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::lt(a, b); }),
      compare("le.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::le(a, b); }),
      compare("gt.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::gt(a, b); }),
      compare("ge.Tensor", [](const at::Tensor& a, const at::Tensor& b) { return at::ge(a, b); }),
      {"cat",
       [=](ScalarType t) {
         return at::cat({lo({3}, t), hi({3})});
       }},
      {"stack",
       [=](ScalarType t) {
         return at::stack({lo({3}, t), hi({3})});
       }},
      {"index_put",
       [=](ScalarType t) {
         return at::index_put(lo({4}, t), {std::optional<at::Tensor>(targets({1, 2}))}, hi({2}));
       }},
      {"tensordot",
       [=](ScalarType t) {
         return at::tensordot(lo({2, 3}, t), hi({3, 4}), {1}, {0});
       }},
      // A low-precision table with fp32 per-sample weights (mode sum): 4 indices in 2 bags.
      {"embedding_bag",
       [=](ScalarType t) {
         return std::get<0>(at::embedding_bag(lo({5, 3}, t), targets({0, 1, 2, 3}), targets({0, 2}),
                                              false, /*mode=*/0, false, hi({4})));
       }},
      {"embedding_bag.padding_idx",
       [=](ScalarType t) {
         return std::get<0>(at::embedding_bag(lo({5, 3}, t), targets({0, 1, 2, 3}), targets({0, 2}),
                                              false, /*mode=*/0, false, hi({4}),
                                              /*include_last_offset=*/false, /*padding_idx=*/4));
       }},
  };
}

// A promote case on mixed low/fp32 inputs: optamp (not ATen's type promotion, which would give
// the same dtype for some ops) widened the low inputs, and the result is fp32 (or the op's own
// result type).
void expect_promoted(const OpCase& c, ScalarType low) {
  const auto before = cast_count();
  const at::Tensor out = c.run(low);
  EXPECT_EQ(out.scalar_type(), c.result == ScalarType::Undefined ? at::kFloat : c.result);
  EXPECT_GT(cast_count() - before, 0) << "no input was cast";
}

class CastingTable : public Casting, public ::testing::WithParamInterface<const char*> {};

TEST_P(CastingTable, LowerOpsRunInTheLevelsLowDtype) {
  enable(GetParam());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : lower_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.run(at::kFloat).scalar_type(), low);
    EXPECT_EQ(c.run(low).scalar_type(), low);
  }
}

TEST_P(CastingTable, Fp32OpsRunInFp32) {
  enable(GetParam());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : fp32_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.run(low).scalar_type(), at::kFloat);
    EXPECT_EQ(c.run(at::kFloat).scalar_type(), at::kFloat);
  }
}

TEST_P(CastingTable, PromoteOpsWidenMixedInputs) {
  enable(GetParam());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : promote_cases()) {
    SCOPED_TRACE(c.name);
    expect_promoted(c, low);
  }
  // Same widths: left alone.
  auto a = randn({3}, low);
  const auto before = cast_count();
  EXPECT_EQ(at::add(a, a).scalar_type(), low);
  EXPECT_EQ(at::cat({a, a}).scalar_type(), low);
  EXPECT_EQ(at::eq(a, a).scalar_type(), at::kBool);
  EXPECT_EQ(cast_count(), before);
}

TEST_P(CastingTable, BannedOpSaysWhatToUseInstead) {
  enable(GetParam());
  auto p = at::rand({4}).clamp(0.1, 0.9);
  OPTAMP_EXPECT_THROW_WITH(at::binary_cross_entropy(p, p), c10::Error, "binary_cross_entropy",
                           "binary_cross_entropy_with_logits", "BCEWithLogitsLoss",
                           "Refused at O1/O4", "at O2/O5 it runs as an fp32 loss");
}

INSTANTIATE_TEST_SUITE_P(Levels, CastingTable, ::testing::Values("O1", "O4"));

// The one vocabulary: which policies each rule set applies (docs/design.md, "Policies per level").
TEST(CastPolicies, EachRuleSetAppliesItsPolicies) {
  const CastPolicy all[] = {CastPolicy::kLower, CastPolicy::kFp32, CastPolicy::kFp32Loss,
                            CastPolicy::kPromote, CastPolicy::kBanned};
  auto applied = [&](RuleSet rules) {
    std::string out;
    for (const CastPolicy p : all) {
      if (policy_applies(p, rules)) out += std::string(out.empty() ? "" : ", ") + to_string(p);
    }
    return out;
  };
  EXPECT_EQ(applied(RuleSet::kNone), "");
  EXPECT_EQ(applied(RuleSet::kFullLists), "lower, fp32, fp32 (loss), promote, banned");
  EXPECT_EQ(applied(RuleSet::kMasterWeights), "lower, fp32 (loss), banned");
  EXPECT_EQ(applied(RuleSet::kPureLow), "lower");
  EXPECT_STREQ(to_string(RuleSet::kMasterWeights), "master weights");
  // Only the banned entries carry a message, and each of them does.
  for (const auto& entry : detail::builtin_table()) {
    EXPECT_EQ(entry.message != nullptr, entry.policy == CastPolicy::kBanned) << entry.name;
  }
}

TEST_F(Casting, CastRulesNowFollowTheLevelTheGateAndRegions) {
  EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);  // no level yet
  enable("O1");
  EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kFullLists);
  EXPECT_EQ(cast_rules_now(at::kCPU).low, at::kHalf);
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);
    amp::autocast region(true, at::kBFloat16);
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kFullLists);
    EXPECT_EQ(cast_rules_now(at::kCPU).low, at::kBFloat16);
  }
  {
    disable_casts off;
    EXPECT_EQ(cast_rules_now(at::kCPU).rules, RuleSet::kNone);
  }
}

// The casting kernel and the O2/O5 substitution share one walker over tensor arguments; the
// substitution's own copy used to skip Tensor?[] (index, index_put, custom ops).
TEST(SubstitutionWalker, OptionalTensorListArgumentsSeeWorkingCopiesAtO2O5) {
  for (const char* level : {"O2", "O5"}) {
    SCOPED_TRACE(level);
    torch::nn::Linear lin(3, 2);
    torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
    Options o;
    o.verbosity = 0;
    initialize(lin, opt, level, o);
    const ScalarType low = resolve(level).low_dtype();
    const at::Tensor& w = lin->weight;
    c10::List<std::optional<at::Tensor>> xs;
    xs.push_back(std::nullopt);
    xs.push_back(w);
    EXPECT_EQ(call_first_defined(xs).scalar_type(), low);
    const at::Tensor mask = w.detach() > 0;  // a parameter-derived index list
    EXPECT_EQ(w.index({mask}).scalar_type(), low);
    EXPECT_EQ(at::index(w, c10::List<std::optional<at::Tensor>>({mask})).scalar_type(), low);
    reset();
  }
}

// Records the operators ("aten::op" / "aten::op.overload") that code dispatches at the top
// level on this thread, leaving out the calls made inside them.
class TopLevelOps {
 public:
  std::vector<std::string> record(const std::function<void()>& fn) {
    std::vector<std::string> called;
    sink_ = &called;
    depth_ = 0;
    const auto handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&enter, &leave).scopes({at::RecordScope::FUNCTION}));
    try {
      fn();
    } catch (...) {
      at::removeCallback(handle);
      sink_ = nullptr;
      throw;
    }
    at::removeCallback(handle);
    sink_ = nullptr;
    return called;
  }

 private:
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (depth_++ == 0 && sink_ != nullptr) {
      if (auto op = fn.operator_name()) {
        sink_->push_back(op->overload_name.empty() ? op->name : op->name + "." + op->overload_name);
      }
    }
    return nullptr;
  }
  static void leave(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) { --depth_; }
  static thread_local std::vector<std::string>* sink_;
  static thread_local int depth_;
};
thread_local std::vector<std::string>* TopLevelOps::sink_ = nullptr;
thread_local int TopLevelOps::depth_ = 0;

// The mechanical cross-check of the lists above against the policy table: every entry (except
// the banned one, BannedOpSaysWhatToUseInstead) has a case of its name in its category's list,
// that case really dispatches that overload, and no case names something not in the table.
TEST_F(Casting, EveryTableEntryHasACaseThatCallsIt) {
  enable("O1");
  const std::vector<std::pair<const char*, std::vector<OpCase>>> lists = {
      {"lower", lower_cases()}, {"fp32", fp32_cases()}, {"promote", promote_cases()}};
  auto list_of = [](CastPolicy c) -> const char* {
    switch (c) {
      case CastPolicy::kLower:
        return "lower";
      case CastPolicy::kFp32:
      case CastPolicy::kFp32Loss:
        return "fp32";
      case CastPolicy::kPromote:
        return "promote";
      case CastPolicy::kBanned:
        break;
    }
    return nullptr;
  };
  std::vector<std::string> entries;
  for (const auto& entry : detail::builtin_table()) {
    const char* list = list_of(entry.policy);
    if (list == nullptr) continue;
    std::string name = std::string(entry.name).substr(std::strlen("aten::"));
    if (*entry.overload != '\0') name += std::string(".") + entry.overload;
    entries.push_back(std::string(list) + " " + name);
    const auto& cases = std::find_if(lists.begin(), lists.end(), [&](const auto& l) {
                          return std::strcmp(l.first, list) == 0;
                        })->second;
    const auto found =
        std::find_if(cases.begin(), cases.end(), [&](const OpCase& c) { return name == c.name; });
    if (found == cases.end()) {
      ADD_FAILURE() << "aten::" << name << " (" << list << ") has no case in " << list
                    << "_cases()";
      continue;
    }
    const auto called = TopLevelOps().record([&] { found->run(detail::level_low_dtype()); });
    std::string seen;
    for (const auto& op : called) seen += " " + op;
    EXPECT_NE(std::find(called.begin(), called.end(), "aten::" + name), called.end())
        << "the case \"" << name << "\" does not call aten::" << name << "; it calls:" << seen;
  }
  for (const auto& [list, cases] : lists) {
    for (const auto& c : cases) {
      EXPECT_NE(std::find(entries.begin(), entries.end(), std::string(list) + " " + c.name),
                entries.end())
          << list << "_cases() has \"" << c.name << "\", which is no " << list
          << " entry of builtin_table()";
    }
  }
}

// The same tables on CUDA tensors (run whenever a GPU is visible).
class CastingTable_CUDA : public CastingTable {
 protected:
  void SetUp() override {
    OPTAMP_SKIP_WITHOUT_CUDA();
    g_case_device = at::kCUDA;
  }
  void TearDown() override {
    g_case_device = at::kCPU;
    CastingTable::TearDown();
  }
};

TEST_P(CastingTable_CUDA, AllListsOnCuda) {
  enable(GetParam());
  const ScalarType low = detail::level_low_dtype();
  for (const auto& c : lower_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.run(at::kFloat).scalar_type(), low);
  }
  for (const auto& c : fp32_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.run(low).scalar_type(), at::kFloat);
  }
  for (const auto& c : promote_cases()) {
    SCOPED_TRACE(c.name);
    expect_promoted(c, low);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, CastingTable_CUDA, ::testing::Values("O1", "O4"));

// A device backend that owns the key (simulated by a fallback registered first) makes the first
// activation fail with a message naming the conflict. Runs in a fresh child process
// ("threadsafe" death tests re-execute the binary), where optamp has registered nothing yet.
TEST(CastingKeyConflictDeathTest, ActivationNamesTheConflict) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        static torch::Library other(torch::Library::IMPL, "_", detail::kCastKey, __FILE__,
                                    __LINE__);
        other.fallback(torch::CppFunction::makeFallthrough());
        try {
          detail::activate_thread(true);
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "%s\n", e.what_without_backtrace());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(3), "another library already registered a fallback");
}

TEST_F(Casting, PatchTypeBF16AtO1) {
  Options o;
  o.patch_torch_functions_type = at::kBFloat16;
  enable("O1", o);
  EXPECT_EQ(at::mm(randn({2, 3}), randn({3, 2})).scalar_type(), at::kBFloat16);
}

TEST_F(Casting, DoublesIntegersBoolsAndComplexAreNeverCast) {
  enable("O1");
  const auto before = cast_count();
  EXPECT_EQ(at::mm(randn({2, 3}, at::kDouble), randn({3, 2}, at::kDouble)).scalar_type(),
            at::kDouble);
  auto ints = at::ones({2, 2}, at::kLong);
  EXPECT_EQ(at::mm(ints, ints).scalar_type(), at::kLong);
  EXPECT_EQ(at::sum(at::ones({3}, at::kBool)).scalar_type(), at::kLong);
  // complex64 in a lower, an fp32 and a promote op: never a floating width to cast or count.
  auto c = randn({2, 2}, at::kComplexFloat);
  EXPECT_EQ(at::mm(c, c).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(at::exp(c).scalar_type(), at::kComplexFloat);
  EXPECT_TRUE(at::equal(at::exp(c), [&] {
    disable_casts off;
    return at::exp(c);
  }()));
  EXPECT_EQ(at::add(c, randn({2, 2}, at::kHalf)).scalar_type(), at::kComplexFloat);
  EXPECT_EQ(cast_count(), before);
}

// ---- autograd -------------------------------------------------------------------------------

struct TinyNet {
  at::Tensor w1, b1, w2, b2;
  explicit TinyNet(int seed) {
    at::manual_seed(seed);
    w1 = (at::randn({16, 8}) * 0.3).requires_grad_();
    b1 = at::zeros({16}).requires_grad_();
    w2 = (at::randn({4, 16}) * 0.3).requires_grad_();
    b2 = at::zeros({4}).requires_grad_();
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) const {
    auto h = at::relu(at::linear(x, w1, b1));
    return at::nll_loss(at::log_softmax(at::linear(h, w2, b2), 1), y);
  }
  void sgd_step(double lr) {
    c10::NoGradGuard no_grad;
    for (auto* p : {&w1, &b1, &w2, &b2}) {
      p->sub_(p->grad() * lr);
      p->mutable_grad().reset();
    }
  }
};

TEST_F(Casting, TrainingUnderO1MatchesFp32WithFp32Grads) {
  at::manual_seed(1);
  auto x = at::randn({32, 8});
  auto y = at::randint(0, 4, {32});
  TinyNet reference(7), mixed(7);
  for (int step = 0; step < 5; ++step) {
    reference.loss(x, y).backward();
    reference.sgd_step(0.1);
  }
  enable("O1");
  for (int step = 0; step < 5; ++step) {
    auto loss = mixed.loss(x, y);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);  // losses run in fp32
    loss.backward();
    for (auto* p : {&mixed.w1, &mixed.b1, &mixed.w2, &mixed.b2}) {
      ASSERT_EQ(p->grad().scalar_type(), at::kFloat);  // grads flow back to the fp32 params
    }
    mixed.sgd_step(0.1);
    detail::notify_weights_may_change();  // what scale_loss does after its unscale
  }
  const auto tol = testing::tolerance("train_float16");
  EXPECT_TRUE(testing::all_close(mixed.w1, reference.w1, tol));
  EXPECT_TRUE(testing::all_close(mixed.w2, reference.w2, tol));
}

TEST_F(Casting, CastsAreRecordedInTheGraph) {
  enable("O1");
  auto w = randn({3, 4}).requires_grad_();
  auto out = at::mm(randn({2, 4}), w.t());
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  ASSERT_TRUE(out.grad_fn());
  bool found_cast = false;
  std::function<void(const torch::autograd::Node*)> walk = [&](const torch::autograd::Node* n) {
    if (!n || found_cast) return;
    found_cast = n->name().find("ToCopyBackward") != std::string::npos;
    for (const auto& edge : n->next_edges()) walk(edge.function.get());
  };
  walk(out.grad_fn().get());
  EXPECT_TRUE(found_cast);
}

TEST_F(Casting, CompositeOpsCastOnceAndDoNotRecurse) {
  enable("O1");
  auto x = randn({2, 4});
  auto w = randn({3, 4});
  auto b = randn({3});
  const auto before = cast_count();
  auto out = at::linear(x, w, b);  // linear -> addmm/matmul inside: no second cast
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  EXPECT_EQ(cast_count() - before, 3);
  const auto before_einsum = cast_count();
  at::einsum("ij,kj->ik", {x, w});  // einsum -> bmm/permute inside
  EXPECT_EQ(cast_count() - before_einsum, 2);
}

// ---- off means off --------------------------------------------------------------------------

TEST_F(Casting, OffMeansBitwiseFp32) {
  auto x = randn({8, 16});
  auto w = randn({4, 16});
  auto reference = at::log_softmax(at::linear(x, w), 1);
  detail::set_level_rules(resolve("O1"));  // rules set, but this thread never turned on
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  enable("O1");
  {
    disable_casts off;
    auto out = at::log_softmax(at::linear(x, w), 1);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(out, reference));
  }
  EXPECT_EQ(at::linear(x, w).scalar_type(), at::kHalf);  // back on after the scope
  detail::set_level_rules(resolve("O0"));
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  // The enabled=false override: the thread is on, but a disabled level has no rules.
  Options disabled;
  disabled.enabled = false;
  enable("O1", disabled);
  const auto before = cast_count();
  EXPECT_TRUE(at::equal(at::log_softmax(at::linear(x, w), 1), reference));
  EXPECT_EQ(at::mm(x, w.t()).scalar_type(), at::kFloat);
  EXPECT_EQ(cast_count(), before);
}

TEST_F(Casting, ThreadsWithoutAmpSeeFp32) {
  enable("O1");
  auto a = randn({2, 3});
  auto b = randn({3, 2});
  ScalarType other_thread = ScalarType::Undefined;
  std::thread([&] { other_thread = at::mm(a, b).scalar_type(); }).join();
  EXPECT_EQ(other_thread, at::kFloat);
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);
  // The documented way to carry the state into a worker.
  const auto state = ThreadState::capture();
  ScalarType carried = ScalarType::Undefined;
  std::thread([&] {
    ThreadStateGuard guard(state);
    carried = at::mm(a, b).scalar_type();
  }).join();
  EXPECT_EQ(carried, at::kHalf);
}

// ---- gate, regions, O3 ----------------------------------------------------------------------

TEST_F(Casting, NoGradRunsInGivenDtypesUnlessInAnAutocastRegion) {
  enable("O1");
  auto a = randn({2, 3});
  auto b = randn({3, 2});
  c10::NoGradGuard no_grad;
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);  // validation stays fp32
  {
    autocast region;
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);  // explicit reduced-precision inference
    autocast bf16(true, at::kBFloat16);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

TEST_F(Casting, AutocastRegionWorksWithoutInitialize) {
  auto a = randn({2, 3});
  EXPECT_FALSE(is_casting_enabled());
  {
    autocast region(true, at::kBFloat16);
    EXPECT_TRUE(is_casting_enabled());
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kBFloat16);
    EXPECT_EQ(at::softmax(a.to(at::kBFloat16), 1).scalar_type(), at::kFloat);
    autocast off(false);
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(is_casting_enabled());
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kFloat);
  OPTAMP_EXPECT_THROW_WITH(autocast(true, at::kDouble), c10::ValueError, "torch.float64");
}

TEST_F(Casting, O3LowersAlwaysAndLeavesTheRestAlone) {
  enable("O3");
  auto a = randn({2, 3});
  {
    c10::NoGradGuard no_grad;
    EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(at::softmax(a.to(at::kHalf), 1).scalar_type(), at::kHalf);  // no fp32 list at O3
}

TEST_F(Casting, O2AppliesLowerAndLossesOnly) {
  enable("O2");
  auto h = randn({4, 3}, at::kHalf);
  EXPECT_EQ(at::mm(randn({2, 3}), randn({3, 2})).scalar_type(), at::kHalf);
  EXPECT_EQ(at::exp(h).scalar_type(), at::kHalf);  // plain fp32-list op: normal promotion
  EXPECT_EQ(at::log_softmax(h, 1).scalar_type(), at::kFloat);
  EXPECT_EQ(at::nll_loss(at::log_softmax(h, 1), at::tensor({0, 1, 2, 0}, at::kLong)).scalar_type(),
            at::kFloat);
  // binary_cross_entropy is not banned at O2: it runs as an fp32 loss.
  auto p = at::rand({4}, at::kHalf).clamp(0.1, 0.9);
  EXPECT_EQ(at::binary_cross_entropy(p, p).scalar_type(), at::kFloat);
}

// ---- written arguments, user registration ---------------------------------------------------

TEST_F(Casting, WrittenArgumentsAreNeverCast) {
  register_half_op("optamp_test::accumulate_");
  enable("O1");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp_test::accumulate_", "")
                       .typed<at::Tensor&(at::Tensor&, const at::Tensor&)>();
  auto self = at::zeros({3});
  auto other = at::full({3}, 1.00048828125);  // 1 + 2^-11: exact in fp32, rounds to 1 in fp16
  const auto before = cast_count();
  auto& result = op.call(self, other);
  EXPECT_EQ(cast_count() - before, 1);  // only `other`
  EXPECT_EQ(self.scalar_type(), at::kFloat);
  EXPECT_TRUE(result.is_same(self));
  EXPECT_TRUE(at::equal(self, at::full({3}, 1.0)));  // `other` went through fp16
}

TEST_F(Casting, UserRegisteredCustomOps) {
  enable("O1");
  auto x = randn({3});
  EXPECT_EQ(call_twice(x).scalar_type(), at::kFloat);  // no policy yet
  register_half_op("optamp_test::twice");
  EXPECT_EQ(call_twice(x).scalar_type(), at::kHalf);
  register_float_op("optamp_test::twice");  // the newest registration wins
  EXPECT_EQ(call_twice(x.to(at::kHalf)).scalar_type(), at::kFloat);
}

TEST_F(Casting, BaseNameRegistrationSkipsOutOverloads) {
  // A lowered input with an fp32 `out=` would be a dtype error in the kernel: "ns::op" covers
  // the overloads that write no argument (all of them only when every overload writes).
  register_half_op("optamp_test::twice");
  const std::string report = policy_report();
  EXPECT_NE(report.find("optamp_test::twice: lower"), std::string::npos) << report;
  EXPECT_EQ(report.find("optamp_test::twice.out"), std::string::npos) << report;
  enable("O1");
  static auto out_op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("optamp_test::twice", "out")
                           .typed<at::Tensor&(const at::Tensor&, at::Tensor&)>();
  auto out = at::empty({3});
  const auto x = at::full({3}, 1.00048828125);  // not representable in fp16
  out_op.call(x, out);
  EXPECT_TRUE(at::equal(out, x * 2)) << "the out= overload must run uncast";
  register_half_op("optamp_test::twice.out");  // named explicitly: honored
  EXPECT_NE(policy_report().find("optamp_test::twice.out: lower"), std::string::npos);
}

TEST_F(Casting, RegistrationErrorsNameTheOp) {
  OPTAMP_EXPECT_THROW_WITH(register_half_op("optamp_test::nope"), c10::ValueError,
                           "optamp_test::nope", "TORCH_LIBRARY");
  OPTAMP_EXPECT_THROW_WITH(register_float_op("twice"), c10::ValueError, "namespace::op",
                           "\"twice\"");
  OPTAMP_EXPECT_THROW_WITH(register_promote_op("aten::mm.no_such_overload"), c10::ValueError,
                           "aten::mm.no_such_overload");
}

TEST_F(Casting, PolicyReportListsEntriesAndSkippedOverloads) {
  const std::string report = policy_report();
  EXPECT_NE(report.find("aten::mm: lower"), std::string::npos);
  EXPECT_NE(report.find("aten::softmax.int: fp32 (loss)"), std::string::npos);
  EXPECT_NE(report.find("aten::cat: promote"), std::string::npos);
  EXPECT_NE(report.find("aten::binary_cross_entropy: banned"), std::string::npos);
  EXPECT_NE(report.find("skipped (not in this LibTorch)"), std::string::npos);
}

TEST_F(Casting, EveryTableEntryIsRegisteredOnThisLibTorch) {
  // Drift guard: an op renamed or removed by a LibTorch upgrade would silently lose its policy
  // (it lands in "skipped"); this fails instead, naming the entry.
  const std::string report = policy_report();
  for (const auto& entry : detail::builtin_table()) {
    std::string name = entry.name;
    if (*entry.overload != '\0') name += std::string(".") + entry.overload;
    const std::string line = "  " + name + ": " + to_string(entry.policy) + "\n";
    EXPECT_NE(report.find(line), std::string::npos)
        << name << " is in the policy table but not registered with its category; report:\n"
        << report;
  }
  EXPECT_NE(report.find("skipped (not in this LibTorch): 0\n"), std::string::npos) << report;
}

// ---- coexistence with native autocast --------------------------------------------------------

TEST_F(Casting, NativeAutocastOwnsTheCallWhenEnabled) {
  enable("O1");  // optamp would pick fp16
  auto a = randn({2, 3});
  const bool was = at::autocast::is_autocast_enabled(at::kCPU);
  at::autocast::set_autocast_enabled(at::kCPU, true);  // native CPU autocast: bf16
  const auto before = cast_count();
  const auto dtype = at::mm(a, a.t()).scalar_type();
  at::autocast::set_autocast_enabled(at::kCPU, was);
  at::autocast::clear_cache();
  EXPECT_EQ(dtype, at::autocast::get_autocast_dtype(at::kCPU));
  EXPECT_EQ(cast_count(), before);  // optamp deferred
  EXPECT_EQ(at::mm(a, a.t()).scalar_type(), at::kHalf);
}

// ---- verbosity ------------------------------------------------------------------------------

TEST_F(Casting, Verbosity2LogsEachDistinctCastOnce) {
  Options o;
  o.verbosity = 2;
  enable("O1", o);
  ::testing::internal::CaptureStderr();
  auto a = randn({2, 3});
  at::mm(a, a.t());
  at::mm(a, a.t());
  const std::string log = ::testing::internal::GetCapturedStderr();
  const std::string line = "Float->Half aten::mm";
  ASSERT_NE(log.find(line), std::string::npos) << log;
  EXPECT_EQ(log.find(line), log.rfind(line)) << "logged more than once:\n" << log;
}

// ---- the cast cache -------------------------------------------------------------------------

TEST_F(Casting, CacheCastsEachWeightOncePerVersion) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto before = cast_count();
  at::mm(randn({2, 3}), w.t());
  at::mm(randn({2, 3}), w.t());  // t() is a view: a new TensorImpl, not cached, cast again
  EXPECT_EQ(cast_count() - before, 4);
  before = cast_count();
  at::linear(randn({2, 3}), w);
  at::linear(randn({2, 3}), w);
  at::linear(randn({2, 3}), w);
  EXPECT_EQ(cast_count() - before, 1 + 3);  // w once, each input once
  EXPECT_EQ(cache_size(), 1u);
}

TEST_F(Casting, CacheRefreshesAfterInPlaceUpdates) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  auto first = at::linear(x, w);
  {
    c10::NoGradGuard no_grad;
    w.add_(1.0);  // bumps the version counter
  }
  auto second = at::linear(x, w);
  auto expected = at::linear(x.to(at::kHalf), w.detach().to(at::kHalf));
  EXPECT_TRUE(at::equal(second, expected));
  EXPECT_FALSE(at::equal(first, second));
  // Through .data() (LibTorch's optimizers): no version bump, so the step-boundary event.
  w.data().mul_(2.0);
  detail::notify_weights_may_change();
  EXPECT_EQ(cache_size(), 0u);
  auto third = at::linear(x, w);
  EXPECT_TRUE(at::equal(third, at::linear(x.to(at::kHalf), w.detach().to(at::kHalf))));
}

TEST_F(Casting, CacheSeparatesNoGradFromGradEntries) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    c10::NoGradGuard no_grad;
    autocast region;
    auto out = at::linear(x, w);
    EXPECT_FALSE(out.requires_grad());
    EXPECT_EQ(cache_size(), 1u);
  }
  EXPECT_EQ(cache_size(), 0u);  // leaving the outermost region dropped the entry
  {
    c10::NoGradGuard no_grad;
    autocast outer;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
    c10::GradMode::set_enabled(true);
    auto out = at::linear(x, w);  // must not reuse the history-free no_grad copy
    c10::GradMode::set_enabled(false);
    EXPECT_TRUE(out.requires_grad());
    EXPECT_EQ(cache_size(), 2u);
  }
  EXPECT_EQ(cache_size(), 0u);
}

TEST_F(Casting, CacheIsDroppedAtTheOutermostAutocastExitOnly) {
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    autocast outer;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
    {
      autocast inner(true, at::kBFloat16);
      at::linear(x, w);
      EXPECT_EQ(cache_size(), 2u);  // a bf16 copy next to the fp16 one
    }
    EXPECT_EQ(cache_size(), 2u) << "an inner exit must keep the entries";
    { autocast off(false); }
    { disable_casts no_casts; }
    EXPECT_EQ(cache_size(), 2u);
    at::linear(x, w);  // still served from the cache
    EXPECT_EQ(cache_size(), 2u);
  }
  EXPECT_EQ(cache_size(), 0u) << "the outermost exit must drop every entry";
  // The same when the thread is on through the level: entries made outside any region are
  // dropped by the region's exit too.
  enable("O1");
  at::linear(x, w);
  EXPECT_EQ(cache_size(), 1u);
  {
    autocast region;
    at::linear(x, w);
    EXPECT_EQ(cache_size(), 1u);
  }
  EXPECT_EQ(cache_size(), 0u);
}

TEST_F(Casting, CopiesMadeInsideKernelsAreNotServedToAutograd) {
  enable("O1");
  auto w = randn({4, 3}).requires_grad_();
  auto x = randn({2, 3});
  {
    // What a kernel's inner calls see: GradMode on, autograd keys excluded.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::linear(x, w);
  }
  auto out = at::linear(x, w);
  ASSERT_TRUE(out.requires_grad());
  out.sum().backward();
  EXPECT_TRUE(w.grad().defined());
}

TEST_F(Casting, CacheStaysBoundedOverManyIterations) {
  enable("O1");
  auto x = randn({2, 3});
  auto kept = randn({4, 3}).requires_grad_();  // a live parameter reused every iteration
  std::size_t peak = 0;
  const auto casts_before = cast_count();
  for (int i = 0; i < 1000; ++i) {
    auto w = randn({4, 3}).requires_grad_();  // a fresh parameter each iteration, then dropped
    at::linear(x, w);
    at::linear(x, kept);
    peak = std::max(peak, cache_size());
  }
  EXPECT_LE(peak, 200u);
  // Per iteration: x twice (not cacheable) and the fresh w; `kept` stays cached across sweeps.
  EXPECT_LE(cast_count() - casts_before, 3 * 1000 + 5);
}

TEST_F(Casting, RealOptimizerStepIsSeenByTheNextForward) {
  // torch::optim::SGD updates through p.data(), which does not bump the version counter (Adam
  // in LibTorch 2.11 does bump it): the step-boundary event (raised by scale_loss after its
  // unscale) must drop the stale copy.
  enable("O1");
  auto x = randn({2, 3});
  auto w_sgd = randn({4, 3}).requires_grad_();
  auto w_adam = randn({4, 3}).requires_grad_();
  torch::optim::SGD sgd({w_sgd}, torch::optim::SGDOptions(0.5).momentum(0.9));
  torch::optim::Adam adam({w_adam}, torch::optim::AdamOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    (at::linear(x, w_sgd).to(at::kFloat).sum() + at::linear(x, w_adam).to(at::kFloat).sum())
        .backward();
    sgd.step();
    adam.step();
    sgd.zero_grad();
    adam.zero_grad();
    detail::notify_weights_may_change();
    for (const auto& w : {w_sgd, w_adam}) {
      EXPECT_TRUE(
          at::equal(at::linear(x, w), at::linear(x.to(at::kHalf), w.detach().to(at::kHalf))))
          << "stale working copy after step " << step;
    }
  }
}

// The same through the public loop: amp::initialize at O1, forward, the real scale_loss guard,
// the unchanged optimizer.step(); the next forward must see the stepped weights. (With SGD the
// version counter does not move, so without the guard's drop the copy would be served stale;
// checked once by refilling the cache between the guard and the step.)
struct OneWeight : torch::nn::Module {
  at::Tensor w;
  OneWeight() { w = register_parameter("w", at::randn({4, 3})); }
};

class CastingInitialized : public Casting {
 protected:
  void TearDown() override {
    reset();
    Casting::TearDown();
  }
  static Options quiet() {
    Options o;
    o.verbosity = 0;
    return o;
  }
};

TEST_F(CastingInitialized, ScaleLossGuardMakesRealOptimizerStepsVisible) {
  for (const bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "Adam" : "SGD");
    at::manual_seed(3);
    auto model = std::make_shared<OneWeight>();
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (adam) {
      optimizer =
          std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.1));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                      torch::optim::SGDOptions(0.5).momentum(0.9));
    }
    initialize(model, *optimizer, "O1", quiet());
    const at::Tensor& w = model->w;
    const auto x = randn({2, 3});
    auto fresh = [&] { return at::linear(x.to(at::kHalf), w.detach().to(at::kHalf)); };
    for (int step = 0; step < 4; ++step) {
      optimizer->zero_grad();
      const auto out = at::linear(x, w);
      ASSERT_EQ(out.scalar_type(), at::kHalf);
      EXPECT_TRUE(at::equal(out, fresh())) << "stale working copy at step " << step;
      EXPECT_EQ(cache_size(), 1u);
      {
        auto scaled = scale_loss(out.to(at::kFloat).pow(2).mean(), *optimizer);
        scaled.backward();
      }
      EXPECT_EQ(cache_size(), 0u) << "the guard's exit must drop the cached copy";
      const auto before = w.detach().clone();
      optimizer->step();
      ASSERT_FALSE(at::equal(w.detach(), before)) << "the step did not change the weight";
    }
    EXPECT_TRUE(at::equal(at::linear(x, w), fresh()));
    reset();
  }
}

TEST_F(CastingInitialized, EnabledFalseIsBitwiseFp32AtEveryLevel) {
  const auto x = randn({8, 3});
  for (const char* level : {"O1", "O2", "O3", "O4", "O5"}) {
    SCOPED_TRACE(level);
    auto model = std::make_shared<OneWeight>();
    const auto reference = at::log_softmax(at::linear(x, model->w), 1);
    Options o = quiet();
    o.enabled = false;
    const Handle handle = initialize(model, level, o);
    EXPECT_FALSE(handle.properties().enabled);
    EXPECT_FALSE(is_casting_enabled());
    EXPECT_EQ(model->w.scalar_type(), at::kFloat);  // O3 does not cast the model either
    const auto before = cast_count();
    const auto out = at::log_softmax(at::linear(x, model->w), 1);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(out, reference));
    EXPECT_EQ((model->w * 2).scalar_type(), at::kFloat);  // no O2/O5 working copy
    EXPECT_EQ(cast_count(), before);
    reset();
  }
}

// ---- Apex's fp32 Python functions without an aten op of their own ---------------------------

TEST_F(Casting, LocalResponseNormRunsInFp32) {
  // local_response_norm squares its input, pools the squares (avg_pool2d for 3-D input,
  // avg_pool3d otherwise), then pow and a division. avg_pool3d is in the fp32 list (CPU has no
  // fp16/bf16 kernel for it); pow is, and the final division promotes, so every rank ends fp32.
  namespace F = torch::nn::functional;
  enable("O1");
  const auto options = F::LocalResponseNormFuncOptions(3);
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{2, 4, 5}, {2, 4, 3, 3}, {1, 4, 2, 3, 3}}) {
    SCOPED_TRACE(shape.size());
    for (const ScalarType low : {at::kHalf, at::kBFloat16}) {
      SCOPED_TRACE(c10::toString(low));
      const auto x = (at::rand(shape) + 0.5).to(low);
      const auto reference = [&] {
        disable_casts off;
        return F::local_response_norm(x.to(at::kFloat), options);
      }();
      const auto out = F::local_response_norm(x, options);
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_TRUE(testing::all_close(out, reference, testing::tolerance(low)));
    }
  }
}

// An fp32-list op given a result dtype runs as called: casting its inputs to fp32 would make
// linalg_vector_norm / norm refuse the narrowing back to the dtype the caller asked for.
TEST_F(Casting, AnExplicitResultDtypeIsLeftAlone) {
  enable("O1");
  const auto h = randn({2, 3}, at::kHalf);
  const auto before = cast_count();
  EXPECT_EQ(at::sum(h, at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(cast_count(), before) << "nothing cast for a call that names its result dtype";
  EXPECT_EQ(at::sum(h).scalar_type(), at::kFloat) << "without a dtype: fp32";
  EXPECT_EQ(at::linalg_vector_norm(h, 2, std::nullopt, false, at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(at::norm(h, std::optional<at::Scalar>(2), at::kHalf).scalar_type(), at::kHalf);
  EXPECT_EQ(
      at::norm(h, std::optional<at::Scalar>(2), at::IntArrayRef{1}, false, at::kHalf).scalar_type(),
      at::kHalf);
}

}  // namespace
}  // namespace amp
