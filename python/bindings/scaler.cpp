// Bindings for loss scaling: scaler configuration, the scale_loss guard over a parameter list
// (optamp.scale_loss is a context manager on top), scaler accessors and the state dict.
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "common.h"
#include "optamp/core.h"
#include "optamp/loss_scaler.h"
#include "optamp/state_dict.h"

namespace amp::python {
namespace {

const double kScaleFloor = LossScaler::kScaleFloor;  // an addressable copy for def_readonly_static

// Owns a C++ guard. Python ends it with finish(); a guard that is garbage-collected unfinished
// is treated like an exception exit (ScaledLoss's destructor while unwinding; nothing raised).
struct PyScaledLoss {
  std::unique_ptr<ScaledLoss> guard;
  // With device_skip: where the guard leaves its overflow flag for the optimizers.
  std::shared_ptr<at::Tensor> found_inf = std::make_shared<at::Tensor>();
  ~PyScaledLoss() {
    if (!guard) return;
    try {
      core::finish(*guard, /*unwinding=*/true);
    } catch (...) {
    }
  }
};

}  // namespace

namespace {

// The overflow flag the last Python reducer was handed: its Python object and a C++ reference.
// A collective backend may drop its own reference on a worker thread after the collective has
// returned (gloo's run loop destroys the finished work there). In torch 2.11 a tensor with a
// Python object keeps that object alive while any C++ reference besides the object's own exists,
// and the C++ reference that brings the count back to one releases the object, taking the GIL
// (c10/util/intrusive_ptr.h). Were the backend's reference that one, its thread would take the
// GIL, and while the interpreter shuts down such a thread is ended instead, inside a destructor:
// std::terminate (a rank of the two-process gloo test aborted so at exit, about once in 10 runs).
// Held here, the backend's never is. Replaced at the next reduction and released by
// optamp.reset() (on the Python thread, with the GIL), never at exit: the last one is left to the
// process. Leaked: a static would be destroyed after finalization.
struct ReducedFlag {
  py::object object;
  at::Tensor tensor;
};
ReducedFlag& last_reduced_flag() {
  static auto* flag = new ReducedFlag();
  return *flag;
}

// A Python callable as a LossScaler::FoundInfReducer. The scaler may outlive the interpreter
// (static registry), so the last reference is dropped under the GIL, or leaked after
// finalization rather than released without one.
LossScaler::FoundInfReducer python_reducer(const py::object& fn) {
  std::shared_ptr<py::object> held(new py::object(fn), [](py::object* o) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete o;
    } else {
      o->release();
      delete o;
    }
  });
  return [held](at::Tensor& found_inf) {
    py::gil_scoped_acquire gil;
    py::object flag = py::cast(found_inf);
    (*held)(flag);
    last_reduced_flag() = ReducedFlag{std::move(flag), found_inf};
  };
}

}  // namespace

void bind_scaler(py::module_& m) {
  m.def("configure_loss_scalers", &core::configure_loss_scalers, py::arg("properties"),
        "Create properties.num_losses loss scalers (amp.initialize does this).");
  m.def("reset_loss_scalers", &core::reset_loss_scalers);
  m.def("num_loss_scalers", &core::num_loss_scalers);

  py::class_<LossScaler, std::shared_ptr<LossScaler>>(m, "LossScaler")
      .def_property_readonly("loss_id", &LossScaler::loss_id)
      .def_property_readonly("dynamic", &LossScaler::dynamic)
      .def_property_readonly("checks_overflow", &LossScaler::checks_overflow)
      .def_property_readonly("lowest_scale", &LossScaler::lowest_scale)
      .def_property_readonly("hysteresis", &LossScaler::hysteresis)
      .def_readonly_static("SCALE_FLOOR", &kScaleFloor)
      .def("loss_scale", &LossScaler::loss_scale)
      .def_property_readonly("last_step_skipped", &LossScaler::last_step_skipped)
      .def_property_readonly("skipped_steps", &LossScaler::skipped_steps)
      .def_property_readonly("floor_skips", &LossScaler::floor_skips)
      .def_property_readonly("host_waits", &LossScaler::host_waits,
                             "Step results the host asked for before they were known to be there "
                             "(a device->host sync each on a GPU): one per step that skips on the "
                             "host, none for steps a fused optimizer skips on the device.")
      .def_property_readonly("scale_tensor", &LossScaler::scale_tensor)
      .def_property_readonly("growth_tracker", &LossScaler::growth_tracker)
      .def_property_readonly("hysteresis_tracker", &LossScaler::hysteresis_tracker)
      .def(
          "unscale",
          [](LossScaler& self, const std::vector<at::Tensor>& grads,
             const std::vector<std::optional<at::Tensor>>& stashed) {
            std::vector<at::Tensor> s;  // None -> no stash for that gradient
            for (const auto& t : stashed) s.push_back(t.value_or(at::Tensor()));
            self.unscale(grads, s);
          },
          py::arg("grads"), py::arg("stashed") = std::vector<std::optional<at::Tensor>>{})
      .def("update", &LossScaler::update)
      .def("scale", &LossScaler::scale, py::arg("loss"),
           "loss.float() * scale, on the loss's device (moves the scaler's state there first)")
      .def(
          "to", [](LossScaler& self, const c10::Device& device) { self.to(device); },
          py::arg("device"))
      .def(
          "set_found_inf_reducer",
          [](LossScaler& self, const py::object& fn) {
            if (fn.is_none()) return self.set_found_inf_reducer({});
            TORCH_CHECK_TYPE(PyCallable_Check(fn.ptr()),
                             "found_inf reducer must be callable or None, got ",
                             py::str(py::type::handle_of(fn).attr("__name__")).cast<std::string>());
            self.set_found_inf_reducer(python_reducer(fn));
          },
          py::arg("reducer"),
          "reducer(found_inf) combines this process's overflow flag (a one-element float32 "
          "tensor on the scale's device) with other ranks' in place, e.g. all_reduce MAX; None "
          "removes it.")
      .def_property_readonly("has_found_inf_reducer", &LossScaler::has_found_inf_reducer);
  m.attr("FLOOR_SKIP_LIMIT") = LossScaler::kFloorSkipLimit;
  m.def("loss_scaler", &core::loss_scaler_ptr, py::arg("loss_id") = 0);
  m.def(
      "_hold_reduced_flag",
      [](const py::object& flag) {
        last_reduced_flag() = ReducedFlag{flag, py::cast<at::Tensor>(flag)};
      },
      py::arg("flag"),
      "Hold a flag a collective reduced in Python outside a reducer (optamp._dtensor), as the "
      "reducers' flags are held: see last_reduced_flag in bindings/scaler.cpp.");
  m.def(
      "_release_reduced_flag", [] { last_reduced_flag() = ReducedFlag{}; },
      "Drops the overflow flag the last found_inf reducer was handed (kept until the next "
      "reduction: see last_reduced_flag in bindings/scaler.cpp).");

  py::class_<PyScaledLoss>(m, "_ScaledLoss")
      .def_property_readonly("loss",
                             [](const PyScaledLoss& self) {
                               TORCH_CHECK(self.guard, "scale_loss guard already finished");
                               return self.guard->loss();
                             })
      .def("finish",
           // Warnings raised while unscaling (e.g. torch.cuda.set_sync_debug_mode) reach Python.
           // Returns whether this guard's own step overflowed (not read from the shared scaler,
           // which another thread's guard may have updated since).
           torch::wrap_pybind_function([](PyScaledLoss& self, bool unwinding) {
             if (!self.guard) return false;
             auto guard = std::move(self.guard);
             return core::finish(*guard, unwinding);
           }),
           py::arg("unwinding") = false)
      .def_property_readonly(
          "found_inf",
          [](const PyScaledLoss& self) -> std::optional<at::Tensor> {
            if (!self.found_inf->defined()) return std::nullopt;
            return *self.found_inf;
          },
          "With device_skip: the finished step's overflow flag (0-dim float32 on the "
          "scale's device, 0 or 1), for the optimizers to skip on the device; None otherwise.");

  m.def(
      "_scale_loss",
      torch::wrap_pybind_function(
          [](const at::Tensor& loss, std::vector<at::Tensor> params, int loss_id,
             bool delay_unscale, std::vector<std::vector<size_t>> group_sizes,
             const std::vector<std::uintptr_t>& optimizer_ids, bool device_skip) {
            std::vector<const void*> identities;
            std::vector<std::string> descriptions;
            for (size_t k = 0; k < optimizer_ids.size(); ++k) {
              identities.push_back(reinterpret_cast<const void*>(optimizer_ids[k]));
              descriptions.push_back(optimizer_ids.size() == 1
                                         ? std::string("optimizer")
                                         : "optimizers[" + std::to_string(k) + "]");
            }
            core::check_optimizers_allowed(identities, descriptions);
            auto holder = std::make_unique<PyScaledLoss>();
            core::DeviceSkip sink;
            if (device_skip) {
              sink = [slot = holder->found_inf](const at::Tensor& found_inf) { *slot = found_inf; };
            }
            holder->guard = std::make_unique<ScaledLoss>(core::scale_loss(
                loss, std::move(params), core::optimizer_param_labels(std::move(group_sizes)),
                ScaleLossOptions{loss_id, delay_unscale}, "optimizer", std::move(sink)));
            return holder;
          }),
      py::arg("loss"), py::arg("params"), py::arg("loss_id") = 0, py::arg("delay_unscale") = false,
      py::arg("group_sizes") = std::vector<std::vector<size_t>>{},
      py::arg("optimizer_ids") = std::vector<std::uintptr_t>{}, py::arg("device_skip") = false);

  m.def("state_dict", []() {
    py::dict out;
    const StateDict sd = amp::state_dict();
    for (const auto& [k, v] : sd.items()) out[py::str(k)] = v;
    return out;
  });
  m.def(
      "load_state_dict",
      [](const py::dict& d) {
        StateDict sd;
        for (const auto& item : d) {
          if (!py::isinstance<py::str>(item.first)) {
            throw py::type_error(
                "state_dict keys must be str, got " +
                py::str(py::type::of(item.first).attr("__name__")).cast<std::string>());
          }
          const auto key = item.first.cast<std::string>();
          if (!THPVariable_Check(item.second.ptr())) {
            throw py::type_error(
                "state_dict['" + key + "'] must be a torch.Tensor, got " +
                py::str(py::type::of(item.second).attr("__name__")).cast<std::string>());
          }
          sd.insert(key, item.second.cast<at::Tensor>());
        }
        amp::load_state_dict(sd);
      },
      py::arg("state_dict"));
}

}  // namespace amp::python
