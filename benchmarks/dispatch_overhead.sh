#!/usr/bin/env bash
# Builds and runs the dispatch-overhead benchmark, then prints the target ratios.
#   bash benchmarks/dispatch_overhead.sh [extra benchmark args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
BUILD="$(optamp_build_dir)"
OPTAMP_CMAKE_ARGS="-DOPTAMP_BUILD_BENCHMARKS=ON" optamp_build >/dev/null
cmake "$BUILD" -DOPTAMP_BUILD_BENCHMARKS=ON >/dev/null && cmake --build "$BUILD" --target bench_dispatch >/dev/null
if [[ "${1:-}" == "--icount" ]]; then
  # Deterministic instruction counts under callgrind (about a minute per configuration).
  cmake --build "$BUILD" --target dispatch_icount >/dev/null
  declare -A ir
  for cfg in noamp:mm noamp:relu native:mm optamp:mm optamp:relu optamp_o5:relu \
             native_fp16:mm optamp_o1:mm; do
    f="$(mktemp)"
    valgrind --tool=callgrind --callgrind-out-file="$f" "$BUILD/benchmarks/dispatch_icount" \
      "${cfg%%:*}" "${cfg##*:}" 200 >/dev/null 2>&1
    small=$(callgrind_annotate --inclusive=yes --threshold=100 "$f" | grep "::loop_n(int)" | awk '{gsub(",","",$1); print $1}')
    large=$(callgrind_annotate --inclusive=yes --threshold=100 "$f" | grep "::loop_2n(int)" | awk '{gsub(",","",$1); print $1}')
    ir[$cfg]=$(( (large - small) / 200 ))
    echo "instructions/call $cfg: ${ir[$cfg]}"
  done
  awk -v a="${ir[noamp:mm]}" -v ar="${ir[noamp:relu]}" -v b="${ir[native:mm]}" \
      -v c="${ir[optamp:mm]}" -v d="${ir[optamp:relu]}" -v e="${ir[optamp_o5:relu]}" \
      -v b16="${ir[native_fp16:mm]}" -v c16="${ir[optamp_o1:mm]}" 'BEGIN {
    printf "(d)/(a) unlisted op: %.3f (target <= 1.03)\n", d / ar;
    printf "bf16: (c)-(a) = %d vs (b)-(a) = %d instructions: ratio %.2f (target <= 1.25)\n", c - a, b - a, (c - a) / (b - a);
    printf "fp16, O1 vs native fp16 autocast: (c)-(a) = %d vs (b)-(a) = %d instructions: ratio %.2f (target <= 1.25)\n", c16 - a, b16 - a, (c16 - a) / (b16 - a);
    printf "(e)/(a) unlisted op at O5 (substitution fallback, boxed): %.3f (no target; see docs/benchmarks.md)\n", e / ar }'
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
