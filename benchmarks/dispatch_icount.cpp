// Instruction-count twin of bench_dispatch, for run under callgrind (timings on a shared 2-core
// machine are too noisy for a 3% target). Runs the same op loop for n and 2n calls in two
// noinline functions; per-call cost = (Ir(loop_2n) - Ir(loop_n)) / n, which cancels set-up.
//   valgrind --tool=callgrind dispatch_icount <mode> <mm|relu> <n>
// modes: noamp; native (at::autocast CPU bf16) vs optamp (O4 rules, bf16); native_fp16 (CPU
// autocast with dtype float16) vs optamp_o1 (O1 rules, fp16), the O1 comparison; optamp_o5:
// O5 (casting rules + parameter substitution, with one registered parameter that the looped op does
// not touch, the common case). benchmarks/dispatch_overhead.sh --icount runs every configuration
// and prints the ratios.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

#include <torch/nn/modules/linear.h>

#include "optamp/amp.h"

namespace {

at::Tensor g_a, g_b;
bool g_mm = true;

void call_op() {
  at::Tensor out = g_mm ? at::mm(g_a, g_b) : at::relu(g_a);
  asm volatile("" : : "r"(out.unsafeGetTensorImpl()) : "memory");
}

__attribute__((noinline)) void loop_n(int n) {
  for (int i = 0; i < n; ++i) call_op();
}

__attribute__((noinline)) void loop_2n(int n) {
  for (int i = 0; i < 2 * n; ++i) call_op();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: dispatch_icount <noamp|native|native_fp16|optamp|optamp_o1|optamp_o5> "
                 "<mm|relu> <n>\n";
    return 2;
  }
  const std::string mode = argv[1];
  g_mm = std::strcmp(argv[2], "mm") == 0;
  const int n = std::atoi(argv[3]);
  g_a = at::randn({8, 8});
  g_b = at::randn({8, 8});
  if (mode == "native" || mode == "native_fp16") {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, mode == "native" ? at::kBFloat16 : at::kHalf);
  } else if (mode == "optamp" || mode == "optamp_o1" || mode == "optamp_o5") {
    // Through the public API: a model with one parameter, which the looped op does not touch
    // (at O5 it is the registered working-copy source: the common case of an op without one).
    static torch::nn::Linear model(8, 8);
    amp::Options quiet;
    quiet.verbosity = 0;
    amp::initialize(model, mode == "optamp" ? "O4" : mode == "optamp_o1" ? "O1" : "O5", quiet);
  }
  for (int i = 0; i < 50; ++i) call_op();  // warm caches and lazy initialization
  loop_n(n);
  loop_2n(n);
  return 0;
}
