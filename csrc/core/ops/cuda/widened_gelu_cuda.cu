// CUDA kernels of optamp::widened_gelu and its backward (ops/widened_gelu.h): one elementwise
// pass each, through TensorIterator (any layout; 32-bit indexing split by gpu_kernel). The math
// is ops/gelu_math.h's, in fp32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/native/cuda/Loops.cuh>

#include <tuple>

#include "ops/gelu_math.h"

namespace amp::ops::detail {
namespace {

bool tanh_approximation(c10::string_view approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh",
                    "approximate must be 'none' or 'tanh', got '", approximate, "'");
  return approximate == "tanh";
}

std::tuple<at::Tensor, at::Tensor> widened_gelu_cuda(const at::Tensor& self,
                                                     c10::string_view approximate) {
  const bool tanh = tanh_approximation(approximate);
  const c10::cuda::CUDAGuard device_guard(self.device());  // launches go to the current device
  at::Tensor wide = at::empty_like(self, self.options().dtype(at::kFloat));
  at::Tensor narrow = at::empty_like(self);
  auto iter = at::TensorIteratorConfig()
                  .add_output(wide)
                  .add_output(narrow)
                  .add_const_input(self)
                  .check_all_same_dtype(false)
                  .build();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(self.scalar_type(), "widened_gelu", [&] {
    at::native::gpu_kernel_multiple_outputs(
        iter, [tanh] GPU_LAMBDA(scalar_t v) -> thrust::tuple<float, scalar_t> {
          const float y = gelu_forward_math(static_cast<float>(v), tanh);
          return {y, static_cast<scalar_t>(y)};
        });
  });
  return {wide, narrow};
}

// `grad` is the gradient of the fp32 result (float) or of its reduced copy (self's dtype).
at::Tensor widened_gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& self,
                                      c10::string_view approximate) {
  const bool tanh = tanh_approximation(approximate);
  TORCH_CHECK_VALUE(grad.scalar_type() == at::kFloat || grad.scalar_type() == self.scalar_type(),
                    "grad must be float32 or ", self.scalar_type(), ", got ", grad.scalar_type());
  const c10::cuda::CUDAGuard device_guard(self.device());
  at::Tensor input_grad = at::empty_like(self);
  auto iter = at::TensorIteratorConfig()
                  .add_output(input_grad)
                  .add_const_input(grad)
                  .add_const_input(self)
                  .check_all_same_dtype(false)
                  .build();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(self.scalar_type(), "widened_gelu_backward", [&] {
    if (grad.scalar_type() == at::kFloat) {
      at::native::gpu_kernel(iter, [tanh] GPU_LAMBDA(float g, scalar_t v) -> scalar_t {
        return static_cast<scalar_t>(gelu_backward_math(g, static_cast<float>(v), tanh));
      });
    } else {
      at::native::gpu_kernel(iter, [tanh] GPU_LAMBDA(scalar_t g, scalar_t v) -> scalar_t {
        return static_cast<scalar_t>(
            gelu_backward_math(static_cast<float>(g), static_cast<float>(v), tanh));
      });
    }
  });
  return input_grad;
}

}  // namespace
}  // namespace amp::ops::detail

TORCH_LIBRARY_IMPL(optamp, CUDA, m) {
  m.impl("widened_gelu", &amp::ops::detail::widened_gelu_cuda);
  m.impl("widened_gelu_backward", &amp::ops::detail::widened_gelu_backward_cuda);
}
