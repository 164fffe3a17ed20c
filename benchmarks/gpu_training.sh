#!/usr/bin/env bash
# The GPU training-throughput suite in one command: builds the benchmark programs (no Google
# Benchmark or GoogleTest needed) and runs ResNet-50 and GPT-2 small in C++ and Python at
# native AMP, O0 (TF32 off/on), O1..O5 and native bf16, interleaved, 3 rounds each.
#
#   OPTAMP_PYTHON=python3 bash benchmarks/gpu_training.sh [OUTDIR] [extra flags for all four]
#   bash benchmarks/gpu_training.sh /tmp/smoke --device cpu --small --steps 2 --rounds 1
#
# Writes OUTDIR/{cpp,py}_{resnet50,gpt2}.{txt,jsonl}; each .txt ends with the table and the
# target checks (ratios vs native AMP measured in the same round). Then GPT-2 again with fused
# optimizers (--fused: native's GradScaler and optamp both skip on the device, no sync per step)
# and, in Python, the whole O2/O5 step captured in a CUDA graph: {cpp,py}_gpt2_fused.{txt,jsonl}.
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
for model in resnet50 gpt2; do
  "$BUILD/benchmarks/training/bench_train_$model" --json "$OUTDIR/cpp_$model.jsonl" "$@" 2>&1 |
    tee "$OUTDIR/cpp_$model.txt"
  PYTHONPATH="$OPTAMP_ROOT/python" "$PY" "$OPTAMP_ROOT/benchmarks/bench_train.py" --model "$model" \
    --json "$OUTDIR/py_$model.jsonl" "$@" 2>&1 | tee "$OUTDIR/py_$model.txt"
done
FUSED_CONFIGS=native,O1,O2,O4,O5,native_bf16
"$BUILD/benchmarks/training/bench_train_gpt2" --fused --configs "$FUSED_CONFIGS" \
  --json "$OUTDIR/cpp_gpt2_fused.jsonl" "$@" 2>&1 | tee "$OUTDIR/cpp_gpt2_fused.txt"
PYTHONPATH="$OPTAMP_ROOT/python" "$PY" "$OPTAMP_ROOT/benchmarks/bench_train.py" --model gpt2 \
  --fused --configs "$FUSED_CONFIGS,O2_graph,O5_graph" --json "$OUTDIR/py_gpt2_fused.jsonl" "$@" \
  2>&1 | tee "$OUTDIR/py_gpt2_fused.txt"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUTDIR/machine.txt"
