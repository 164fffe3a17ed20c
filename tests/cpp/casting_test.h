#pragma once
// What the casting tests (test_casting_*.cpp, test_cast_cache.cpp) share: the fixture that turns
// a level's rules on for the test's thread, and a one-parameter module for initialize.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "dispatch/cast_decision.h"
#include "dispatch/registration.h"
#include "optamp/amp.h"

namespace amp::testing {

using at::ScalarType;

class Casting : public ::testing::Test {
 protected:
  void enable(const char* level, Options options = {}) {
    detail::set_level_rules(resolve(level, options));
    detail::activate_thread(true);
  }
  void TearDown() override {
    detail::activate_thread(false);
    detail::clear_level_rules();
    clear_cache();
  }
  static at::Tensor randn(at::IntArrayRef shape, ScalarType dtype = at::kFloat) {
    return at::randn(shape, at::TensorOptions().dtype(dtype));
  }
};

// A module with one fp32 parameter (4x3), for initialize.
struct OneWeight : torch::nn::Module {
  at::Tensor w;
  OneWeight() { w = register_parameter("w", at::randn({4, 3})); }
};

class CastingInitialized : public Casting {
 protected:
  void TearDown() override {
    reset();
    Casting::TearDown();
  }
  static Options quiet() {
    Options o;
    o.verbosity = 0;
    return o;
  }
};

}  // namespace amp::testing
