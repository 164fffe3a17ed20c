#!/usr/bin/env bash
# The main job: train the Fashion-MNIST CNN at several opt levels on several seeds (same seed:
# same initial weights and data order at every level) and compare each level with the baseline
# seed by seed against the baseline's own seed-to-seed spread (test accuracy, final train loss,
# step time, loss-curve divergence; peak memory, loss scale).
#
#   bash scripts/ab_test.sh                    # CPU: O0 (baseline), O1, O2, O4, O5, C++ trainer
#   bash scripts/ab_test.sh --full             # train 10 epochs (to convergence), one seed
#   bash scripts/ab_test.sh --device cuda      # on a GPU machine
#   bash scripts/ab_test.sh --levels O0,O4,O5 --seeds 8 --steps 600 --python
#
# Options: --levels L1,L2,..  (default O0,O1,O2 on cuda; O0,O1,O2,O4,O5 on cpu; the baseline is
#                              O0 when listed, else the first)
#          --device cpu|cuda  --seeds N|S1,S2,.. (cpu 5, cuda 3)  --seed N (one seed: N)
#          --steps N (cpu 400, cuda 1000)  --slow-steps N (100)  --slow-seeds N (3)
#          --slow-levels auto|none|L1,.. (auto: on a CPU the fp16 levels, and the bf16 ones
#                              when the CPU has no bf16 instructions: they get the slow budget)
#          --epochs E (every level E epochs, test set after each; no slow budget; 1 seed
#                      unless --seeds)  --full (= --epochs 10)
#          --batch-size N (64)  --lr X (0.02)  --lr-schedule cosine|constant (cosine: decays to 0
#                      over each run; the baseline runs every shorter budget too)
#          --subset N (first N training images)  --test-subset N
#          --data DIR  --python (examples/python/train_fashion_mnist.py instead of the C++ binary)
#          --out DIR (default results/ab)  --no-build  --bin PATH (a prebuilt trainer)
# Every run first calls scripts/bootstrap.sh (idempotent, seconds once the machine is set up), so
# on a fresh machine this command is all it takes. Before training it prints the CPU's bf16/fp16
# instructions (what decides whether O4/O5 can be fast) and the budget of every level.
# Writes OUT/summary.md, OUT/summary.json, OUT/ab.png, OUT/plan.json and per run
# OUT/<level>-s<seed>.{jsonl,log,err,status} (the baseline's shorter budgets: <level>-s<seed>-n<steps>).
# Exit status: 0 when every run finished or its level reported itself unsupported, 1 otherwise.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

device=cpu batch=64 lr="" subset=0 test_subset=0 data="" python=0 out="results/ab" build=1 bin=""
plan_args=()
usage() { sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --levels|--steps|--seeds|--slow-steps|--slow-seeds|--slow-levels|--epochs|--lr-schedule)
      [[ $# -ge 2 ]] || { echo "ab_test.sh: $1 needs a value" >&2; exit 2; }
      plan_args+=("$1" "$2"); shift 2 ;;
    --seed) plan_args+=(--seeds "$2,"); shift 2 ;;
    --full) plan_args+=(--epochs 10); shift ;;
    --device) device="$2"; shift 2 ;;
    --batch-size) batch="$2"; shift 2 ;;
    --lr) lr="$2"; shift 2 ;;
    --subset) subset="$2"; shift 2 ;;
    --test-subset) test_subset="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --python) python=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ab_test.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ "$device" != cpu && "$device" != cuda ]]; then
  echo "ab_test.sh: --device must be cpu or cuda, got \"$device\"" >&2; exit 2
fi
has_levels=0
for a in "${plan_args[@]}"; do [[ "$a" == --levels ]] && has_levels=1; done
if [[ $has_levels -eq 0 ]]; then
  [[ "$device" == cuda ]] && plan_args+=(--levels O0,O1,O2) || plan_args+=(--levels O0,O1,O2,O4,O5)
fi

bash "$OPTAMP_ROOT/scripts/bootstrap.sh" ||
  { echo "ab_test.sh: scripts/bootstrap.sh failed; see its messages above" >&2; exit 1; }
PY="$(optamp_python)" || { echo "ab_test.sh: no Python with torch (scripts/bootstrap.sh)" >&2; exit 1; }

# The plan first: a bad option fails here, before the build. It prints the CPU's features and
# every level's budget, and writes OUT/plan.json and OUT/runs.tsv.
mkdir -p "$out"
rm -f "$out"/O?-s*.jsonl "$out"/O?-s*.log "$out"/O?-s*.err "$out"/O?-s*.status \
      "$out"/O?.jsonl "$out"/O?.log "$out"/O?.err "$out"/O?.status \
      "$out"/summary.* "$out"/ab.png "$out"/plan.json "$out"/runs.tsv
PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m optamp.ab.plan --out "$out" --device "$device" --batch-size "$batch" \
  --subset "$subset" "${plan_args[@]}" || exit 2

if [[ $build -eq 1 && -z "$bin" ]]; then
  echo "ab_test.sh: building (scripts/common.sh optamp_build) ..."
  optamp_build >/tmp/optamp-ab-build.log 2>&1 ||
    { tail -30 /tmp/optamp-ab-build.log; echo "ab_test.sh: build failed (log: /tmp/optamp-ab-build.log)" >&2; exit 1; }
fi

if [[ $python -eq 1 ]]; then
  trainer=("$PY" "$OPTAMP_ROOT/examples/python/train_fashion_mnist.py")
  export PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
else
  bin="${bin:-$(optamp_build_dir)/examples/cpp/train_fashion_mnist}"
  if [[ ! -x "$bin" ]]; then
    echo "ab_test.sh: no trainer binary at $bin: build the project (drop --no-build; the" \
         "examples are on by default, OPTAMP_BUILD_EXAMPLES=ON), pass --bin PATH, or use --python." >&2
    exit 1
  fi
  trainer=("$bin")
fi

args=(--device "$device" --batch-size "$batch" --subset "$subset" --test-subset "$test_subset")
[[ -n "$lr" ]] && args+=(--lr "$lr")
[[ -n "$data" ]] && args+=(--data "$data")

# The runs, through the same runner as any program's A/B (python -m optamp.ab): seed by seed,
# OPTAMP_OPT_LEVEL / OPTAMP_SEED / OPTAMP_AB_METRICS in the environment, each run's budget from
# runs.tsv; its progress line on stderr, then the report (summary.md/json, ab.png).
start=$SECONDS
PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m optamp.ab --plan "$out/runs.tsv" \
  --out "$out" -- "${trainer[@]}" "${args[@]}"
status=$?
echo "ab_test.sh: took $((SECONDS / 60)) min $((SECONDS % 60)) s in all ($((SECONDS - start)) s of" \
     "training runs); report: $out/summary.md, $out/summary.json, $out/ab.png"
exit $status
