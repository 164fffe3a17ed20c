// Bindings for the initialize core, the per-thread casting guards, op registration and the
// cast cache. optamp.initialize (python/optamp/frontend.py) collects tensors from torch.nn.Module
// and torch.optim objects and hands them to the same core the LibTorch front uses.
#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <thread>

#include "common.h"
#include "optamp/autocast.h"
#include "optamp/cast_cache.h"
#include "optamp/core.h"
#include "optamp/policy.h"
#include "optamp/tensor_swap.h"

namespace amp::python {
namespace {

// A C++ RAII guard as a Python context manager: created by __enter__, destroyed by __exit__ on
// the same thread (the state it restores is thread-local).
template <typename Guard>
struct PyGuard {
  std::unique_ptr<Guard> guard;
  std::thread::id owner;

  template <typename... Args>
  void enter(Args&&... args) {
    TORCH_CHECK(!guard, "this context manager is already active; create a new one to nest");
    guard = std::make_unique<Guard>(std::forward<Args>(args)...);
    owner = std::this_thread::get_id();
  }
  void exit() {
    if (!guard) return;
    const bool same_thread = owner == std::this_thread::get_id();
    guard.reset();  // from another thread: its thread drops the guard's state at its next op
    TORCH_CHECK(same_thread,
                "optamp context managers must be exited on the thread that entered them "
                "(casting state is per thread); this one was ended, and its thread goes back "
                "to the state of the guards still open there");
  }
};

struct PyAutocast : PyGuard<amp::autocast> {
  bool enabled;
  c10::ScalarType dtype;
};
struct PyDisableCasts : PyGuard<amp::disable_casts> {};
struct PyLiftNoGradGate : PyGuard<amp::lift_no_grad_gate> {};
struct PyThreadStateGuard : PyGuard<amp::thread_state_guard> {
  amp::ThreadState state;
};

struct PySwapHold {
  std::shared_ptr<amp::SwapHold> hold;
};
struct PySwapBatch : PyGuard<amp::SwapBatch> {};

core::OptimizerTensors optimizer_from_py(const py::handle& d) {
  core::OptimizerTensors t;
  t.identity = reinterpret_cast<const void*>(d["identity"].cast<std::uintptr_t>());
  t.description = d["description"].cast<std::string>();
  t.parameters = d["parameters"].cast<std::vector<at::Tensor>>();
  t.state = d["state"].cast<std::vector<at::Tensor>>();
  t.state_owners = d["state_owners"].cast<std::vector<at::Tensor>>();
  t.smallest_eps = d["smallest_eps"].cast<double>();
  t.steps_through_closure = d["steps_through_closure"].cast<bool>();
  TORCH_CHECK(t.state.size() == t.state_owners.size(), "state and state_owners must match");
  return t;
}

}  // namespace

void bind_frontend(py::module_& m) {
  // wrap_pybind_function: TORCH_WARN inside (the O3 eps warning, torch's own warnings) becomes
  // a Python warning instead of a line on stderr.
  m.def("_initialize_core",
        torch::wrap_pybind_function(
            [](std::vector<at::Tensor> reduced, std::vector<at::Tensor> keep_fp32,
               std::vector<at::Tensor> parameters, std::vector<std::string> names,
               const py::list& optimizers, const py::object& level, const py::kwargs& overrides) {
              TORCH_CHECK_VALUE(names.empty() || names.size() == parameters.size(),
                                "names must be empty or name every parameter, got ", names.size(),
                                " names for ", parameters.size(), " parameters");
              core::ModelTensors model{std::move(reduced), std::move(keep_fp32),
                                       std::move(parameters), std::move(names)};
              std::vector<core::OptimizerTensors> opts;
              for (const auto& o : optimizers) opts.push_back(optimizer_from_py(o));
              const OptLevel lvl = level_from_py(level);
              const Options options = options_from_kwargs(overrides);
              return core::initialize(model, opts, lvl, options);
            }),
        py::arg("reduced"), py::arg("keep_fp32"), py::arg("parameters"), py::arg("names"),
        py::arg("optimizers"), py::arg("opt_level"),
        "The framework-neutral core of initialize (validate, then apply). names[i] names "
        "parameters[i] (for the loss scaler's floor error). optimizers: dicts with "
        "identity, description, parameters, state, state_owners, smallest_eps, "
        "steps_through_closure.");
  m.def(
      "_model_boundary",
      []() {
        const ModelBoundary b = core::model_boundary(nullptr);
        return py::make_tuple(dtype_to_py(b.inputs), dtype_to_py(b.outputs));
      },
      "(inputs dtype, outputs dtype) of the initialized models' forward on this thread now; "
      "None: left as they are.");
  m.def(
      "_cast_model_output",
      [](const at::Tensor& output, const py::object& dtype) {
        return core::cast_model_output(output, dtype_from_py(dtype, "dtype"));
      },
      py::arg("output"), py::arg("dtype"),
      "A floating output of an initialized model cast to dtype, as the model boundary casts "
      "it; at O2/O5 the reduced output stays with its fp32 cast for a loss to read.");
  m.def(
      "_working_copy_dtype", [] { return dtype_to_py(core::working_copy_dtype()); },
      "The dtype O2/O5 ops see the working copies' sources in on this thread now; None where "
      "they see the fp32 masters (and at other levels).");
  m.def(
      "_call_reads_masters",
      [](const std::string& op, const std::string& device, const py::sequence& tensors,
         const py::object& self, bool dtype_given) {
        std::vector<core::TracedTensor> traced;
        for (const py::handle item : tensors) {
          const auto t = item.cast<py::tuple>();
          traced.push_back(
              {dtype_from_py(t[0], "tensors' dtype"), t[1].cast<bool>(), t[2].cast<bool>()});
        }
        const c10::ScalarType self_dtype = dtype_from_py(self, "self");
        return core::call_reads_masters(op, c10::Device(device).type(), traced,
                                        self_dtype == c10::ScalarType::Undefined
                                            ? std::nullopt
                                            : std::optional<c10::ScalarType>(self_dtype),
                                        dtype_given);
      },
      py::arg("op"), py::arg("device"), py::arg("tensors"), py::arg("self"), py::arg("dtype_given"),
      "Whether eager O2/O5 casting hands the model tensors in a call of op ('aten::layer_norm') "
      "their fp32 masters: tensors, the read-only floating ones as (dtype, is a model tensor, "
      "has dimensions); self, self's dtype or None.");
  m.def("_working_copy_sources", &core::working_copy_sources,
        "The model tensors O2/O5 ops read as working copies now (empty otherwise).");
  m.def("_reset_core", &core::reset);
  m.def("is_initialized", &core::is_initialized);

  // ---- per-thread state -------------------------------------------------------------------
  m.def("is_casting_enabled", &amp::is_casting_enabled,
        "True when optamp's casting is on for the calling thread (initialize turns it on for "
        "the thread that called it; autocast regions turn it on locally).");
  m.def(
      "_is_any_autocast_enabled",
      []() {
        // torch._C._is_any_autocast_enabled() as torch means it: "ops are autocast now". Its own
        // version reads whether each device's autocast key is excluded, and optamp's key
        // (AutocastPrivateUse1) stays on inside disable_casts and under the no_grad gate, where
        // optamp casts nothing. nn.RNN skips its dtype check on the answer, AOTAutograd
        // disables autocast around a compiled graph on it.
        for (const auto device :
             {c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::XPU,
              c10::DeviceType::IPU, c10::DeviceType::XLA, c10::DeviceType::HPU}) {
          if (at::autocast::is_autocast_enabled(device)) return true;
        }
        return amp::is_casting_enabled();
      },
      "Native autocast on for a device, or optamp's rules apply to ops on this thread now "
      "(installed as torch._C._is_any_autocast_enabled).");
  py::enum_<CastPolicy>(m, "CastPolicy", "What a listed op's kernel does (docs/casting.md).")
      .value("LOWER", CastPolicy::kLower)
      .value("FP32", CastPolicy::kFp32)
      .value("FP32_LOSS", CastPolicy::kFp32Loss)
      .value("PROMOTE", CastPolicy::kPromote)
      .value("BANNED", CastPolicy::kBanned)
      .value("FP32_ALWAYS", CastPolicy::kFp32Always)
      .value("MATCH_SELF", CastPolicy::kMatchSelf)
      .value("OWN_AUTOCAST", CastPolicy::kOwnAutocast);
  py::enum_<PolicyList>(m, "PolicyList",
                        "A table a cast kernel follows: op_lists and the tensor's device.")
      .value("APEX", PolicyList::kApex)
      .value("APEX_CPU", PolicyList::kApexCpu)
      .value("TORCH_CPU", PolicyList::kTorchCpu)
      .value("TORCH_OTHER", PolicyList::kTorchOther);
  py::enum_<RuleSet>(m, "RuleSet", "Which policies apply (set by the level or a region).")
      .value("NONE", RuleSet::kNone)
      .value("FULL_LISTS", RuleSet::kFullLists)
      .value("MASTER_WEIGHTS", RuleSet::kMasterWeights)
      .value("PURE_LOW", RuleSet::kPureLow);
  m.def("policy_applies", &policy_applies, py::arg("policy"), py::arg("rules"));
  m.def(
      "cast_rules_now",
      [](const std::string& device) {
        const CastRules now = cast_rules_now(c10::Device(device).type());
        return py::make_tuple(now.rules, dtype_to_py(now.low));
      },
      py::arg("device") = "cpu",
      "(RuleSet, low dtype or None): what a kernel for an op on `device` applies on this "
      "thread now.");

  py::class_<PyAutocast>(m, "autocast")
      .def(py::init([](bool enabled, const py::object& dtype) {
             auto g = std::make_unique<PyAutocast>();
             g->enabled = enabled;
             g->dtype = dtype_from_py(dtype, "dtype");
             return g;
           }),
           py::arg("enabled") = true, py::arg("dtype") = py::none(),
           "Context manager: an explicit casting region on this thread, also under no_grad. "
           "dtype None = the initialized level's low dtype (float16 if none). enabled=False "
           "turns the rules off inside. The outermost exit drops the cast cache.")
      .def("__enter__",
           [](PyAutocast& self) -> PyAutocast& {
             self.enter(self.enabled, self.dtype);
             return self;
           })
      // The out-of-order warning reaches Python's warnings module.
      .def("__exit__", torch::wrap_pybind_function([](PyAutocast& self, const py::args&) {
             self.exit();
             return false;
           }));

  py::class_<PyDisableCasts>(m, "disable_casts")
      .def(py::init<>(), "Context manager: no casting rules on this thread inside.")
      .def("__enter__",
           [](PyDisableCasts& self) -> PyDisableCasts& {
             self.enter();
             return self;
           })
      // The out-of-order warning reaches Python's warnings module.
      .def("__exit__", torch::wrap_pybind_function([](PyDisableCasts& self, const py::args&) {
             self.exit();
             return false;
           }));

  py::class_<PyLiftNoGradGate>(m, "lift_no_grad_gate")
      .def(py::init<>(),
           "Context manager: the initialized level's rules apply on this thread also under "
           "no_grad inside (Apex/torch.amp behaviour).")
      .def("__enter__",
           [](PyLiftNoGradGate& self) -> PyLiftNoGradGate& {
             self.enter();
             return self;
           })
      .def("__exit__", torch::wrap_pybind_function([](PyLiftNoGradGate& self, const py::args&) {
             self.exit();
             return false;
           }));

  py::class_<amp::ThreadState>(m, "ThreadState")
      .def_static("capture", &amp::ThreadState::capture,
                  "This thread's casting state, to carry into a worker thread.")
      .def_readonly("key_on", &amp::ThreadState::key_on)
      .def_readonly("substitution_on", &amp::ThreadState::substitution_on);
  py::class_<PyThreadStateGuard>(m, "thread_state_guard")
      .def(py::init([](const amp::ThreadState& state) {
             auto g = std::make_unique<PyThreadStateGuard>();
             g->state = state;
             return g;
           }),
           py::arg("state"),
           "Context manager: this thread takes the captured casting state inside.")
      .def("__enter__",
           [](PyThreadStateGuard& self) -> PyThreadStateGuard& {
             self.enter(self.state);
             return self;
           })
      // The out-of-order warning reaches Python's warnings module.
      .def("__exit__", torch::wrap_pybind_function([](PyThreadStateGuard& self, const py::args&) {
             self.exit();
             return false;
           }));

  // ---- policies and cache ---------------------------------------------------------------------
  m.def(
      "register_half_op", [](const std::string& name) { amp::register_half_op(name); },
      py::arg("qualified_name"));
  m.def(
      "register_float_op", [](const std::string& name) { amp::register_float_op(name); },
      py::arg("qualified_name"));
  m.def(
      "register_promote_op", [](const std::string& name) { amp::register_promote_op(name); },
      py::arg("qualified_name"));
  m.def("policy_report", &amp::policy_report);
  m.def(
      "policy_rows",
      [] {
        py::list rows;
        for (const auto& row : amp::policy_rows()) {
          rows.append(py::make_tuple(row.op, row.list, row.policy));
        }
        return rows;
      },
      "Every registered op's policy per list, as (op, PolicyList, CastPolicy) tuples ordered by "
      "op, then list: the data policy_report() prints.");
  m.def("cast_count", &amp::cast_count);
  m.def("clear_cache", &amp::clear_cache);
  m.def("cache_size", &amp::cache_size);
  m.def("_set_gradient_buckets_on_cpu", &amp::set_gradient_buckets_on_cpu, py::arg("enabled"),
        "Tests and benchmarks: convert CPU gradients a bucket at a time, as a GPU's are; returns "
        "the previous setting.");
  m.def("_set_gradient_buckets", &amp::set_gradient_buckets, py::arg("enabled"),
        "Off: every gradient keeps its own conversion (initialize, for a sharded model); returns "
        "the previous setting.");
  // torch.utils.swap_tensors' wrapper (_tensor_swap.py): the hold is opaque to Python.
  py::class_<PySwapHold>(m, "_SwapHold");
  m.def(
      "_hold_records_for_swap",
      [](const at::Tensor& a, const at::Tensor& b) {
        return PySwapHold{amp::hold_records_for_swap(a, b)};
      },
      py::arg("a"), py::arg("b"));
  m.def(
      "_restore_records_after_swap",
      [](PySwapHold& hold, const at::Tensor& a, const at::Tensor& b) {
        amp::restore_records_after_swap(*hold.hold, a, b);
      },
      py::arg("hold"), py::arg("a"), py::arg("b"));
  py::class_<PySwapBatch>(m, "_swap_batch")
      .def(py::init<>(),
           "Context manager: the records of the swaps inside are published together at its end.")
      .def("__enter__",
           [](PySwapBatch& self) -> PySwapBatch& {
             self.enter();
             return self;
           })
      .def("__exit__", [](PySwapBatch& self, const py::args&) {
        self.exit();
        return false;
      });
}

}  // namespace amp::python
