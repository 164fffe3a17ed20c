#include "test_util.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

namespace amp::testing {
namespace {

std::map<std::string, Tolerance> load_table() {
  std::ifstream in(OPTAMP_TOLERANCE_FILE);
  TORCH_CHECK(in, "cannot read tolerance table ", OPTAMP_TOLERANCE_FILE);
  std::map<std::string, Tolerance> table;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream row(line);
    std::string name;
    Tolerance tol{};
    if (row >> name >> tol.rtol >> tol.atol) table[name] = tol;
  }
  return table;
}

}  // namespace

Tolerance tolerance(const std::string& name) {
  static const auto table = load_table();
  auto it = table.find(name);
  TORCH_CHECK(it != table.end(), "no tolerance row named ", name);
  return it->second;
}

Tolerance tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return tolerance("float16");
    case at::kBFloat16:
      return tolerance("bfloat16");
    default:
      return tolerance("float32");
  }
}

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     Tolerance tol) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  auto a = actual.to(at::kDouble).cpu();
  auto e = expected.to(at::kDouble).cpu();
  auto excess = (a - e).abs() - (e.abs() * tol.rtol + tol.atol);
  if (excess.numel() == 0 || excess.max().item<double>() <= 0) return ::testing::AssertionSuccess();
  auto worst = excess.flatten().argmax().item<int64_t>();
  return ::testing::AssertionFailure()
         << "not close (rtol=" << tol.rtol << ", atol=" << tol.atol << "): at flat index " << worst
         << " actual " << a.flatten()[worst].item<double>() << " expected "
         << e.flatten()[worst].item<double>();
}

namespace {

// Runs fn with `callback` observing operator calls (or what `scope` names) on this thread, or on
// every thread (the engine runs a CUDA backward on its device thread); removed however fn ends.
void observing(at::RecordFunctionCallback callback, const std::function<void()>& fn,
               at::RecordScope scope = at::RecordScope::FUNCTION, bool every_thread = false) {
  callback.scopes({scope});
  struct Remove {
    at::CallbackHandle handle;
    ~Remove() { at::removeCallback(handle); }
  } remove{every_thread ? at::addGlobalCallback(callback) : at::addThreadLocalCallback(callback)};
  fn();
}

thread_local std::vector<std::string>* top_level_sink = nullptr;
thread_local int call_depth = 0;

std::unique_ptr<at::ObserverContext> enter_op(const at::RecordFunction& fn) {
  if (call_depth++ == 0 && top_level_sink != nullptr) {
    if (auto op = fn.operator_name()) {
      top_level_sink->push_back(op->overload_name.empty() ? op->name
                                                          : op->name + "." + op->overload_name);
    }
  }
  return nullptr;
}
void leave_op(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) { --call_depth; }

// Written from whichever thread runs the observed call (see observing), under sink_mutex.
std::mutex sink_mutex;
std::vector<at::ScalarType>* dtype_sink = nullptr;
const std::string* dtype_op = nullptr;
std::vector<std::string>* node_sink = nullptr;

std::unique_ptr<at::ObserverContext> record_first_input_dtype(const at::RecordFunction& fn) {
  const auto inputs = fn.inputs();
  std::lock_guard<std::mutex> lock(sink_mutex);
  if (dtype_sink != nullptr && fn.name() == *dtype_op && !inputs.empty() && inputs[0].isTensor()) {
    dtype_sink->push_back(inputs[0].toTensor().scalar_type());
  }
  return nullptr;
}

std::unique_ptr<at::ObserverContext> record_node_name(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(sink_mutex);
  if (node_sink != nullptr) node_sink->push_back(fn.name());
  return nullptr;
}

}  // namespace

std::vector<std::string> top_level_ops(const std::function<void()>& fn) {
  std::vector<std::string> called;
  top_level_sink = &called;
  call_depth = 0;
  observing(at::RecordFunctionCallback(&enter_op, &leave_op), fn);
  top_level_sink = nullptr;
  return called;
}

std::vector<at::ScalarType> first_input_dtypes(const std::string& name,
                                               const std::function<void()>& fn) {
  std::vector<at::ScalarType> seen;
  dtype_sink = &seen;
  dtype_op = &name;
  observing(at::RecordFunctionCallback(&record_first_input_dtype).needsInputs(true), fn,
            at::RecordScope::FUNCTION, /*every_thread=*/true);
  dtype_sink = nullptr;
  return seen;
}

std::vector<std::string> backward_nodes_run(const std::function<void()>& fn) {
  std::vector<std::string> ran;
  node_sink = &ran;
  observing(at::RecordFunctionCallback(&record_node_name), fn, at::RecordScope::BACKWARD_FUNCTION,
            /*every_thread=*/true);
  node_sink = nullptr;
  return ran;
}

std::vector<std::string> graph_node_names(const at::Tensor& root) {
  std::vector<std::string> names;
  std::vector<const torch::autograd::Node*> todo{root.grad_fn().get()};
  while (!todo.empty()) {
    const auto* n = todo.back();
    todo.pop_back();
    if (n == nullptr) continue;
    names.push_back(n->name());
    for (const auto& edge : n->next_edges()) todo.push_back(edge.function.get());
  }
  return names;
}

}  // namespace amp::testing
