// LibTorch's cpp/dcgan example with the port docs/cpp.md documents ("Porting LibTorch's
// cpp/dcgan"), in small: the same Sequential models (ConvTranspose2d, BatchNorm2d, Functional
// relu/tanh/leaky_relu/sigmoid) at tiny widths, binary_cross_entropy on a sigmoid output, noisy
// real labels, synthetic images. The port: register BCE as an fp32 op, initialize both models and
// optimizers with num_losses = 3, call the models through amp::forward, wrap each backward in
// amp::scale_loss, step the discriminator with amp::step. It must train at O0-O5 near the fp32 run.
// A child process: register_float_op is process-wide.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "optamp/amp.h"
#include "test_util.h"

namespace amp {
namespace {

constexpr int64_t kNoise = 8;
constexpr int64_t kBatch = 4;
constexpr int kIterations = 3;

torch::nn::Conv2dOptions conv(int64_t in, int64_t out, int64_t kernel) {
  return torch::nn::Conv2dOptions(in, out, kernel).bias(false);
}
torch::nn::ConvTranspose2dOptions deconv(int64_t in, int64_t out, int64_t kernel) {
  return torch::nn::ConvTranspose2dOptions(in, out, kernel).bias(false);
}

// cpp/dcgan's generator at 1/16 width: noise -> 4x4 -> 7x7 -> 14x14 -> 28x28.
torch::nn::Sequential make_generator() {
  return torch::nn::Sequential(torch::nn::ConvTranspose2d(deconv(kNoise, 16, 4)),
                               torch::nn::BatchNorm2d(16), torch::nn::Functional(at::relu),
                               torch::nn::ConvTranspose2d(deconv(16, 8, 3).stride(2).padding(1)),
                               torch::nn::BatchNorm2d(8), torch::nn::Functional(at::relu),
                               torch::nn::ConvTranspose2d(deconv(8, 4, 4).stride(2).padding(1)),
                               torch::nn::BatchNorm2d(4), torch::nn::Functional(at::relu),
                               torch::nn::ConvTranspose2d(deconv(4, 1, 4).stride(2).padding(1)),
                               torch::nn::Functional(at::tanh));
}

// Its discriminator: 28x28 -> 14x14 -> 7x7 -> 3x3 -> one probability (a sigmoid, then BCE).
torch::nn::Sequential make_discriminator() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(conv(1, 4, 4).stride(2).padding(1)),
      torch::nn::Functional(at::leaky_relu, 0.2),
      torch::nn::Conv2d(conv(4, 8, 4).stride(2).padding(1)), torch::nn::BatchNorm2d(8),
      torch::nn::Functional(at::leaky_relu, 0.2),
      torch::nn::Conv2d(conv(8, 16, 4).stride(2).padding(1)), torch::nn::BatchNorm2d(16),
      torch::nn::Functional(at::leaky_relu, 0.2), torch::nn::Conv2d(conv(16, 1, 3)),
      torch::nn::Functional(at::sigmoid));
}

struct TrainingRun {
  std::vector<double> d_losses, g_losses;
  std::vector<at::Tensor> generator_weights;  // fp32 copies after training
  // The discriminator's output dtypes: fp32 where the level casts the model (the boundary),
  // the ops' own (fp16/bf16) at O1/O4, where Apex patches no forward either.
  std::set<at::ScalarType> output_dtypes;
};

TrainingRun train(const char* level) {
  at::manual_seed(1);
  auto generator = make_generator();
  auto discriminator = make_discriminator();
  const double eps = std::string(level) == "O3" ? 1e-4 : 1e-8;  // O3 steps fp16 weights
  torch::optim::Adam generator_optimizer(
      generator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}).eps(eps));
  torch::optim::Adam discriminator_optimizer(
      discriminator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}).eps(eps));
  Options options;
  options.num_losses = 3;
  options.verbosity = 0;
  initialize({generator, discriminator}, {generator_optimizer, discriminator_optimizer}, level,
             options);
  const at::Tensor images = at::rand({kIterations, kBatch, 1, 28, 28}) * 2 - 1;
  TrainingRun run;
  for (int i = 0; i < kIterations; ++i) {
    discriminator->zero_grad();
    const at::Tensor real_labels = at::empty({kBatch}).uniform_(0.8, 1.0);
    const at::Tensor real_output = amp::forward(discriminator, images[i]).reshape({-1});
    const at::Tensor d_loss_real = at::binary_cross_entropy(real_output, real_labels);
    {
      auto s = scale_loss(d_loss_real, discriminator_optimizer, 0);
      s.backward();
    }

    const at::Tensor noise = at::randn({kBatch, kNoise, 1, 1});
    const at::Tensor fake_images = amp::forward(generator, noise);
    at::Tensor fake_labels = at::zeros({kBatch});
    at::Tensor fake_output = amp::forward(discriminator, fake_images.detach()).reshape({-1});
    const at::Tensor d_loss_fake = at::binary_cross_entropy(fake_output, fake_labels);
    {
      auto s = scale_loss(d_loss_fake, discriminator_optimizer, 1);
      s.backward();
    }
    const at::Tensor d_loss = d_loss_real + d_loss_fake;
    step(discriminator_optimizer);

    generator->zero_grad();
    fake_labels.fill_(1);
    fake_output = amp::forward(discriminator, fake_images).reshape({-1});
    const at::Tensor g_loss = at::binary_cross_entropy(fake_output, fake_labels);
    {
      auto s = scale_loss(g_loss, generator_optimizer, 2);
      s.backward();
    }
    generator_optimizer.step();

    run.output_dtypes.insert(real_output.scalar_type());
    run.output_dtypes.insert(fake_output.scalar_type());
    run.d_losses.push_back(d_loss.item<double>());
    run.g_losses.push_back(g_loss.item<double>());
  }
  for (const auto& p : generator->parameters()) {
    run.generator_weights.push_back(p.detach().to(at::kFloat).clone());
  }
  reset();
  return run;
}

// "" when `run` trained like `reference` (the fp32 run), else what differs.
std::string compare(const TrainingRun& run, const TrainingRun& reference, at::ScalarType output,
                    bool skip_weights) {
  if (run.output_dtypes != std::set<at::ScalarType>{output}) {
    return "the discriminator's output is not " + std::string(c10::toString(output));
  }
  for (int i = 0; i < kIterations; ++i) {
    for (const auto& [got, want] : {std::pair{run.d_losses[i], reference.d_losses[i]},
                                    std::pair{run.g_losses[i], reference.g_losses[i]}}) {
      if (!std::isfinite(got) || std::abs(got - want) > 0.02 + 0.05 * std::abs(want)) {
        return "iteration " + std::to_string(i) + ": loss " + std::to_string(got) + ", fp32 run " +
               std::to_string(want);
      }
    }
  }
  for (size_t k = 0; k < run.generator_weights.size(); ++k) {
    const at::Tensor& got = run.generator_weights[k];
    const at::Tensor& want = reference.generator_weights[k];
    if (!at::isfinite(got).all().item<bool>()) return "a generator weight is not finite";
    // O3 steps Adam in fp16: its second moment (0.001 * g^2) underflows for the small gradients
    // of a GAN, so its steps are lr * m / eps, not lr * sign(g): O3 is Apex's speed baseline, not
    // an accuracy level. Its losses still track the fp32 run (above).
    if (!skip_weights && !at::allclose(got, want, 0.05, 2e-3)) {
      return "generator weight " + std::to_string(k) + " drifted from the fp32 run by " +
             std::to_string((got - want).abs().max().item<double>());
    }
  }
  return "";
}

// The child's work: the fp32 run, then every level against it; exits 0, or 1 with the failure.
[[noreturn]] void train_every_level() {
  register_float_op("aten::binary_cross_entropy");  // the port's one registration
  const TrainingRun reference = train("O0");
  const std::vector<std::pair<const char*, at::ScalarType>> levels{{"O1", at::kHalf},
                                                                   {"O2", at::kFloat},
                                                                   {"O3", at::kFloat},
                                                                   {"O4", at::kBFloat16},
                                                                   {"O5", at::kFloat}};
  for (const auto& [level, output] : levels) {
    std::string failure;
    try {
      failure = compare(train(level), reference, output, std::string(level) == "O3");
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    }
    if (!failure.empty()) {
      std::fprintf(stderr, "%s: %s\n", level, failure.c_str());
      std::exit(1);
    }
  }
  std::exit(0);
}

TEST(LibTorchDcganDeathTest, ThePortTrainsAtEveryLevel) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(train_every_level(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace amp
