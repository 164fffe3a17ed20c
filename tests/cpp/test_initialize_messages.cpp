// What amp::initialize tells the user: one line at verbosity 1, Apex's report at 2, nothing at 0;
// and a later error names the model's parameters it recorded (the loss scaler's floor).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <limits>
#include <string>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

TEST_F(Initialize, FloorErrorNamesTheModelsParameters) {
  torch::nn::Linear fc(4, 2);
  torch::optim::SGD opt(fc->parameters(), torch::optim::SGDOptions(0.1));
  Options o = quiet();
  o.init_scale = 1.0;
  o.min_loss_scale = 1.0;
  initialize(fc, opt, "O1", o);
  auto x = at::randn({3, 4});
  std::string message;
  try {
    for (int step = 0; step <= LossScaler::kFloorSkipLimit; ++step) {
      opt.zero_grad();
      auto loss = fc->forward(x).sum() * std::numeric_limits<float>::infinity();
      auto scaled = scale_loss(loss, opt);
      scaled.backward();
    }
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find("weight"), std::string::npos) << message;
  EXPECT_NE(message.find("bias"), std::string::npos) << message;
}

TEST_F(Initialize, VerbosityOnePrintsOneLineAndTwoTheApexReport) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O2");
  const auto out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_NE(out.find("optamp: opt_level O2 ("), std::string::npos) << out;
  EXPECT_NE(out.find("loss scale dynamic"), std::string::npos) << out;
  EXPECT_EQ(out.find("Selected optimization level"), std::string::npos) << out;
  reset();
  Options two;
  two.verbosity = 2;
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O0", two);
  const auto report = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(report.find("Selected optimization level O0"), std::string::npos) << report;
  reset();
  ::testing::internal::CaptureStdout();
  initialize(net, *opt, "O0", quiet());
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
}

}  // namespace
}  // namespace amp
