// Bindings for opt levels and properties (optamp.OptLevel, optamp.Properties, optamp._C.resolve).
#include "optamp/opt_level.h"

#include <pybind11/stl.h>

#include <limits>
#include <optional>
#include <string>

#include "common.h"

namespace amp::python {
namespace {

std::string type_name(const py::handle& value) {
  return py::str(py::type::of(value).attr("__name__"));
}

// operator.index(value) for ints and integer-like objects (numpy integers), nullopt otherwise.
std::optional<long long> as_index(const py::handle& value, const char* name) {
  if (!PyIndex_Check(value.ptr())) return std::nullopt;
  int overflow = 0;
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) {
    throw py::value_error(std::string(name) +
                          " must be an int within the range of a C++ int, got " +
                          std::string(py::str(value)));
  }
  return v;
}

// The flags take what Apex's scripts pass: bools, the strings "True"/"False" (Apex's
// keep_batchnorm_fp32 spelling, e.g. from argparse), the ints 0/1 and numpy booleans.
bool bool_from_py(const py::handle& value, const char* name) {
  const std::string expected =
      std::string(name) + " must be True, False, \"True\", \"False\", 1 or 0, got ";
  if (py::isinstance<py::bool_>(value)) return value.cast<bool>();
  if (py::isinstance<py::str>(value)) {
    const auto text = value.cast<std::string>();
    if (text == "True") return true;
    if (text == "False") return false;
    throw py::value_error(expected + "\"" + text + "\"");
  }
  if (py::hasattr(value, "dtype") && py::hasattr(value, "ndim") &&
      py::str(value.attr("dtype").attr("kind")).cast<std::string>() == "b" &&
      value.attr("ndim").cast<int>() == 0) {
    return PyObject_IsTrue(value.ptr()) == 1;  // numpy.bool_
  }
  if (auto v = as_index(value, name)) {
    if (*v == 0 || *v == 1) return *v == 1;
    throw py::value_error(expected + std::to_string(*v));
  }
  throw py::type_error(expected + "a " + type_name(value));
}

// Integers: Python ints and integer-like objects (numpy integers, and bool, which Python counts
// as an int: Apex's verbosity=False).
template <typename T>
T int_from_py(const py::handle& value, const char* name) {
  const auto v = as_index(value, name);
  if (!v) throw py::type_error(std::string(name) + " must be an int, got " + type_name(value));
  if (*v < std::numeric_limits<T>::min() || *v > std::numeric_limits<T>::max()) {
    throw py::value_error(std::string(name) + " must be an int within [" +
                          std::to_string(std::numeric_limits<T>::min()) + ", " +
                          std::to_string(std::numeric_limits<T>::max()) + "], got " +
                          std::string(py::str(value)));
  }
  return static_cast<T>(*v);
}

// Real numbers: anything float() takes except text and bools (numpy scalars, a 0-dim tensor, as
// Apex's float(loss_scale) took them). A bool here is a mistake, not a scale.
double float_from_py(const py::handle& value, const char* name) {
  if (py::isinstance<py::bool_>(value) || py::isinstance<py::str>(value) ||
      !(PyFloat_Check(value.ptr()) || PyIndex_Check(value.ptr()) ||
        Py_TYPE(value.ptr())->tp_as_number != nullptr)) {
    throw py::type_error(std::string(name) + " must be a number, got " + type_name(value));
  }
  py::object number = py::reinterpret_steal<py::object>(PyNumber_Float(value.ptr()));
  if (!number) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be a number, got " + type_name(value) + " (" +
                         std::string(py::str(value)) + ")");
  }
  return PyFloat_AsDouble(number.ptr());
}

// "dynamic", a number, or a string float() reads ("128.0", Apex's documented spelling).
LossScale loss_scale_from_py(const py::handle& value) {
  if (py::isinstance<py::str>(value)) return LossScale(value.cast<std::string>());
  return LossScale::fixed(float_from_py(value, "loss_scale"));
}

// cast_model_type: a torch.dtype, or False ("do not cast the model", Apex's spelling of None).
c10::ScalarType model_type_from_py(const py::handle& value) {
  if (py::isinstance<py::bool_>(value)) {
    if (!value.cast<bool>()) return c10::ScalarType::Undefined;
    throw py::type_error(
        "cast_model_type must be a torch.dtype, False (do not cast the model) or None, got True");
  }
  try {
    return dtype_from_py(value, "cast_model_type");
  } catch (const py::type_error&) {
    throw py::type_error(
        "cast_model_type must be a torch.dtype, False (do not cast the model) or None, got " +
        type_name(value));
  }
}

// op_lists: "apex" or "torch" (parse_op_lists names both on anything else).
OpLists op_lists_from_py(const py::handle& value) {
  if (!py::isinstance<py::str>(value)) {
    throw py::type_error("op_lists must be a str, \"apex\" or \"torch\", got " + type_name(value));
  }
  return parse_op_lists(value.cast<std::string>());
}

}  // namespace

// Python keyword overrides -> Options. None means "not overridden", as in Apex.
Options options_from_kwargs(const py::kwargs& kwargs) {
  Options o;
  for (const auto& item : kwargs) {
    const auto key = item.first.cast<std::string>();
    const py::handle v = item.second;
    if (v.is_none()) continue;
    const char* k = key.c_str();
    if (key == "enabled")
      o.enabled = bool_from_py(v, k);
    else if (key == "cast_model_type")
      o.cast_model_type = model_type_from_py(v);
    else if (key == "patch_torch_functions")
      o.patch_torch_functions = bool_from_py(v, k);
    else if (key == "patch_torch_functions_type")
      o.patch_torch_functions_type = dtype_from_py(v, k);
    else if (key == "keep_batchnorm_fp32")
      o.keep_batchnorm_fp32 = bool_from_py(v, k);
    else if (key == "master_weights")
      o.master_weights = bool_from_py(v, k);
    else if (key == "loss_scale")
      o.loss_scale = loss_scale_from_py(v);
    else if (key == "num_losses")
      o.num_losses = int_from_py<int>(v, k);
    else if (key == "min_loss_scale")
      o.min_loss_scale = float_from_py(v, k);
    else if (key == "max_loss_scale")
      o.max_loss_scale = float_from_py(v, k);
    else if (key == "verbosity")
      o.verbosity = int_from_py<int>(v, k);
    else if (key == "init_scale")
      o.init_scale = float_from_py(v, k);
    else if (key == "growth_factor")
      o.growth_factor = float_from_py(v, k);
    else if (key == "backoff_factor")
      o.backoff_factor = float_from_py(v, k);
    else if (key == "growth_interval")
      o.growth_interval = int_from_py<int>(v, k);
    else if (key == "hysteresis")
      o.hysteresis = int_from_py<int>(v, k);
    else if (key == "overflow_check")
      o.overflow_check = bool_from_py(v, k);
    else if (key == "rules_under_no_grad")
      o.rules_under_no_grad = bool_from_py(v, k);
    else if (key == "op_lists")
      o.op_lists = op_lists_from_py(v);
    else if (key == "cast_model_outputs")
      o.cast_model_outputs = dtype_from_py(v, k);
    else if (key == "cast_model_inputs")
      o.cast_model_inputs = bool_from_py(v, k);
    else
      throw py::type_error("unexpected keyword argument '" + key + "'");
  }
  return o;
}

OptLevel level_from_py(const py::handle& level) {
  if (py::isinstance<OptLevel>(level)) return level.cast<OptLevel>();
  if (!py::isinstance<py::str>(level)) {
    throw py::type_error("opt_level must be a str such as \"O1\" or an optamp.OptLevel, got " +
                         std::string(py::str(py::type::of(level).attr("__name__"))));
  }
  return parse_opt_level(level.cast<std::string>());
}

namespace {

py::object loss_scale_to_py(const LossScale& scale) {
  if (scale.is_dynamic()) return py::str("dynamic");
  return py::float_(scale.value());
}

}  // namespace

void bind_opt_level(py::module_& m) {
  py::enum_<OptLevel>(m, "OptLevel")
      .value("O0", OptLevel::O0)
      .value("O1", OptLevel::O1)
      .value("O2", OptLevel::O2)
      .value("O3", OptLevel::O3)
      .value("O4", OptLevel::O4)
      .value("O5", OptLevel::O5);

  m.def(
      "parse_opt_level", [](const std::string& text) { return parse_opt_level(text); },
      py::arg("text"));

  py::class_<Properties>(m, "Properties")
      .def_property_readonly("opt_level",
                             [](const Properties& p) { return to_string(p.opt_level); })
      .def_readonly("enabled", &Properties::enabled)
      .def_property_readonly("cast_model_type",
                             [](const Properties& p) { return dtype_to_py(p.cast_model_type); })
      .def_readonly("patch_torch_functions", &Properties::patch_torch_functions)
      .def_property_readonly(
          "patch_torch_functions_type",
          [](const Properties& p) { return dtype_to_py(p.patch_torch_functions_type); })
      .def_readonly("keep_batchnorm_fp32", &Properties::keep_batchnorm_fp32)
      .def_readonly("master_weights", &Properties::master_weights)
      .def_property_readonly("loss_scale",
                             [](const Properties& p) { return loss_scale_to_py(p.loss_scale); })
      .def_readonly("num_losses", &Properties::num_losses)
      .def_readonly("min_loss_scale", &Properties::min_loss_scale)
      .def_readonly("max_loss_scale", &Properties::max_loss_scale)
      .def_readonly("verbosity", &Properties::verbosity)
      .def_readonly("init_scale", &Properties::init_scale)
      .def_readonly("growth_factor", &Properties::growth_factor)
      .def_readonly("backoff_factor", &Properties::backoff_factor)
      .def_readonly("growth_interval", &Properties::growth_interval)
      .def_readonly("hysteresis", &Properties::hysteresis)
      .def_readonly("overflow_check", &Properties::overflow_check)
      .def_readonly("rules_under_no_grad", &Properties::rules_under_no_grad)
      .def_property_readonly("op_lists", [](const Properties& p) { return to_string(p.op_lists); })
      .def_property_readonly("cast_model_outputs",
                             [](const Properties& p) {
                               return p.cast_model_outputs ? dtype_to_py(*p.cast_model_outputs)
                                                           : py::none();
                             })
      .def_readonly("cast_model_inputs", &Properties::cast_model_inputs)
      .def_property_readonly("model_boundary",
                             [](const Properties& p) {
                               const ModelBoundary b = p.model_boundary();
                               return py::make_tuple(dtype_to_py(b.inputs), dtype_to_py(b.outputs));
                             })
      .def_property_readonly("low_dtype",
                             [](const Properties& p) { return dtype_to_py(p.low_dtype()); })
      .def_property_readonly("model_cast",
                             [](const Properties& p) { return to_string(p.model_cast()); })
      .def_property_readonly("casts", &Properties::casts)
      .def("describe", &Properties::describe)
      .def("__repr__", [](const Properties& p) {
        return "optamp.Properties(opt_level=" + to_string(p.opt_level) +
               ", loss_scale=" + p.loss_scale.to_string() + ")";
      });

  m.def(
      "resolve",
      [](const py::object& level, const py::kwargs& overrides) {
        return resolve(level_from_py(level), options_from_kwargs(overrides));
      },
      py::arg("opt_level"),
      "Level defaults plus keyword overrides (Apex names), validated as Apex does.");
}

}  // namespace amp::python
