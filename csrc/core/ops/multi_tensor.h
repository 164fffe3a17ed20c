#pragma once
// The optamp multi-tensor ops (schema in multi_tensor.cpp, kernels in cpu/ and cuda/).
//
//   optamp::unscale_check_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale) -> ()
//       t *= inv_scale for every t, in place; found_inf := 1.0 if any input element is inf/NaN.
//   optamp::axpby_check_(Tensor(a!)[] out, Tensor[] x, Tensor[] y, Tensor a, float b,
//                        Tensor(b!) found_inf) -> ()
//       out = a*x + b*y (math in fp32, in float64 for float64); found_inf := 1.0 if any x or result
//       element is inf/NaN. out[i] may be x[i] or y[i] (elementwise, same layout).
//   optamp::update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker,
//                         Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor,
//                         float backoff_factor, int growth_interval, int hysteresis,
//                         float min_scale, float max_scale) -> ()
//       the dynamic loss-scale update, on the device (no sync).
//
// found_inf is never reset to 0 by the ops (as torch._amp_foreach_non_finite_check_and_unscale_),
// so one flag can accumulate several calls. All tensors of one call live on found_inf's device;
// callers group by device. Dtypes float32/float16/bfloat16/float64 may be mixed within a list (the
// ops group them; float64 groups run torch's own ops, in float64); tensors that are not dense are
// processed through a contiguous copy.
//
// The device-independent half (validation, dtype grouping, dense copies) is here and in
// multi_tensor.cpp; a backend provides only the per-group kernels below.

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp::ops {

// Calls through the dispatcher (the entry points C++ code uses).
void unscale_check_(at::TensorList tensors, const at::Tensor& found_inf,
                    const at::Tensor& inv_scale);
void axpby_check_(at::TensorList out, at::TensorList x, at::TensorList y, const at::Tensor& a,
                  double b, const at::Tensor& found_inf);
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale);

namespace detail {

// The dtypes the kernels are built for (the AT_DISPATCH_V2 list of every backend kernel); the
// shared op bodies reject any other dtype, with a ValueError, before a kernel runs.
#define OPTAMP_KERNEL_DTYPES at::kFloat, at::kHalf, at::kBFloat16

// Backend kernels: every tensor of a call has the same dtype, device and is dense; out/x/y of
// axpby share their strides. found_inf / inv_scale / a are one-element float32 tensors.
using UnscaleGroupKernel = void (*)(const std::vector<at::Tensor>& tensors,
                                    const at::Tensor& found_inf, const at::Tensor& inv_scale);
using AxpbyGroupKernel = void (*)(const std::vector<at::Tensor>& out,
                                  const std::vector<at::Tensor>& x,
                                  const std::vector<at::Tensor>& y, const at::Tensor& a, float b,
                                  const at::Tensor& found_inf);
using UpdateScaleKernel = void (*)(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis, double min_scale, double max_scale);

// Shared op bodies: validate, group by dtype, route non-dense tensors through copies.
void unscale_check_impl(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale, UnscaleGroupKernel kernel);
void axpby_check_impl(at::TensorList out, at::TensorList x, at::TensorList y, const at::Tensor& a,
                      double b, const at::Tensor& found_inf, AxpbyGroupKernel kernel);
void update_scale_impl(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale,
                       UpdateScaleKernel kernel);

}  // namespace detail
}  // namespace amp::ops
