#pragma once
// Shared helpers for the binding translation units.
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

namespace amp::python {

namespace py = pybind11;

// torch.dtype or None -> ScalarType (None -> Undefined). Raises TypeError naming `arg`.
c10::ScalarType dtype_from_py(const py::handle& obj, const char* arg);
// ScalarType -> torch.dtype, Undefined -> None.
py::object dtype_to_py(c10::ScalarType type);

void bind_opt_level(py::module_& m);
void bind_scaler(py::module_& m);

}  // namespace amp::python
