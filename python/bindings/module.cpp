// optamp._C module definition and the C++ -> Python exception mapping.
#include <c10/util/Exception.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>

#include "common.h"

namespace amp::python {

c10::ScalarType dtype_from_py(const py::handle& obj, const char* arg) {
  if (obj.is_none()) return c10::ScalarType::Undefined;
  if (THPDtype_Check(obj.ptr())) return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
  throw py::type_error(std::string(arg) + " must be a torch.dtype or None, got " +
                       std::string(py::str(py::type::of(obj).attr("__name__"))));
}

py::object dtype_to_py(c10::ScalarType type) {
  if (type == c10::ScalarType::Undefined) return py::none();
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(type)));
}

namespace {

// c10's typed errors become the Python exception a user expects, with the C++ message minus
// the C++ backtrace.
void translate_c10_errors(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

}  // namespace
}  // namespace amp::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "optamp compiled core";
  pybind11::register_local_exception_translator(&amp::python::translate_c10_errors);
  amp::python::bind_opt_level(m);
  amp::python::bind_scaler(m);
  amp::python::bind_frontend(m);
  amp::python::bind_precision(m);
  amp::python::bind_c_handles(m);
}
