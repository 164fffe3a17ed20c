// Every opt level trains and stays close to O0 (SGD and Adam, on the CPU and on CUDA where a GPU
// is visible; O3 against fp16 training by hand), and O0 is bitwise plain fp32 training.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

struct LevelCase {
  const char* level;
  Opt opt;
};

// gtest prints the case in test names and failures ("O2 Adam", not the bytes of the struct).
void PrintTo(const LevelCase& c, std::ostream* os) {
  *os << c.level << (c.opt == Opt::kSgd ? " SGD" : " Adam");
}

// Every level trains on the CPU and, where a GPU is visible, through the CUDA kernels (casts,
// multi-tensor unscale, scale update), and stays close to O0 there.
class InitializeLevels : public testing::OnDevices<Initialize, LevelCase> {};

std::vector<at::Tensor> train_run(const char* level, Opt kind, int steps, double* first,
                                  double* last, double adam_eps, at::Device device) {
  auto batches = batches_on(device);
  Net net = make_net();
  net->to(device);
  auto opt = make_optimizer(net, kind, adam_eps);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < steps; ++s) {
    const double loss = train_step(net, *opt, batches[s % batches.size()]);
    if (s == 0) *first = loss;
    *last = loss;
  }
  auto params = fp32_cpu_params(net);
  reset();
  return params;
}

// Apex's O3 by hand: the model and inputs in fp16, no optamp at all (O3's reference).
std::vector<at::Tensor> pure_half_run(Opt kind, int steps, double adam_eps, at::Device device) {
  auto batches = batches_on(device);
  Net net = make_net();
  net->to(device, at::kHalf);
  auto opt = make_optimizer(net, kind, adam_eps);
  for (int s = 0; s < steps; ++s) {
    const auto& b = batches[s % batches.size()];
    opt->zero_grad();
    at::cross_entropy_loss(net->forward(b.x.to(at::kHalf), b.tag), b.y).backward();
    opt->step();
  }
  return fp32_cpu_params(net);
}

// The direction of the whole update (params - init) relative to O0's.
double update_cosine(const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& reference) {
  Net init = make_net();
  std::vector<at::Tensor> ours, theirs;
  for (std::size_t i = 0; i < params.size(); ++i) {
    ours.push_back((params[i] - init->parameters()[i].detach()).flatten());
    theirs.push_back((reference[i] - init->parameters()[i].detach()).flatten());
  }
  return at::cosine_similarity(at::cat(ours), at::cat(theirs), 0).item<double>();
}

// Trains 12 steps at c.level and at O0 on `device` and compares: loss, every parameter
// updated, and the parameters (or, for Adam, the update direction) against O0.
void expect_trains_close_to_o0(const LevelCase& c, at::Device device) {
  const std::string level = c.level;
  // O3 steps fp16 weights: Adam's eps must be representable there (see docs/opt_levels.md).
  const double eps = level == "O3" ? 1e-4 : 1e-8;
  double first0 = 0, last0 = 0, first = 0, last = 0;
  const auto reference = train_run("O0", c.opt, 12, &first0, &last0, eps, device);
  const auto params = train_run(c.level, c.opt, 12, &first, &last, eps, device);
  EXPECT_LT(last, first) << "loss did not decrease at " << level;
  EXPECT_NEAR(last, last0, 0.05 * last0) << "final loss at " << level << " vs O0";
  ASSERT_EQ(params.size(), reference.size());
  Net init = make_net();
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_FALSE(at::equal(params[i], init->parameters()[i].detach()))
        << "parameter " << i << " was never updated at " << level;
  }
  if (level == "O3") {
    // Pure fp16 rounds every update (no master weights), so O0 is no reference: fp16 training
    // by hand is. Same ops, same order: bitwise on the CPU; on CUDA within fp16 training
    // tolerance (cuDNN/cuBLAS may pick other algorithms between the two runs).
    const auto half = pure_half_run(c.opt, 12, eps, device);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(device.is_cpu()
                      ? at::equal(params[i], half[i])
                      : testing::all_close(params[i], half[i], testing::tolerance("train_float16")))
          << "parameter " << i << " vs hand-made fp16";
    }
    return;
  }
  if (c.opt == Opt::kAdam) {
    // Adam normalizes every step, so near-zero gradients turn small precision differences into
    // full-size steps elementwise; compare the direction of the whole update instead.
    EXPECT_GT(update_cosine(params, reference), 0.95) << "update direction at " << level;
    return;
  }
  const auto tol =
      testing::tolerance(level == "O4" || level == "O5" ? "train_bfloat16" : "train_float16");
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(testing::all_close(params[i], reference[i], tol)) << "parameter " << i;
  }
}

TEST_P(InitializeLevels, TrainsAndStaysCloseToO0) { expect_trains_close_to_o0(param(), device()); }

const auto kLevelCases = ::testing::Values(LevelCase{"O1", Opt::kSgd}, LevelCase{"O1", Opt::kAdam},
                                           LevelCase{"O2", Opt::kSgd}, LevelCase{"O2", Opt::kAdam},
                                           LevelCase{"O3", Opt::kSgd}, LevelCase{"O3", Opt::kAdam},
                                           LevelCase{"O4", Opt::kSgd}, LevelCase{"O4", Opt::kAdam},
                                           LevelCase{"O5", Opt::kSgd}, LevelCase{"O5", Opt::kAdam});

std::string level_case_name(
    const ::testing::TestParamInfo<std::tuple<LevelCase, at::DeviceType>>& info) {
  const LevelCase& c = std::get<0>(info.param);
  return std::string(c.level) + (c.opt == Opt::kSgd ? "_SGD" : "_Adam") +
         testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeLevels,
                         ::testing::Combine(kLevelCases, testing::kDevices), level_case_name);

TEST_F(Initialize, O0IsBitwisePlainFp32Training) {
  auto batches = make_batches(3);
  Net plain = make_net();
  auto plain_opt = make_optimizer(plain, Opt::kSgd);
  for (const auto& b : batches) {
    plain_opt->zero_grad();
    at::cross_entropy_loss(plain->forward(b.x, b.tag), b.y).backward();
    plain_opt->step();
  }
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O0", quiet());
  for (const auto& b : batches) train_step(net, *opt, b);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(net->parameters()[i], plain->parameters()[i])) << i;
  }
}

}  // namespace
}  // namespace amp
