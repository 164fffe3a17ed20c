#!/usr/bin/env bash
# The GPU training-throughput suite in one command: builds the benchmark programs (no Google
# Benchmark or GoogleTest needed) and runs ResNet-50 and GPT-2 small in C++ and Python at
# native AMP, O0 (TF32 off/on), O1..O5 and native bf16, interleaved, 3 rounds each.
#
#   OPTAMP_PYTHON=python3 bash benchmarks/gpu_training.sh [OUTDIR] [extra flags for all four]
#   bash benchmarks/gpu_training.sh /tmp/smoke --device cpu --small --steps 2 --rounds 1
#
# Writes OUTDIR/{cpp,py}_{resnet50,gpt2}.{txt,jsonl}; each .txt ends with the table (median over
# rounds, the range of the per-round ratios) and the target checks (ratios vs native AMP measured
# in the same round). Then GPT-2 again with fused optimizers (--fused: native's GradScaler and
# optamp both skip on the device, no sync per step), native measured twice (native_again: the
# noise), and the whole O2/O5 step captured in a CUDA graph (O2_graph, O5_graph), with, in
# Python, each configuration's GPU kernel time per step: {cpp,py}_gpt2_fused.{txt,jsonl}.
# BENCH_RUNS picks and orders the runs (default "resnet50 gpt2 gpt2_fused"; also
# resnet50_fused: ResNet-50 with an SGD that skips on the device).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
OUTDIR="${1:-bench-results}"
shift || true
mkdir -p "$OUTDIR"
BUILD="$(optamp_build_dir)"
OPTAMP_CMAKE_ARGS="${OPTAMP_CMAKE_ARGS:--DOPTAMP_BUILD_BENCHMARKS=ON -DOPTAMP_BUILD_TESTS=OFF}" optamp_build >/dev/null
cmake "$BUILD" -DOPTAMP_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$BUILD" --target bench_train_resnet50 bench_train_gpt2 >/dev/null
PY="$(optamp_python)"
{
  echo "date: $(date -u +%FT%TZ)"
  lscpu | sed -n 's/^Model name: *//p'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUTDIR/machine.txt"
# BENCH_RUNS: which runs, in order (default "resnet50 gpt2 gpt2_fused"); BENCH_CONFIGS: the
# unfused runs' configurations (default: each program's own list).
# A run that fails is reported and the others still run; the exit status says one failed.
failed=0
# SIGINT (gpu_check's time budget; `timeout` signals the whole process group): the program running
# reports its complete rounds and exits; then no other run starts. tee ignores the signal, so that
# the report still reaches its file.
interrupted=0
trap 'interrupted=1' INT
keep() { (trap '' INT && exec tee "$1"); }
FUSED_CONFIGS=native,native_again,O1,O2,O4,O5,native_bf16
# Each run is the C++ program and the Python script with the same configurations; both also
# profile each configuration (GPU kernel time and kernels per step, and the kernels that differ
# most from native's, then the host operators' self time).
for run in ${BENCH_RUNS:-resnet50 gpt2 gpt2_fused}; do
  model="${run%_fused}"
  case "$run" in
    resnet50 | gpt2)
      cpp=()
      [[ -n "${BENCH_CONFIGS:-}" ]] && cpp=(--configs "$BENCH_CONFIGS")
      py=("${cpp[@]}")
      ;;
    gpt2_fused)  # no sync per step; also the CUDA-graph-captured O2/O5 step
      cpp=(--fused --configs "$FUSED_CONFIGS,O2_graph,O5_graph")
      py=("${cpp[@]}")
      ;;
    resnet50_fused)  # SGD that skips on the device (C++ amp::FusedSGD, Python SGD(fused=True))
      cpp=(--fused --configs "$FUSED_CONFIGS")
      py=("${cpp[@]}")
      ;;
    *) echo "gpu_training.sh: unknown run $run (resnet50, gpt2, gpt2_fused, resnet50_fused)" >&2
       exit 2 ;;
  esac
  "$BUILD/benchmarks/training/bench_train_$model" "${cpp[@]}" --kernel-time \
    --json "$OUTDIR/cpp_$run.jsonl" \
    "$@" 2>&1 | keep "$OUTDIR/cpp_$run.txt" || failed=1
  [[ $interrupted -eq 1 ]] && break
  PYTHONPATH="$OPTAMP_ROOT/python" "$PY" "$OPTAMP_ROOT/benchmarks/bench_train.py" \
    --model "$model" "${py[@]}" --kernel-time --json "$OUTDIR/py_$run.jsonl" "$@" 2>&1 |
    keep "$OUTDIR/py_$run.txt" || failed=1
  [[ $interrupted -eq 1 ]] && break
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUTDIR/machine.txt"
[[ $interrupted -eq 1 ]] && exit 130
exit "$failed"
