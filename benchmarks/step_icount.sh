#!/usr/bin/env bash
# Host instructions per training step under callgrind, C++ (dispatch_icount gpt_step) and Python
# (step_icount.py), for every mode or the ones named: "cpp:optamp_o1 py:O1 ...".
#   bash benchmarks/step_icount.sh [side:mode ...]
# C++ modes: noamp native_fp16 optamp_o1 optamp_o2 native optamp_o4 optamp_o5 (native = bf16);
# Python modes: fp32 native_fp16 native_bf16 O1 O2 O4 O5. About a minute per mode on 2 cores.
# STEP_ICOUNT_LAYERS=12: the model at GPT-2 small's depth (default 2 layers; about 5x the time).
# STEP_ICOUNT_CPP_CASE=gpt_step_adamw: the C++ step with LibTorch's own AdamW (one host read of
# the overflow flag per step on both sides) instead of a fused AdamW that skips on the device.
# ResNet-50's layout at width 2 instead of the GPT: STEP_ICOUNT_CPP_CASE=resnet_step (C++) and
# STEP_ICOUNT_MODEL=resnet50 (Python); about 8 minutes per mode.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
BUILD="$(optamp_build_dir)"
PY="$(optamp_python)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
configs=("$@")
if [[ ${#configs[@]} -eq 0 ]]; then
  for m in noamp native_fp16 optamp_o1 optamp_o2 native optamp_o4 optamp_o5; do configs+=("cpp:$m"); done
  for m in fp32 native_fp16 O1 O2 native_bf16 O4 O5; do configs+=("py:$m"); done
fi
if printf '%s\n' "${configs[@]}" | grep -q '^cpp:'; then
  OPTAMP_CMAKE_ARGS="-DOPTAMP_BUILD_BENCHMARKS=ON" optamp_build >/dev/null
  cmake "$BUILD" -DOPTAMP_BUILD_BENCHMARKS=ON >/dev/null
  cmake --build "$BUILD" --target dispatch_icount >/dev/null
fi
ir_of() {  # inclusive Ir of the first function whose line contains $2
  grep -F "$2" "$1" | grep -v constprop | head -1 | awk '{gsub(",","",$1); print $1}'
}
n=5
for cfg in "${configs[@]}"; do
  side="${cfg%%:*}" mode="${cfg##*:}"
  f="$(mktemp)"
  if [[ "$side" == cpp ]]; then
    valgrind --tool=callgrind --callgrind-out-file="$f" "$BUILD/benchmarks/dispatch_icount" \
      "$mode" "${STEP_ICOUNT_CPP_CASE:-gpt_step}" "$n" >/dev/null 2>&1

  else
    PYTHONHASHSEED=0 PYTHONPATH="$ROOT/python" valgrind --tool=callgrind --collect-atstart=no \
      --toggle-collect=_operator_call --callgrind-out-file="$f" \
      "$PY" "$ROOT/benchmarks/step_icount.py" "$mode" "$n" >/dev/null 2>&1
  fi
  callgrind_annotate --inclusive=yes --threshold=100 "$f" >"$f.txt"
  if [[ "$side" == cpp ]]; then
    per_step=$(( ($(ir_of "$f.txt" "::run<2>(int)") - $(ir_of "$f.txt" "::run<1>(int)")) / n ))
  else  # only the n steps were collected
    per_step=$(( $(ir_of "$f.txt" "PROGRAM TOTALS") / n ))
    if (( per_step < 100000 )); then  # nothing (or next to nothing) was collected
      echo "step_icount: callgrind collected $per_step instructions per Python step: this" \
        "Python's library shows no symbol _operator_call (stripped?), which marks the steps" >&2
      exit 1
    fi
  fi
  echo "instructions/step $side $mode: $per_step"
  if [[ -n "${OPTAMP_KEEP_CALLGRIND:-}" ]]; then
    mkdir -p "$OPTAMP_KEEP_CALLGRIND" && cp "$f" "$OPTAMP_KEEP_CALLGRIND/$side-$mode.out"
  fi
  rm -f "$f" "$f.txt"
done
