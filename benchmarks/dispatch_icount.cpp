// Instruction counts of optamp's dispatch path, for run under callgrind (timings on a shared
// 2-core machine are too noisy for a 3% target). The measured work runs in two noipa
// instantiations (not inlined, cloned or folded together), run<1> (n times) and run<2> (2n times);
// per-call cost = (Ir(run<2>) - Ir(run<1>)) / n, which cancels set-up and lazy initialization.
// `benchmarks/dispatch_overhead.sh --icount` runs the configurations of docs/benchmarks.md.
//
//   valgrind --tool=callgrind dispatch_icount <mode> <case> <n>
//
// modes: noamp; native (at::autocast CPU bf16); native_fp16 (CPU autocast, float16); optamp_o4,
//        optamp_o5 (bf16); optamp_o1, optamp_o2 (fp16); a "_torch" suffix (optamp_o4_torch,
//        optamp_o1_torch) selects op_lists "torch". Every mode builds the same models; the
//        optamp modes initialize them through the public API.
// cases (8x8 tensors):
//   relu        unlisted op on a tensor that is not a parameter
//   mm          listed op, no parameter
//   mm_param    mm(x, W), W a parameter of an 8x8 Linear
//   add_param   add(x, W), x fp32 (at O5: promotion back to fp32 next to the bf16 working copy)
//   add_param_bf16  add(x, W), x bf16 (as in an O5 forward, where activations are bf16)
//   add_mixed   add(x, y), x fp32, y a bf16 leaf that requires grad (not a parameter): torch's
//               own cost of the promotion add_param meets at O5, the baseline it compares with
//   linear      the Linear module's forward (linear(x, W, b))
//   cnn_backward, gpt_backward  backward() of a small CNN (the Fashion-MNIST example's layout,
//               batch 8) / a 2-layer GPT (d 32, seq 16, batch 2); their forwards run outside the
//               measured function. As in training, each iteration starts from fresh casts: the
//               cast caches (optamp's and native autocast's) are cleared after each backward, as
//               scale_loss's unscale and the outermost autocast exit do once the weights change.
//   cnn_backward_accum, gpt_backward_accum  the same with the caches kept across iterations, as
//               between the micro-batches of gradient accumulation (weights unchanged).
//   gpt_step    a whole training step of a GPT of the same layers at d 8, seq 8, batch 1:
//               zero_grad, forward + loss, loss scaling, backward, amp::FusedAdamW step
//               (skipping on the device: no host read). optamp modes: scale_loss; native
//               modes: autocast around forward + loss only, then torch.amp.GradScaler's work for
//               a fused optimizer (scale, fused check/unscale, found_inf handed to the
//               optimizer, _amp_update_scale_), with the same optimizer.
//   gpt_step_adamw  the same step with LibTorch's own torch::optim::AdamW, which cannot skip on
//               the device: both sides read the overflow flag back once per step (native:
//               GradScaler's found_inf.item(); optamp: the scale_loss guard), as the GPU
//               benchmarks' C++ "AdamW as it comes" runs do.
//   resnet_step the whole step of ResNet-50's layout (53 convolutions and batch norms, 161
//               parameters) at width 2 on 2 x 3 x 32 x 32 images, 10 classes, stepped by
//               amp::FusedSGD with momentum (skipping on the device), as gpt_step; built only
//               for this case (the other cases' models and figures are as they were).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/nn.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "../examples/cpp/fashion_mnist_net.h"
#include "optamp/amp.h"
#include "training/bench_models.h"
#include "training/train_harness.h"

namespace {

// gpt_backward's GPT: d 32, seq 16 (batch 2).
constexpr bench::GPTOptions kBackwardGpt{64, 16, 2, 32, 2};
constexpr std::int64_t kBackwardBatch = 2;
// gpt_step's GPT: the same layers at d 8, seq 8 (batch 1), so small that the CPU's kernels (at
// d 32 its fp16 matmuls were two thirds of a step's instructions, work a GPU does on the device)
// leave what a step costs the host: dispatch, casting, autograd, the optimizer's bookkeeping.
// benchmarks/step_icount.py uses the same sizes. Two layers unless STEP_ICOUNT_LAYERS says
// otherwise (12: GPT-2 small's depth and its 148 parameters; the cast cache's bookkeeping
// depends on how many tensors a step casts, not only on the ops per layer).
bench::GPTOptions step_gpt() {
  const char* layers = std::getenv("STEP_ICOUNT_LAYERS");
  return {64, 8, layers != nullptr ? std::atoi(layers) : 2, 8, 2};
}
constexpr std::int64_t kStepBatch = 1;
// resnet_step's images: two (the last stage's batch norms see 1 x 1 maps; train mode needs more
// than one value per channel), and benchmarks/step_icount.py's STEP_ICOUNT_MODEL=resnet50 sizes.
constexpr std::int64_t kResNetBatch = 2;
bench::ResNetOptions step_resnet() { return {{3, 4, 6, 3}, 2, 10}; }

struct Models : torch::nn::Module {
  Models(const bench::GPTOptions& gpt_options, bool with_resnet) : gpt(gpt_options) {
    register_module("linear", linear);
    register_module("cnn", cnn);
    register_module("gpt", gpt);
    if (with_resnet) resnet = register_module("resnet", bench::ResNet(step_resnet()));
  }
  torch::nn::Linear linear{8, 8};
  fashion_mnist::Net cnn;
  bench::GPT gpt;
  bench::ResNet resnet{nullptr};
};

std::string g_case, g_mode;
at::Tensor g_a, g_a_bf16, g_b, g_b_bf16, g_images, g_labels, g_tokens;
Models* g_models = nullptr;
torch::optim::Optimizer* g_optimizer = nullptr;  // gpt_step, gpt_step_adamw

bench::HandScaler* g_native_scaler = nullptr;  // gpt_step, native modes

void sink(const at::Tensor& t) { asm volatile("" : : "r"(t.unsafeGetTensorImpl()) : "memory"); }

at::Tensor loss_of_forward() {
  if (g_case.rfind("cnn_backward", 0) == 0) {
    return torch::cross_entropy_loss(g_models->cnn(g_images), g_labels);
  }
  if (g_case == "resnet_step") {
    return torch::cross_entropy_loss(g_models->resnet(g_images).to(at::kFloat), g_labels);
  }
  const auto logits = g_models->gpt(g_tokens);
  return torch::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), g_tokens.flatten());
}

template <int Tag>
__attribute__((noipa)) void backward(const at::Tensor& loss) {
  loss.backward();
}

void call_op() {
  const at::Tensor& w = g_models->linear->weight;
  if (g_case == "relu") return sink(at::relu(g_a));
  if (g_case == "mm") return sink(at::mm(g_a, g_b));
  if (g_case == "mm_param") return sink(at::mm(g_a, w));
  if (g_case == "add_param") return sink(at::add(g_a, w));
  if (g_case == "add_param_bf16") return sink(at::add(g_a_bf16, w));
  if (g_case == "add_mixed") return sink(at::add(g_a, g_b_bf16));
  if (g_case == "linear") return sink(g_models->linear(g_a));
  std::cerr << "unknown case " << g_case << "\n";
  std::exit(2);
}

bool native_mode() { return g_mode.rfind("native", 0) == 0; }
bool step_case() {
  return g_case == "gpt_step" || g_case == "gpt_step_adamw" || g_case == "resnet_step";
}

void optamp_step() {
  g_optimizer->zero_grad();
  const at::Tensor loss = loss_of_forward();
  {
    auto scaled = amp::scale_loss(loss, *g_optimizer);
    scaled.backward();
  }
  g_optimizer->step();
}

// torch.autocast around forward + loss, then GradScaler.scale / step / update for a fused
// optimizer (as torch/amp/grad_scaler.py does for _step_supports_amp_scaling).
void native_step() {
  g_optimizer->zero_grad();
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const at::Tensor loss = loss_of_forward();
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();  // torch.autocast's exit
  g_native_scaler->scale(loss).backward();
  g_native_scaler->unscale_and_step(*g_optimizer);
}

void plain_step() {  // noamp: fp32, no scaling
  g_optimizer->zero_grad();
  loss_of_forward().backward();
  g_optimizer->step();
}

template <int Tag>
__attribute__((noipa)) void train_step() {
  if (g_mode == "noamp") return plain_step();
  native_mode() ? native_step() : optamp_step();
}

template <int Tag>
__attribute__((noipa)) void run(int count) {
  if (step_case()) {
    for (int i = 0; i < count; ++i) train_step<Tag>();
    return;
  }
  const bool is_backward = g_case.find("_backward") != std::string::npos;
  const bool accumulate = g_case.find("_accum") != std::string::npos;
  for (int i = 0; i < count; ++i) {
    if (!is_backward) {
      call_op();
      continue;
    }
    const at::Tensor loss = loss_of_forward();
    backward<Tag>(loss);
    for (auto& p : g_models->parameters()) p.mutable_grad().reset();
    if (!accumulate) {
      amp::clear_cache();
      at::autocast::clear_cache();
    }
  }
}

void initialize(const std::string& mode) {
  if (step_case()) {
    const torch::optim::AdamWOptions options(1e-4);
    if (g_case == "gpt_step") {
      g_optimizer = new amp::FusedAdamW(g_models->gpt->parameters(), options);
    } else if (g_case == "resnet_step") {
      g_optimizer = new amp::FusedSGD(g_models->resnet->parameters(),
                                      torch::optim::SGDOptions(0.1).momentum(0.9));
    } else {
      g_optimizer = new torch::optim::AdamW(g_models->gpt->parameters(), options);
    }
    if (native_mode()) {  // enabled around each forward (native_step)
      g_native_scaler = new bench::HandScaler(torch::kCPU);
      at::autocast::set_autocast_dtype(at::kCPU, mode == "native" ? at::kBFloat16 : at::kHalf);
      return;
    }
  }
  if (mode == "native" || mode == "native_fp16") {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, mode == "native" ? at::kBFloat16 : at::kHalf);
    return;
  }
  if (mode == "noamp") return;
  // optamp_oN or optamp_oN_torch
  const std::string level = mode.substr(std::string("optamp_o").size(), 1);
  amp::Options quiet;
  quiet.verbosity = 0;
  if (mode.size() > 6 && mode.substr(mode.size() - 6) == "_torch") {
    quiet.op_lists = amp::OpLists::kTorch;
  }
  if (g_optimizer) {
    amp::initialize(*g_models, *g_optimizer, "O" + level, quiet);
  } else {
    amp::initialize(*g_models, "O" + level, quiet);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr
        << "usage: dispatch_icount <noamp|native|native_fp16|optamp_o1|optamp_o2|optamp_o4|"
           "optamp_o5|optamp_o4_torch|optamp_o1_torch> "
           "<relu|mm|mm_param|add_param|add_param_bf16|add_mixed|linear|cnn_backward|gpt_backward|"
           "cnn_backward_accum|gpt_backward_accum|gpt_step|gpt_step_adamw|resnet_step> <n>\n";
    return 2;
  }
  at::manual_seed(0);
  at::set_num_threads(1);
  g_mode = argv[1];
  g_case = argv[2];
  const int n = std::atoi(argv[3]);
  const bench::GPTOptions gpt = step_case() ? step_gpt() : kBackwardGpt;
  g_models = new Models(gpt, g_case == "resnet_step");
  g_a = at::randn({8, 8});
  g_a_bf16 = g_a.to(at::kBFloat16);
  g_b = at::randn({8, 8});
  g_b_bf16 = g_b.to(at::kBFloat16).requires_grad_();  // as a working copy: autograd records
  g_images =
      g_case == "resnet_step" ? at::randn({kResNetBatch, 3, 32, 32}) : at::randn({8, 1, 28, 28});
  g_labels = at::randint(10, {g_images.size(0)});
  g_tokens = at::randint(gpt.vocab, {step_case() ? kStepBatch : kBackwardBatch, gpt.seq});
  initialize(argv[1]);
  for (int i = 0; i < 5; ++i) run<0>(1);  // warm caches and lazy initialization
  run<1>(n);
  run<2>(2 * n);
  return 0;
}
