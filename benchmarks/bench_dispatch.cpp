// Per-call dispatch overhead on tiny CPU tensors (issue: O1 casting benchmark).
//   a) no amp                          BM_NoAmp/<op>
//   b) native at::autocast (CPU, bf16)  BM_NativeAutocast/mm
//   c) optamp O4 (bf16) on a listed op  BM_Optamp/mm
//   d) optamp on an unlisted op         BM_Optamp/relu (fallthrough)
// Targets, as ratios within one run: d/a <= 1.03, (c - a) <= 1.25 * (b - a).
// bf16 on both sides so (b) and (c) perform the same casts.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <benchmark/benchmark.h>

#include <torch/nn/modules/linear.h>

#include "optamp/amp.h"

namespace {

struct Inputs {
  at::Tensor a = at::randn({8, 8});
  at::Tensor b = at::randn({8, 8});
};

void run_op(benchmark::State& state, bool mm) {
  Inputs in;
  for (auto _ : state) {
    benchmark::DoNotOptimize(mm ? at::mm(in.a, in.b) : at::relu(in.a));
  }
}

void BM_NoAmp(benchmark::State& state) { run_op(state, state.range(0) == 0); }

void BM_NativeAutocast(benchmark::State& state) {
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  run_op(state, state.range(0) == 0);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
}

// O4 through the public API: a model to initialize (the looped op does not use it).
void BM_Optamp(benchmark::State& state) {
  torch::nn::Linear model(8, 8);
  amp::Options quiet;
  quiet.verbosity = 0;
  amp::initialize(model, "O4", quiet);
  run_op(state, state.range(0) == 0);
  amp::reset();
}

// range(0): 0 = mm (listed), 1 = relu (not listed). Interleaved repetitions smooth out drift.
BENCHMARK(BM_NoAmp)->Arg(0)->Arg(1)->ArgNames({"relu"});
BENCHMARK(BM_NativeAutocast)->Arg(0)->Arg(1)->ArgNames({"relu"});
BENCHMARK(BM_Optamp)->Arg(0)->Arg(1)->ArgNames({"relu"});

}  // namespace

BENCHMARK_MAIN();
