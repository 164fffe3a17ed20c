#!/usr/bin/env bash
# CPU: the Fashion-MNIST CNN training step at O0, O4, O5 (bf16; AMX on CPUs that have it) and
# O1, O2 (fp16, slow on CPU: few steps), interleaved round by round, using the example trainer
# build/examples/cpp/train_fashion_mnist. Prints median step times, the ratio to O0 measured in
# the same round (median over rounds; > 1 means faster than O0), and the load average.
#
#   bash benchmarks/cpu_fashion_mnist.sh [ROUNDS=3] [BF16_STEPS=60] [FP16_STEPS=12]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
ROUNDS="${1:-3}" BF16_STEPS="${2:-60}" FP16_STEPS="${3:-12}"
BUILD="$(optamp_build_dir)"
optamp_build >/dev/null
BIN="$BUILD/examples/cpp/train_fashion_mnist"
out="$(mktemp -d)"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
levels=(O0 O4 O5 O1 O2)
for ((r = 1; r <= ROUNDS; r++)); do
  for ((k = 0; k < ${#levels[@]}; k++)); do
    lvl="${levels[$(((k + r) % ${#levels[@]}))]}"
    steps=$BF16_STEPS
    [[ $lvl == O1 || $lvl == O2 ]] && steps=$FP16_STEPS
    # O0 also runs the fp16 step count, so the fp16 ratios compare equal-length runs.
    for n in $steps $([[ $lvl == O0 ]] && echo "$FP16_STEPS"); do
      "$BIN" --opt-level "$lvl" --steps "$n" --subset 8192 --test-subset 1000 \
        --metrics "$out/$lvl.$n.r$r.jsonl" >/dev/null
    done
  done
  echo "round $r done; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$(optamp_python)" - "$out" "$ROUNDS" "$BF16_STEPS" "$FP16_STEPS" <<'PY'
import json, statistics, sys
out, rounds, nb, nf = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def summary(lvl, n, r):
    for line in open(f"{out}/{lvl}.{n}.r{r}.jsonl"):
        d = json.loads(line)
        if d["type"] == "summary":
            return d
print("\n| level | dtype | steps | median step ms | peak RSS MB | speed vs O0 (same round) |")
print("|---|---|---|---|---|---|")
for lvl, dt, n in (("O0", "fp32", nb), ("O4", "bf16", nb), ("O5", "bf16", nb),
                   ("O0", "fp32", nf), ("O1", "fp16", nf), ("O2", "fp16", nf)):
    s = [summary(lvl, n, r) for r in range(1, rounds + 1)]
    ref = [summary("O0", n, r) for r in range(1, rounds + 1)]
    ms = statistics.median(x["median_step_ms"] for x in s)
    mem = statistics.median(x["peak_memory_mb"] for x in s)
    ratio = statistics.median(b["median_step_ms"] / a["median_step_ms"] for a, b in zip(s, ref))
    print(f"| {lvl} | {dt} | {n} | {ms:.2f} | {mem:.0f} | {ratio:.2f}x |")
PY
