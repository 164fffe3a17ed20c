// The optamp op schema (one TORCH_LIBRARY for every backend) and the device-independent half
// of the multi-tensor ops: argument validation, dtype grouping and dense copies. Backends
// (cpu/, cuda/) register thin TORCH_LIBRARY_IMPL wrappers that pass their group kernels here.
#include "ops/multi_tensor.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <map>

namespace amp::ops {
namespace detail {
namespace {

bool supported_dtype(at::ScalarType t) {
  for (const at::ScalarType k : {OPTAMP_KERNEL_DTYPES}) {
    if (t == k) return true;
  }
  return t == at::kDouble;
}

// float64 tensors (a parameter kept in double, which native autocast leaves alone) are unscaled
// in their own precision by torch's GradScaler op, on every device: the backend kernels compute
// in fp32, and a vector kernel of their own would serve a dtype few models train. The same flag,
// the same no-sync contract (torch's op writes found_inf on the device).
void unscale_check_double(const std::vector<at::Tensor>& tensors, const at::Tensor& found_inf,
                          const at::Tensor& inv_scale) {
  at::Tensor flag = found_inf;  // the same tensor: torch's signature takes a non-const handle
  at::_amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale);
}

// out = a*x + b*y in float64, checked on the result alone: a non-finite x makes a non-finite
// result for any finite a and b (a*inf is inf or NaN), so the x check of the fp32 kernels adds
// nothing here. Computed aside, since out may be x or y.
void axpby_check_double(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& x,
                        const std::vector<at::Tensor>& y, const at::Tensor& a, double b,
                        const at::Tensor& found_inf) {
  auto sums = at::_foreach_mul(x, a.reshape({}));
  at::_foreach_add_(sums, y, b);
  unscale_check_double(sums, found_inf, at::ones_like(found_inf));
  at::_foreach_copy_(out, sums);
}

void check_flag(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a defined tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.numel() == 1, name,
                    " must be a one-element float32 tensor, got ", t.scalar_type(), " with ",
                    t.numel(), " elements");
  if (ref.defined()) {
    TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on ", ref.device(),
                      " (found_inf's device), got ", t.device());
  }
}

void check_list_tensor(const at::Tensor& t, const char* list, size_t i,
                       const at::Tensor& found_inf) {
  TORCH_CHECK_VALUE(t.defined(), list, "[", i, "] must be a defined tensor, got undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, list, "[", i, "] must be a strided tensor, got ",
                    t.layout());
  TORCH_CHECK_VALUE(supported_dtype(t.scalar_type()), list, "[", i,
                    "] must be float32, float16, bfloat16 or float64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == found_inf.device(), list, "[", i, "] must be on ",
                    found_inf.device(), " (found_inf's device; group tensors by device), got ",
                    t.device());
}

// A non-contiguous tensor's contiguous stand-in: the kernels write `work`, which is copied back
// into `original` afterwards.
struct Work {
  at::Tensor work;
  at::Tensor original;
};

}  // namespace

void unscale_check_impl(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale, UnscaleGroupKernel kernel) {
  check_flag(found_inf, "found_inf", at::Tensor());
  check_flag(inv_scale, "inv_scale", found_inf);
  for (size_t i = 0; i < tensors.size(); ++i)
    check_list_tensor(tensors[i], "tensors", i, found_inf);

  std::map<at::ScalarType, std::vector<at::Tensor>> groups;
  std::vector<Work> copies;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    if (t.is_non_overlapping_and_dense()) {
      groups[t.scalar_type()].push_back(t);
    } else {
      copies.push_back({t.contiguous(), t});
      groups[t.scalar_type()].push_back(copies.back().work);
    }
  }
  for (const auto& [dtype, group] : groups) {
    if (dtype == at::kDouble) {
      unscale_check_double(group, found_inf, inv_scale);
    } else {
      kernel(group, found_inf, inv_scale);
    }
  }
  for (auto& c : copies) c.original.copy_(c.work);
}

void axpby_check_impl(at::TensorList out, at::TensorList x, at::TensorList y, const at::Tensor& a,
                      double b, const at::Tensor& found_inf, AxpbyGroupKernel kernel) {
  check_flag(found_inf, "found_inf", at::Tensor());
  check_flag(a, "a", found_inf);
  TORCH_CHECK_VALUE(out.size() == x.size() && out.size() == y.size(),
                    "out, x and y must have the same length, got ", out.size(), ", ", x.size(),
                    " and ", y.size());
  for (size_t i = 0; i < out.size(); ++i) {
    check_list_tensor(out[i], "out", i, found_inf);
    check_list_tensor(x[i], "x", i, found_inf);
    check_list_tensor(y[i], "y", i, found_inf);
    TORCH_CHECK_VALUE(
        x[i].scalar_type() == out[i].scalar_type() && y[i].scalar_type() == out[i].scalar_type(),
        "out[", i, "], x[", i, "] and y[", i, "] must have the same dtype, got ",
        out[i].scalar_type(), ", ", x[i].scalar_type(), " and ", y[i].scalar_type());
    TORCH_CHECK_VALUE(x[i].sizes() == out[i].sizes() && y[i].sizes() == out[i].sizes(), "out[", i,
                      "], x[", i, "] and y[", i, "] must have the same shape, got ", out[i].sizes(),
                      ", ", x[i].sizes(), " and ", y[i].sizes());
  }
  struct Group {
    std::vector<at::Tensor> out, x, y;
  };
  std::map<at::ScalarType, Group> groups;
  std::vector<Work> copies;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].numel() == 0) continue;
    auto& g = groups[out[i].scalar_type()];
    const bool flat = out[i].is_non_overlapping_and_dense() && x[i].strides() == out[i].strides() &&
                      y[i].strides() == out[i].strides();
    if (flat) {
      g.out.push_back(out[i]);
      g.x.push_back(x[i]);
      g.y.push_back(y[i]);
    } else {
      copies.push_back({at::empty(out[i].sizes(), out[i].options()), out[i]});
      g.out.push_back(copies.back().work);
      g.x.push_back(x[i].contiguous());
      g.y.push_back(y[i].contiguous());
    }
  }
  for (const auto& [dtype, g] : groups) {
    if (dtype == at::kDouble) {
      axpby_check_double(g.out, g.x, g.y, a, b, found_inf);
    } else {
      kernel(g.out, g.x, g.y, a, static_cast<float>(b), found_inf);
    }
  }
  for (auto& c : copies) c.original.copy_(c.work);
}

void update_scale_impl(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale,
                       UpdateScaleKernel kernel) {
  check_flag(found_inf, "found_inf", at::Tensor());
  check_flag(scale, "scale", found_inf);
  for (const auto* t : {&growth_tracker, &hysteresis_tracker}) {
    const char* name = t == &growth_tracker ? "growth_tracker" : "hysteresis_tracker";
    TORCH_CHECK_VALUE(t->defined() && t->scalar_type() == at::kInt && t->numel() == 1, name,
                      " must be a one-element int32 tensor, got ",
                      t->defined() ? c10::toString(t->scalar_type()) : "undefined");
    TORCH_CHECK_VALUE(t->device() == found_inf.device(), name, " must be on ", found_inf.device(),
                      ", got ", t->device());
  }
  TORCH_CHECK_VALUE(growth_interval > 0, "growth_interval must be positive, got ", growth_interval);
  TORCH_CHECK_VALUE(hysteresis > 0, "hysteresis must be positive, got ", hysteresis);
  TORCH_CHECK_VALUE(min_scale <= max_scale, "min_scale must be <= max_scale, got ", min_scale,
                    " > ", max_scale);
  TORCH_CHECK(
      scale.is_contiguous() && growth_tracker.is_contiguous() && hysteresis_tracker.is_contiguous(),
      "scale and trackers must be contiguous");
  kernel(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
         growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace detail

void unscale_check_(at::TensorList tensors, const at::Tensor& found_inf,
                    const at::Tensor& inv_scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp::unscale_check_", "")
                       .typed<void(at::TensorList, const at::Tensor&, const at::Tensor&)>();
  op.call(tensors, found_inf, inv_scale);
}

void axpby_check_(at::TensorList out, at::TensorList x, at::TensorList y, const at::Tensor& a,
                  double b, const at::Tensor& found_inf) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("optamp::axpby_check_", "")
                       .typed<void(at::TensorList, at::TensorList, at::TensorList,
                                   const at::Tensor&, double, const at::Tensor&)>();
  op.call(out, x, y, a, b, found_inf);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("optamp::update_scale_", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      double, double, int64_t, int64_t, double, double)>();
  op.call(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
          growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace amp::ops

TORCH_LIBRARY(optamp, m) {
  m.def("unscale_check_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  m.def(
      "axpby_check_(Tensor(a!)[] out, Tensor[] x, Tensor[] y, Tensor a, float b, "
      "Tensor(b!) found_inf) -> ()");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");
}
