#!/usr/bin/env bash
# Builds and runs the dispatch-overhead benchmark, then prints the target ratios.
#   bash benchmarks/dispatch_overhead.sh [extra benchmark args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
BUILD="$(optamp_build_dir)"
OPTAMP_CMAKE_ARGS="-DOPTAMP_BUILD_BENCHMARKS=ON" optamp_build >/dev/null
cmake "$BUILD" -DOPTAMP_BUILD_BENCHMARKS=ON >/dev/null && cmake --build "$BUILD" --target bench_dispatch >/dev/null
if [[ "${1:-}" == "--icount" ]]; then
  # Deterministic instruction counts under callgrind (20-60 s per configuration): every op case
  # without amp, with native bf16 autocast and at O4/O5; mm cases in fp16 (native, O1, O2); a
  # whole backward of the CNN and of a small GPT at O4 and O5; a whole GPT training step (fused
  # AdamW) without amp, native fp16/bf16 + GradScaler's work and O1/O2/O4/O5. Extra arguments:
  # only those configurations ("optamp_o5:relu ...").
  cmake --build "$BUILD" --target dispatch_icount >/dev/null
  shift
  configs=("$@")
  if [[ ${#configs[@]} -eq 0 ]]; then
    for c in relu mm mm_param add_param add_param_bf16 add_mixed linear; do
      for m in noamp native optamp_o4 optamp_o5; do configs+=("$m:$c"); done
    done
    for c in mm mm_param; do
      for m in native_fp16 optamp_o1 optamp_o2; do configs+=("$m:$c"); done
    done
    for c in cnn_backward gpt_backward cnn_backward_accum gpt_backward_accum; do
      for m in noamp optamp_o4 optamp_o5; do configs+=("$m:$c"); done
    done
    for m in noamp native_fp16 optamp_o1 optamp_o2 native optamp_o4 optamp_o5; do
      configs+=("$m:gpt_step")
    done
  fi
  ir_of() {  # inclusive Ir of a function in an annotated callgrind output
    grep -F "$2" "$1" | grep -v constprop | head -1 | awk '{gsub(",","",$1); print $1}'
  }
  for cfg in "${configs[@]}"; do
    mode="${cfg%%:*}" case="${cfg##*:}" n=200
    [[ "$case" == *_backward* ]] && n=10
    [[ "$case" == *_step ]] && n=5
    f="$(mktemp)"
    valgrind --tool=callgrind --callgrind-out-file="$f" "$BUILD/benchmarks/dispatch_icount" \
      "$mode" "$case" "$n" >/dev/null 2>&1
    callgrind_annotate --inclusive=yes --threshold=100 "$f" >"$f.txt"
    f="$f.txt"
    per_call=$(( ($(ir_of "$f" "::run<2>(int)") -
                  $(ir_of "$f" "::run<1>(int)")) / n ))
    line="instructions/call $mode $case: $per_call"
    if [[ "$case" == *_backward* ]]; then
      bwd=$(( ($(ir_of "$f" "::backward<2>(") - $(ir_of "$f" "::backward<1>(")) / n ))
      line+=" (backward alone: $bwd)"
    fi
    echo "$line"
    rm -f "$f" "${f%.txt}"
  done
  exit 0
fi
out="$(mktemp)"
"$BUILD/benchmarks/bench_dispatch" --benchmark_repetitions=10 --benchmark_report_aggregates_only=true \
  --benchmark_enable_random_interleaving=true --benchmark_format=json "$@" >"$out"
"$(optamp_python)" - "$out" <<'PY'
import json, sys
rows = {b["run_name"]: b["real_time"] for b in json.load(open(sys.argv[1]))["benchmarks"]
        if b.get("aggregate_name") == "median"}
a_mm, a_relu = rows["BM_NoAmp/relu:0"], rows["BM_NoAmp/relu:1"]
b_mm, c_mm, d_relu = rows["BM_NativeAutocast/relu:0"], rows["BM_Optamp/relu:0"], rows["BM_Optamp/relu:1"]
print("median ns/call: no amp mm %.0f relu %.0f | native autocast mm %.0f | optamp mm %.0f relu %.0f"
      % (a_mm, a_relu, b_mm, c_mm, d_relu))
print("(d)/(a) unlisted op overhead: %.3f   (target <= 1.03)" % (d_relu / a_relu))
print("(c)-(a) = %.0f ns vs 1.25*((b)-(a)) = %.0f ns   ratio %.2f (target <= 1.25)"
      % (c_mm - a_mm, 1.25 * (b_mm - a_mm), (c_mm - a_mm) / (b_mm - a_mm)))
PY
