// Tensor handles for driving the C ABI (optamp/c_api.h) from Python through ctypes, as a foreign
// binding would (tests/python/test_c_api.py): a Python tensor as a heap at::Tensor* and back,
// and the path of the liboptamp this module uses, for ctypes.CDLL.
#include <torch/csrc/utils/pybind.h>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

#include <cstdint>
#include <string>

#include "common.h"
#include "optamp/c_api.h"

namespace amp::python {
namespace {

at::Tensor* from_handle(std::uintptr_t handle) {
  TORCH_CHECK_VALUE(handle != 0, "handle must be a tensor handle from _tensor_handle, got 0");
  return reinterpret_cast<at::Tensor*>(handle);
}

}  // namespace

void bind_c_handles(py::module_& m) {
  m.def(
      "_tensor_handle",
      [](const at::Tensor& tensor) {
        return reinterpret_cast<std::uintptr_t>(new at::Tensor(tensor));
      },
      py::arg("tensor"),
      "A new heap at::Tensor sharing `tensor` (an optamp_tensor* of the C API), as an int; free "
      "it with _free_tensor_handle.");
  m.def(
      "_tensor_from_handle", [](std::uintptr_t handle) { return *from_handle(handle); },
      py::arg("handle"), "The tensor an at::Tensor* (optamp_tensor*) holds, shared.");
  m.def(
      "_free_tensor_handle",
      [](std::uintptr_t handle) { delete reinterpret_cast<at::Tensor*>(handle); },
      py::arg("handle"), "Deletes an at::Tensor* of _tensor_handle (0 is a no-op).");
  m.def(
      "_library_path",
      []() -> std::string {
#if defined(__unix__) || defined(__APPLE__)
        Dl_info info{};
        if (dladdr(reinterpret_cast<void*>(&optamp_abi_version), &info) != 0 &&
            info.dli_fname != nullptr) {
          return info.dli_fname;
        }
#endif
        return "";
      },
      "The path of the liboptamp this module is linked against (\"\" where unknown).");
}

}  // namespace amp::python
