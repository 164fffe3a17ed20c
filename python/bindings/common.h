#pragma once
// Shared helpers for the binding translation units.
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

#include "optamp/opt_level.h"

namespace amp::python {

namespace py = pybind11;

// torch.dtype or None -> ScalarType (None -> Undefined). Raises TypeError naming `arg`.
c10::ScalarType dtype_from_py(const py::handle& obj, const char* arg);
// ScalarType -> torch.dtype, Undefined -> None.
py::object dtype_to_py(c10::ScalarType type);

// Python keyword overrides (Apex names) -> Options; None = not overridden. TypeError for an
// unknown keyword or a wrong type.
Options options_from_kwargs(const py::kwargs& kwargs);
// "O1" or optamp.OptLevel -> OptLevel (ValueError listing the levels, TypeError otherwise).
OptLevel level_from_py(const py::handle& level);

void bind_opt_level(py::module_& m);
void bind_scaler(py::module_& m);
void bind_frontend(py::module_& m);
void bind_precision(py::module_& m);
void bind_c_handles(py::module_& m);

}  // namespace amp::python
