#pragma once
// Test helpers shared by the GoogleTest files: the per-dtype tolerance table, CUDA skipping and
// device-parametrized tests, and error-message assertions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "optamp/opt_level.h"

#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace amp::testing {

struct Tolerance {
  double rtol;
  double atol;
};

// Looks up a row of tests/tolerances.txt ("float16", "bfloat16", "train_float16", ...).
Tolerance tolerance(const std::string& name);
Tolerance tolerance(at::ScalarType dtype);

// EXPECT-style closeness with the table's tolerance for `dtype`; reports the worst element.
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     Tolerance tol);

// The operators ("aten::op" / "aten::op.overload") that fn dispatches at the top level on this
// thread, leaving out the calls made inside them (a CPU kernel reading a CPU tensor is no sync;
// host code calling aten::_local_scalar_dense is one on a GPU).
std::vector<std::string> top_level_ops(const std::function<void()>& fn);

// The dtype of the first argument of every `name` call ("aten::log_softmax") that fn makes,
// nested calls included, on any thread (a CUDA backward runs on the engine's device thread).
// One at a time: a first_input_dtypes inside fn would leave the outer one's result empty.
std::vector<at::ScalarType> first_input_dtypes(const std::string& name,
                                               const std::function<void()>& fn);

// The autograd nodes the engine runs during fn, in order, as the profiler names them
// ("autograd::engine::evaluate_function: MmBackward0"), on any thread.
std::vector<std::string> backward_nodes_run(const std::function<void()>& fn);

// The names of the autograd nodes reachable from `root`'s grad_fn, depth first, root first.
std::vector<std::string> graph_node_names(const at::Tensor& root);

// Detached clones of `ts`, to compare with later (bit_equal).
inline std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

// Same count, and each pair equal bit for bit.
inline bool bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

// Options with verbosity 0: no properties report or overflow lines in the test output.
inline Options quiet() {
  Options o;
  o.verbosity = 0;
  return o;
}

}  // namespace amp::testing

#define OPTAMP_SKIP_WITHOUT_CUDA()                                \
  do {                                                            \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

#define OPTAMP_SKIP_UNLESS_VISIBLE(device)                 \
  do {                                                     \
    if ((device) == at::kCUDA) OPTAMP_SKIP_WITHOUT_CUDA(); \
  } while (0)

namespace amp::testing {

// Device-parametrized tests: one TEST_P over {CPU, CUDA} (kDevices, alone or in a
// ::testing::Combine), its fixture's SetUp calling OPTAMP_SKIP_UNLESS_VISIBLE(device), its
// instance names ending in device_suffix(device). A CUDA instance is then named "..._CUDA", like
// the CUDA-only tests: main.cpp leaves it out of a default run without a GPU, and run by name
// (ctest) it reports a skip.
inline const auto kDevices = ::testing::Values(at::kCPU, at::kCUDA);
inline std::string device_suffix(at::DeviceType device) {
  return device == at::kCUDA ? "_CUDA" : "_CPU";
}
// The name of an instance whose parameter is the device alone: "On_CPU", "On_CUDA".
inline std::string on_device(const ::testing::TestParamInfo<at::DeviceType>& info) {
  return "On" + device_suffix(info.param);
}

// A fixture `Base` parametrized by (Case, device), instantiated over Combine(cases, kDevices). A
// CUDA instance skips where no GPU is visible.
template <typename Base, typename Case>
class OnDevices : public Base,
                  public ::testing::WithParamInterface<std::tuple<Case, at::DeviceType>> {
 protected:
  void SetUp() override {
    OPTAMP_SKIP_UNLESS_VISIBLE(device());
    Base::SetUp();
  }
  const Case& param() const { return std::get<0>(this->GetParam()); }
  at::DeviceType device() const { return std::get<1>(this->GetParam()); }
};

}  // namespace amp::testing

// Runs `stmt`, expects a c10 exception of type `kind` whose message contains every substring.
#define OPTAMP_EXPECT_THROW_WITH(stmt, kind, ...)              \
  do {                                                         \
    try {                                                      \
      stmt;                                                    \
      ADD_FAILURE() << "expected " #kind " from: " #stmt;      \
    } catch (const kind& e) {                                  \
      const std::string what = e.what_without_backtrace();     \
      /* copied now: an argument may point into a temporary */ \
      const std::vector<std::string> needles{__VA_ARGS__};     \
      for (const std::string& needle : needles) {              \
        EXPECT_NE(what.find(needle), std::string::npos)        \
            << "message lacks \"" << needle << "\": " << what; \
      }                                                        \
    }                                                          \
  } while (0)
