#pragma once
// Registers one backend's group kernels for the three multi-tensor ops. The CPU and CUDA files
// differ only in their dispatch key and kernels, so the glue (schema-shaped lambdas that call the
// shared op bodies) lives here once. Kernels are template arguments, not captures, because
// torch::Library::impl takes stateless functors.

#include <torch/library.h>

#include "ops/multi_tensor.h"

namespace amp::ops::detail {

template <UnscaleGroupKernel Unscale, AxpbyGroupKernel Axpby, UpdateScaleKernel UpdateScale>
void register_multi_tensor_kernels(torch::Library& m) {
  m.impl("unscale_check_", [](at::TensorList t, const at::Tensor& f, const at::Tensor& s) {
    unscale_check_impl(t, f, s, Unscale);
  });
  m.impl("axpby_check_",
         [](at::TensorList o, at::TensorList x, at::TensorList y, const at::Tensor& a, double b,
            const at::Tensor& f) { axpby_check_impl(o, x, y, a, b, f, Axpby); });
  m.impl("update_scale_",
         [](const at::Tensor& s, const at::Tensor& g, const at::Tensor& h, const at::Tensor& f,
            double gf, double bf, int64_t gi, int64_t hy, double mn,
            double mx) { update_scale_impl(s, g, h, f, gf, bf, gi, hy, mn, mx, UpdateScale); });
}

}  // namespace amp::ops::detail
