// Bindings for opt levels and properties (optamp.OptLevel, optamp.Properties, optamp._C.resolve).
#include "optamp/opt_level.h"

#include <pybind11/stl.h>

#include <limits>
#include <string>
#include <type_traits>

#include "common.h"

namespace amp::python {
namespace {

// Apex also accepts the strings "True"/"False" for keep_batchnorm_fp32.
bool bool_from_py(const py::handle& value, const char* name) {
  if (py::isinstance<py::str>(value)) {
    const auto text = value.cast<std::string>();
    if (text == "True") return true;
    if (text == "False") return false;
    throw py::value_error(std::string(name) +
                          " must be True, False, \"True\" or \"False\", got \"" + text + "\"");
  }
  if (!py::isinstance<py::bool_>(value)) {
    throw py::type_error(std::string(name) + " must be a bool, got " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  }
  return value.cast<bool>();
}

template <typename T>
T number_from_py(const py::handle& value, const char* name) {
  constexpr bool integral = std::is_integral_v<T>;
  const bool is_int = py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value);
  if (!(is_int || (!integral && py::isinstance<py::float_>(value)))) {
    throw py::type_error(std::string(name) + (integral ? " must be an int" : " must be a number") +
                         ", got " + std::string(py::str(py::type::of(value).attr("__name__"))));
  }
  if constexpr (integral) {
    // Python ints are unbounded; C++'s are not: a value that does not fit is named, not
    // reported as pybind11's "Unable to cast".
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0 || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
      throw py::value_error(std::string(name) + " must be an int within [" +
                            std::to_string(std::numeric_limits<T>::min()) + ", " +
                            std::to_string(std::numeric_limits<T>::max()) + "], got " +
                            std::string(py::str(value)));
    }
    return static_cast<T>(v);
  } else {
    return value.cast<T>();
  }
}

LossScale loss_scale_from_py(const py::handle& value) {
  if (py::isinstance<py::str>(value)) return LossScale(value.cast<std::string>());
  return LossScale::fixed(number_from_py<double>(value, "loss_scale"));
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
      o.cast_model_type = dtype_from_py(v, k);
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
      o.num_losses = number_from_py<int>(v, k);
    else if (key == "min_loss_scale")
      o.min_loss_scale = number_from_py<double>(v, k);
    else if (key == "max_loss_scale")
      o.max_loss_scale = number_from_py<double>(v, k);
    else if (key == "verbosity")
      o.verbosity = number_from_py<int>(v, k);
    else if (key == "init_scale")
      o.init_scale = number_from_py<double>(v, k);
    else if (key == "growth_factor")
      o.growth_factor = number_from_py<double>(v, k);
    else if (key == "backoff_factor")
      o.backoff_factor = number_from_py<double>(v, k);
    else if (key == "growth_interval")
      o.growth_interval = number_from_py<int>(v, k);
    else if (key == "hysteresis")
      o.hysteresis = number_from_py<int>(v, k);
    else if (key == "overflow_check")
      o.overflow_check = bool_from_py(v, k);
    else if (key == "rules_under_no_grad")
      o.rules_under_no_grad = bool_from_py(v, k);
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
      .def_property_readonly("low_dtype",
                             [](const Properties& p) { return dtype_to_py(p.low_dtype()); })
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
