// A small GAN trained with optamp, in the shape of LibTorch's DCGAN example and Apex's
// examples/dcgan/main_amp.py: two models, two optimizers, three losses with their own loss
// scalers, a logits loss, and amp::step for the optimizer that two guards feed.
//
//   gan [--opt-level O0..O5] [--steps N] [--inject-overflow-at K]
//
// Data is synthetic (points on a ring), so it runs anywhere in a second. --inject-overflow-at K
// makes the discriminator's loss on real data infinite at step K, to show amp::step skipping
// that step while the generator's step goes on.
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <string>

#include <optamp/amp.h>

namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

constexpr int64_t kNoise = 8, kBatch = 64;

nn::Sequential generator() {
  return nn::Sequential(nn::Linear(kNoise, 32), nn::ReLU(), nn::Linear(32, 2));
}

nn::Sequential discriminator() {
  return nn::Sequential(nn::Linear(2, 32),
                        nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
                        nn::Linear(32, 1));
}

// Points on the unit circle with a little noise: the "real" distribution.
torch::Tensor real_batch() {
  const auto angle = torch::rand({kBatch, 1}) * 2 * M_PI;
  return torch::cat({angle.cos(), angle.sin()}, 1) + 0.05 * torch::randn({kBatch, 2});
}

// The logits loss (binary_cross_entropy itself is refused at O1/O4: docs/casting.md).
torch::Tensor bce_logits(const torch::Tensor& logits, float target) {
  return F::binary_cross_entropy_with_logits(logits.to(torch::kFloat),
                                             torch::full({logits.size(0), 1}, target));
}

struct Args {
  std::string level = "O5";
  int steps = 20;
  int inject_at = -1;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const bool has_value = i + 1 < argc;
    if (flag == "--opt-level" && has_value) {
      a.level = argv[++i];
    } else if (flag == "--steps" && has_value) {
      a.steps = std::atoi(argv[++i]);
    } else if (flag == "--inject-overflow-at" && has_value) {
      a.inject_at = std::atoi(argv[++i]);
    } else {
      std::cerr << "usage: gan [--opt-level O0..O5] [--steps N] [--inject-overflow-at K]\n";
      std::exit(2);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  torch::manual_seed(0);
  auto g = generator();
  auto d = discriminator();
  torch::optim::Adam g_opt(g->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));
  torch::optim::Adam d_opt(d->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));

  amp::Options options;
  options.num_losses = 3;  // D on real, D on fake, G: each with its own loss scaler
  amp::initialize({g, d}, {g_opt, d_opt}, args.level, options);

  int d_skipped = 0;
  for (int step = 0; step < args.steps; ++step) {
    // ---- discriminator: two guards before one step, so step through amp::step ----
    d_opt.zero_grad();
    auto real_loss = bce_logits(amp::forward(d, real_batch()), 1.0f);
    if (step == args.inject_at) real_loss = real_loss * std::numeric_limits<float>::infinity();
    {
      auto scaled = amp::scale_loss(real_loss, d_opt, /*loss_id=*/0);
      scaled.backward();
    }
    const auto fake = amp::forward(g, torch::randn({kBatch, kNoise}));
    const auto fake_loss = bce_logits(amp::forward(d, fake.detach()), 0.0f);
    {
      auto scaled = amp::scale_loss(fake_loss, d_opt, /*loss_id=*/1);
      scaled.backward();
    }
    // A plain d_opt.step() would apply fake_loss's gradients alone after real_loss overflowed.
    const bool d_stepped = amp::step(d_opt);
    d_skipped += d_stepped ? 0 : 1;

    // ---- generator: its loss runs through D, whose parameters are not in g_opt. Their grads
    // stay scaled (by loss scaler 2) until d_opt.zero_grad() at the next step, which clears them.
    g_opt.zero_grad();
    const auto g_loss = bce_logits(amp::forward(d, fake), 1.0f);
    {
      auto scaled = amp::scale_loss(g_loss, g_opt, /*loss_id=*/2);
      scaled.backward();
    }
    g_opt.step();

    std::cout << "step " << step << ": d_loss " << (real_loss + fake_loss).item<double>()
              << " g_loss " << g_loss.item<double>() << (d_stepped ? "" : " (D step skipped)")
              << "\n";
  }
  std::cout << "gan " << args.level << ": " << args.steps << " steps, discriminator steps skipped "
            << d_skipped << ", loss scales " << amp::loss_scaler(0).loss_scale() << " / "
            << amp::loss_scaler(1).loss_scale() << " / " << amp::loss_scaler(2).loss_scale()
            << std::endl;
  return 0;
}
