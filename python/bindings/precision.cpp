// Bindings for amp::PrecisionProbe (optamp/precision_probe.h). The Python front,
// optamp.precision_report (python/optamp/precision.py), opens a PrecisionScope in each
// submodule's forward pre-hook and closes it in the forward hook, and reads the report as JSON.
#include <memory>
#include <string>

#include "common.h"
#include "optamp/precision_probe.h"

namespace amp::python {
namespace {

// A PrecisionProbe::Scope a pair of hooks can open and close: close() ends it (idempotent),
// as the destructor does. Must end on the thread that opened it (the scope stack is per thread).
class PyScope {
 public:
  explicit PyScope(std::string name)
      : scope_(std::make_unique<PrecisionProbe::Scope>(std::move(name))) {}
  void close() { scope_.reset(); }

 private:
  std::unique_ptr<PrecisionProbe::Scope> scope_;
};

}  // namespace

void bind_precision(py::module_& m) {
  py::class_<PrecisionProbe>(m, "PrecisionProbe",
                             "Records every ATen op call's precision statistics while alive "
                             "(one at a time per process); see optamp.precision_report.")
      .def(py::init<std::string>(), py::arg("label") = std::string())
      .def("stop", &PrecisionProbe::stop)
      .def_property_readonly("recording", &PrecisionProbe::recording)
      .def("table", &PrecisionProbe::table, py::arg("max_rows") = 40)
      .def("json", &PrecisionProbe::json);
  py::class_<PyScope>(m, "PrecisionScope",
                      "Names the ops this thread runs (a module path) until close().")
      .def(py::init<std::string>(), py::arg("name"))
      .def("close", &PyScope::close);
}

}  // namespace amp::python
