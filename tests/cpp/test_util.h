#pragma once
// Test helpers shared by the GoogleTest files: the per-dtype tolerance table, CUDA skipping and
// error-message assertions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
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

}  // namespace amp::testing

#define OPTAMP_SKIP_WITHOUT_CUDA()                                \
  do {                                                            \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

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
