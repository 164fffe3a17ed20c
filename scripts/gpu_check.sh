#!/usr/bin/env bash
# Verifies a GPU machine in one command, without network: build (for this GPU's architecture
# only), ctest (the *_CUDA tests run when a GPU is visible), the CMake check, the needs_cuda
# pytests, the softmax kernels' benchmark, a short training-benchmark pass (ResNet-50 and GPT-2
# small, C++ and Python, every level against native AMP), the CUDA A/B runs (Fashion-MNIST,
# char-GPT), and last the CPU pytests in what is left of a 9.5-minute budget
# (GPU_CHECK_MINUTES=9, plus 30 s), so that it ends within the device tool's 10 minutes on an H100.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Leaves two files in OUTDIR, rewritten after every phase (so a run cut short still reports what
# it finished): summary.md (each phase: result, pass/fail counts, minutes; every benchmark
# target line) and logs.tar.gz (every log). The last line printed is "N passed, N failed", N
# counting tests (ctest, pytest) and phases without tests of their own (build, CMake check,
# benchmarks, A/B).
# What the machine lacks is carried in .devcarry/ (docs/gpu.md): GoogleTest sources
# (.devcarry/googletest) and the Fashion-MNIST files (.devcarry/fashion-mnist).
# Environment: OPTAMP_BUILD_DIR (default /tmp/optamp-gpu-build), PYTEST_ARGS, OPTAMP_OFFLINE
# (default 1: nothing is fetched), GPU_CHECK_BENCH_ARGS (default "--steps 10 --rounds 2
# --warmup 3"), GPU_CHECK_AB_ARGS (default "--levels O0,O1,O2,O3,O4,O5 --steps 300"),
# GPU_CHECK_DEVICE (the A/B's device, default cuda; cpu for a dry run of this script),
# GPU_CHECK_CHAR_GPT_AB_ARGS (default "--levels O0,O1,O2,O4,O5 --seeds 1 --precision-steps 2")
# and GPU_CHECK_CHAR_GPT_ARGS (the trainer's, default "--steps 200") for the char-GPT A/B,
# GPU_CHECK_MINUTES (default 9), GPU_CHECK_PHASES (which phases, in order, comma-separated;
# default all: bootstrap,build,ctest,cmake_compat,pytest_cuda,softmax_kernels,kernel_profile,
# benchmarks,ab,ab_char_gpt,pytest_cpu; the pytest phases run in what is left of the budget),
# GPU_CHECK_CMAKE_ARGS (added to the configure's arguments, e.g. -DOPTAMP_BUILD_TESTS=OFF for a
# run without ctest), GPU_CHECK_PYTEST_CUDA_SECONDS (the most the needs_cuda pytests may take;
# default: the budget), GPU_CHECK_SOFTMAX_KERNELS_ARGS (benchmarks/bench_softmax_kernels.py's,
# e.g. "--rows 8 --attention-rows 8" for a dry run; the kernel profile's too),
# GPU_CHECK_PROFILE_KERNELS, GPU_CHECK_PROFILE_LAUNCHES, GPU_CHECK_PROFILE_SECONDS (the kernel
# profile's kernel-name regex, launches, time limit: default optamp's loss, 4, 120 s or what is
# left of the budget),
# GPU_CHECK_CTEST_ARGS (added to ctest's, e.g. -R "CUDA|packaging" for the GPU tests alone).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/runner_counts.sh"
cd "$OPTAMP_ROOT" || exit 1
[[ $# -eq 1 ]] || { echo "usage: scripts/gpu_check.sh OUTDIR" >&2; exit 2; }
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
LOGS="$(mktemp -d)/logs"
mkdir -p "$LOGS"
export OPTAMP_OFFLINE="${OPTAMP_OFFLINE-1}" OPTAMP_SKIP_APT="${OPTAMP_SKIP_APT-1}"
export OPTAMP_BUILD_DIR="${OPTAMP_BUILD_DIR:-/tmp/optamp-gpu-build}"
# This GPU's architecture only (one architecture halves the CUDA compile), read from nvidia-smi
# rather than CMake's "native", which fails the configure where the query does.
cmake_args=""
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')"
if [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]]; then
  cmake_args="-DCMAKE_CUDA_ARCHITECTURES=${cap/./}"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$cap}"
fi
if [[ -d .devcarry/googletest ]]; then
  export OPTAMP_GTEST_SOURCE_DIR="$PWD/.devcarry/googletest"  # also for scripts/cmake_compat.sh
  cmake_args+=" -DOPTAMP_GTEST_SOURCE_DIR=$OPTAMP_GTEST_SOURCE_DIR"
fi
export OPTAMP_CMAKE_ARGS="${OPTAMP_CMAKE_ARGS:-$cmake_args} ${GPU_CHECK_CMAKE_ARGS:-}"
data_args=()
[[ -d .devcarry/fashion-mnist ]] && data_args=(--data .devcarry/fashion-mnist)

passed=0
failed=0
rows=()
targets=()
started=$(date +%s)
budget=$(( ${GPU_CHECK_MINUTES:-9} * 60 + 30 ))  # seconds; the CPU-only pytest run fits what is left

write_summary() {
  {
    echo "# GPU check, $(date -u +%FT%TZ)"
    echo
    echo "- machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null |
      head -1), $(nproc) cores; $(cmake --version | head -1); CXX $(sed -n \
      's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$OPTAMP_BUILD_DIR/CMakeCache.txt" 2>/dev/null)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (+ changes)')"
    echo "- elapsed: $(( ($(date +%s) - started) / 60 )) min $(( ($(date +%s) - started) % 60 )) s"
    echo
    echo "| phase | result | passed | failed | skipped | minutes |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    if [[ ${#targets[@]} -gt 0 ]]; then
      echo
      echo "## Benchmark targets (ratios against native AMP, same run)"
      echo
      printf '%s\n' "${targets[@]}"
    fi
    echo
    echo "$passed passed, $failed failed"
  } >"$OUT/summary.md"
  tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" logs 2>/dev/null
}

# phase NAME COMMAND...: runs it with its output in logs/NAME.log; the counts come from the
# runner's own summary (ctest, pytest) or, for a phase without one, its exit status.
phase() {
  local name="$1" t0 rc p f s
  shift
  t0=$(date +%s)
  echo "== $name =="
  "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 3 "$LOGS/$name.log"
  read -r p f s < <(runner_counts "$LOGS/$name.log" "$rc")
  passed=$((passed + p))
  failed=$((failed + f))
  local result=ok minutes
  [[ $rc -ne 0 ]] && result="FAILED (exit $rc)"
  [[ $rc -eq 124 || $rc -eq 137 ]] && result="cut short at the time budget"
  minutes=$(awk -v t="$(( $(date +%s) - t0 ))" 'BEGIN { printf "%.1f", t / 60 }')
  rows+=("| $name | $result | $p | $f | $s | $minutes |")
  write_summary
  return $rc
}

# Seconds left of the budget, less a margin for the summary.
seconds_left() { echo $(( budget - ($(date +%s) - started) - 15 )); }
# phase_time NAME CAP LEAST GRACE: sets phase_limit to the seconds phase NAME may take, CAP where
# given (empty: no cap) but at most what is left of the budget less GRACE (how long after the
# limit its kill may come), so that a run under the device tool's limit still ends with a
# summary. With under LEAST seconds the phase is recorded as not run instead (status 1).
phase_time() {
  local name="$1" cap="$2" least="$3" grace="$4" left
  left=$(( $(seconds_left) - grace ))
  phase_limit=$left
  [[ -n "$cap" && "$cap" -lt "$phase_limit" ]] && phase_limit="$cap"
  [[ $phase_limit -ge $least ]] && return 0
  rows+=("| $name | not run: ${left}s left of the ${budget}s budget | 0 | 0 | 0 | 0 |")
  return 1
}
# A pytest phase in what is left of the time budget (stopped at the budget: "cut short").
pytest_phase() {
  local name="$1" cap="$2"
  shift 2
  phase_time "$name" "$cap" 61 0 || return 0
  phase "$name" timeout --signal=INT --kill-after=15 "$phase_limit" "${pytest_cmd[@]}" "$@"
}

run_bootstrap() { phase bootstrap bash scripts/bootstrap.sh; }
run_build() {
  if ! phase build bash -c 'source scripts/common.sh && optamp_build'; then
    echo "gpu_check: the build failed; nothing else can run"
    tail -n 1 "$OUT/summary.md"
    exit 1
  fi
}
# shellcheck disable=SC2086
run_ctest() {
  phase ctest ctest --test-dir "$OPTAMP_BUILD_DIR" --output-on-failure -j "$(nproc)" \
    ${GPU_CHECK_CTEST_ARGS:-}
}
run_cmake_compat() { phase cmake_compat bash scripts/cmake_compat.sh "$OPTAMP_BUILD_DIR"; }
run_pytest_cuda() { pytest_phase pytest_cuda "${GPU_CHECK_PYTEST_CUDA_SECONDS:-}" -m needs_cuda; }
run_benchmarks() {
  # Stopped at the budget too (SIGINT): the program running reports its complete rounds (its
  # target lines reach the summary, with an "interrupted" line) and no later run starts. Killed 15
  # s after the interrupt: on the sixth GPU run a benchmark outlived it, and the device tool's 10
  # minutes ended the check before its summary and logs.
  # shellcheck disable=SC2086
  phase benchmarks timeout --signal=INT --kill-after=15 "$(seconds_left)" \
    bash benchmarks/gpu_training.sh "$LOGS/bench" \
    ${GPU_CHECK_BENCH_ARGS:---steps 10 --rounds 2 --warmup 3}
  while IFS= read -r line; do targets+=("- $line"); done < <(
    for f in "$LOGS"/bench/{cpp,py}_*.txt; do  # whichever runs gpu_training.sh made
      [[ -f "$f" ]] && grep -E '^(target|noise|profiled|kernels|host|interrupted)[ :]' "$f" |
        sed "s|^|$(basename "$f" .txt): |"
    done)
  write_summary
}
# The fp32 list's softmax kernels alone, log_softmax and cross_entropy at GPT-2's logits and softmax
# at attention scores (benchmarks/bench_softmax_kernels.py, about 30 s): optamp's against torch's,
# per pass and dtype; its lines go to the summary.
# shellcheck disable=SC2086
run_softmax_kernels() {
  phase softmax_kernels "$PY" benchmarks/bench_softmax_kernels.py \
    --device "${GPU_CHECK_DEVICE:-cuda}" ${GPU_CHECK_SOFTMAX_KERNELS_ARGS:-}
  while IFS= read -r line; do targets+=("- softmax_kernels: $line"); done < <(
    grep -E '^(log_softmax|cross_entropy|softmax) ' "$LOGS/softmax_kernels.log")
  write_summary
}
# The loss's kernels under Nsight Compute (ncu, where the machine has it and can read the
# counters): each kernel's duration, memory and SM throughput and what its warps wait on, so that
# a kernel below the memory's speed is explained from counters, not from timings alone. One round
# of the softmax kernels' benchmark, the first GPU_CHECK_PROFILE_LAUNCHES (default 4: the bf16
# loss's forward, twice, its backward, the forward again) launches of the kernels matching
# GPU_CHECK_PROFILE_KERNELS (default fused_cross_entropy: its forward's reduction is
# log_softmax's too); the clocks as the card has them (--clock-control none).
run_kernel_profile() {
  if ! command -v ncu >/dev/null; then
    rows+=("| kernel_profile | not run: no ncu on this machine | 0 | 0 | 0 | 0 |")
    return 0
  fi
  # At most what is left of the budget: a call sized to the budget must not end inside ncu.
  phase_time kernel_profile "${GPU_CHECK_PROFILE_SECONDS:-120}" 30 10 || return 0
  # shellcheck disable=SC2086
  phase kernel_profile timeout --kill-after=10 "$phase_limit" \
    ncu --clock-control none --target-processes all \
    -k "regex:${GPU_CHECK_PROFILE_KERNELS:-fused_cross_entropy}" \
    -c "${GPU_CHECK_PROFILE_LAUNCHES:-4}" --section SpeedOfLight --section WarpStateStats \
    --section Occupancy "$PY" benchmarks/bench_softmax_kernels.py --rounds 1 --reps 1 \
    ${GPU_CHECK_SOFTMAX_KERNELS_ARGS:-}
  local metrics='Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput'
  metrics+='|Achieved Occupancy|Warp Cycles Per Issued Instruction'
  while IFS= read -r line; do targets+=("- kernel_profile: $line"); done < <(
    grep -v '^==PROF==' "$LOGS/kernel_profile.log" | grep -E "_kernel|^ +($metrics) " |
      sed -E 's/^ +//; s/ {2,}/ /g' | cut -c1-160)
  write_summary
}
run_ab() {
  # shellcheck disable=SC2086
  phase ab bash scripts/ab_test.sh --device "${GPU_CHECK_DEVICE:-cuda}" "${data_args[@]}" \
    --out "$LOGS/ab" ${GPU_CHECK_AB_ARGS:---levels O0,O1,O2,O3,O4,O5 --steps 300}
  [[ -f "$LOGS/ab/summary.md" ]] && cp "$LOGS/ab/summary.md" "$LOGS/ab_summary.md"
}
# The compute-bound workload (docs/char_gpt.md, gpu preset) through the A/B runner: where AMP's
# speed shows; one seed per level, the per-op precision table of its first 2 steps.
run_ab_char_gpt() {
  # shellcheck disable=SC2086
  phase ab_char_gpt "$PY" -m optamp.ab --no-progress --out "$LOGS/ab_char_gpt" \
    ${GPU_CHECK_CHAR_GPT_AB_ARGS:---levels O0,O1,O2,O4,O5 --seeds 1 --precision-steps 2} -- \
    "$OPTAMP_BUILD_DIR/examples/cpp/train_char_gpt" --device "${GPU_CHECK_DEVICE:-cuda}" \
    ${GPU_CHECK_CHAR_GPT_ARGS:---steps 200}
  [[ -f "$LOGS/ab_char_gpt/summary.md" ]] &&
    cp "$LOGS/ab_char_gpt/summary.md" "$LOGS/ab_char_gpt_summary.md"
}
# The CPU tests last (CI runs them on every change).
run_pytest_cpu() { pytest_phase pytest_cpu "" -m "not needs_cuda"; }

export PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
# GPU_CHECK_PHASES: which phases, in order. By default the CUDA tests come first (if time runs
# out, their result is already in) and the CPU tests last.
all_phases=bootstrap,build,ctest,cmake_compat,pytest_cuda,softmax_kernels,kernel_profile
all_phases+=,benchmarks,ab,ab_char_gpt,pytest_cpu
IFS=, read -r -a phases <<<"${GPU_CHECK_PHASES:-$all_phases}"
PY=""
for name in "${phases[@]}"; do
  if [[ -z "$PY" && "$name" != bootstrap ]]; then
    PY="$(optamp_python)"
    # shellcheck disable=SC2206
    pytest_cmd=("$PY" -m pytest tests/python -q -rs -p no:cacheprovider ${PYTEST_ARGS:-})
  fi
  case ",$all_phases," in
    *",$name,"*) "run_$name" ;;
    *) echo "gpu_check: unknown phase $name (phases: $all_phases)" >&2; exit 2 ;;
  esac
done
write_summary
cat "$OUT/summary.md"
[[ $failed -eq 0 ]]
