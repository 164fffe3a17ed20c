// Checkpoints: model, optimizer and amp::state_dict saved mid-run resume bit-exactly at every
// level (CPU and CUDA), in the order build, initialize, load; loading before initialize fails.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "initialize_test.h"
#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace amp::testing;  // NOLINT: the initialize fixtures and model (initialize_test.h)

// cuDNN may pick non-deterministic kernels (atomics in conv backward); a resume can only be
// bit-exact against a run that used deterministic ones. Restores the setting on exit.
class DeterministicCudnn {
 public:
  DeterministicCudnn() : was_(at::globalContext().deterministicCuDNN()) {
    at::globalContext().setDeterministicCuDNN(true);
  }
  ~DeterministicCudnn() { at::globalContext().setDeterministicCuDNN(was_); }
  DeterministicCudnn(const DeterministicCudnn&) = delete;
  DeterministicCudnn& operator=(const DeterministicCudnn&) = delete;

 private:
  bool was_;
};

// Trains 3 steps, checkpoints model, optimizer and amp, trains 3 more; then resumes a fresh
// model from the checkpoint (build, initialize, load) and trains the same 3: bitwise equal.
void expect_resume_bit_exact(const char* level, at::Device device) {
  DeterministicCudnn deterministic;
  // Adam's default eps underflows in pure fp16 (O3 warns about it), so O3 resumes with SGD.
  const Opt kind = std::string(level) == "O3" ? Opt::kSgd : Opt::kAdam;
  auto batches = batches_on(device);
  Net net = make_net_on(device);
  auto opt = make_optimizer(net, kind);
  initialize(net, *opt, level, quiet());
  for (int s = 0; s < 3; ++s) train_step(net, *opt, batches[s]);
  std::stringstream model_file, opt_file, amp_file;
  torch::save(net, model_file);
  torch::save(*opt, opt_file);
  torch::save(state_dict(), amp_file);
  std::vector<at::Tensor> snapshot;
  for (const auto& p : net->parameters()) snapshot.push_back(p.detach().clone());
  for (int s = 3; s < 6; ++s) train_step(net, *opt, batches[s % batches.size()]);
  const double scale_uninterrupted = loss_scaler(0).loss_scale();
  reset();

  Net resumed = make_net_on(device);
  auto resumed_opt = make_optimizer(resumed, kind);
  initialize(resumed, *resumed_opt, level, quiet());  // O3 casts before loading fp16 values
  torch::load(resumed, model_file);
  torch::load(*resumed_opt, opt_file);
  StateDict amp_state;
  torch::load(amp_state, amp_file);
  load_state_dict(amp_state);
  // (Also a regression test: equal's kernel once left history-free working copies in the cache.)
  for (std::size_t i = 0; i < snapshot.size(); ++i) {
    ASSERT_EQ(resumed->parameters()[i].device().type(), device.type()) << "loaded parameter " << i;
    ASSERT_TRUE(at::equal(resumed->parameters()[i], snapshot[i])) << "loaded parameter " << i;
  }
  for (int s = 3; s < 6; ++s) train_step(resumed, *resumed_opt, batches[s % batches.size()]);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(resumed->parameters()[i], net->parameters()[i])) << "parameter " << i;
  }
  EXPECT_EQ(loss_scaler(0).loss_scale(), scale_uninterrupted);
}

// The resume order (docs/cpp.md): build, initialize, then load. Loading first fails loudly: the
// amp state has no loss scaler to go into yet, and at O3 the fp16 checkpoint does not fit the
// still-fp32 model.
TEST_F(Initialize, CheckpointLoadBeforeInitializeFails) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kSgd);
  initialize(net, *opt, "O3", quiet());
  train_step(net, *opt, make_batches(1).front());
  std::stringstream model_file;
  torch::save(net, model_file);
  const auto amp_state = state_dict();
  reset();

  Net resumed = make_net();
  auto resumed_opt = make_optimizer(resumed, Opt::kSgd);
  OPTAMP_EXPECT_THROW_WITH(load_state_dict(amp_state), c10::Error, "call amp::initialize first");
  EXPECT_THROW(torch::load(resumed, model_file), c10::Error) << "fp16 values into fp32 params";
  model_file.clear();
  model_file.seekg(0);
  initialize(resumed, *resumed_opt, "O3", quiet());
  torch::load(resumed, model_file);
  load_state_dict(amp_state);
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(resumed->parameters()[i], net->parameters()[i])) << "parameter " << i;
  }
}

class InitializeCheckpoint : public testing::OnDevices<Initialize, std::string> {};

TEST_P(InitializeCheckpoint, ResumeIsBitExact) {
  expect_resume_bit_exact(param().c_str(), device());
}

const auto kAllLevels = ::testing::Values("O0", "O1", "O2", "O3", "O4", "O5");

std::string level_name(
    const ::testing::TestParamInfo<std::tuple<std::string, at::DeviceType>>& info) {
  return std::get<0>(info.param) + testing::device_suffix(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Levels, InitializeCheckpoint,
                         ::testing::Combine(kAllLevels, testing::kDevices), level_name);

}  // namespace
}  // namespace amp
