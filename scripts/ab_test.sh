#!/usr/bin/env bash
# The main job: train the Fashion-MNIST CNN with the same seed, data and steps at several opt
# levels and compare them (step time, samples/s, peak memory, loss, accuracy, loss scale).
#
#   bash scripts/ab_test.sh                    # O0 (baseline), O1, O2, O4, O5 on the CPU, C++ trainer
#   bash scripts/ab_test.sh --device cuda      # on a GPU machine
#   bash scripts/ab_test.sh --levels O0,O4,O5 --steps 400 --python
#
# Options: --levels L1,L2,..  (default O0,O1,O2 on cuda; O0,O1,O2,O4,O5 on cpu, where fp16 has no
#                              fast kernels and the bf16 twins show the speed; the first is the baseline)
#          --device cpu|cuda  --steps N (default 300 on cpu, 1000 on cuda)  --batch-size N (64)  --seed N (0)
#          --lr X  --subset N (first N training images)  --test-subset N  --data DIR
#          --python (run examples/python/train_fashion_mnist.py instead of the C++ binary)
#          --out DIR (default results/ab)  --no-build  --bin PATH (a prebuilt trainer)
# Every run first calls scripts/bootstrap.sh (idempotent, seconds once the machine is set up), so
# on a fresh machine this command is all it takes.
# Writes OUT/summary.md, OUT/summary.json, OUT/ab.png and per level OUT/<level>.{jsonl,log,err,status}.
# Exit status: 0 when every level ran or reported itself unsupported, 1 otherwise.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

levels="" device=cpu steps="" batch=64 seed=0 lr="" subset=0 test_subset=0
data="" python=0 out="results/ab" build=1 bin=""
usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --levels) levels="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch-size) batch="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
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

bash "$OPTAMP_ROOT/scripts/bootstrap.sh" ||
  { echo "ab_test.sh: scripts/bootstrap.sh failed; see its messages above" >&2; exit 1; }
PY="$(optamp_python)" || { echo "ab_test.sh: no Python with torch (scripts/bootstrap.sh)" >&2; exit 1; }
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

# fp16 kernels on a CPU are slow: 80-475 ms a step for this CNN on 2 cores, 4.7-25.6x O0,
# depending on the CPU (docs/ab_test.md has the numbers). Keep the default CPU run short (300
# steps: up to about 2.5 min per fp16 level) so the five default levels finish inside 10 minutes;
# GPUs run a real schedule.
if [[ -z "$steps" ]]; then [[ "$device" == cuda ]] && steps=1000 || steps=300; fi
if [[ -z "$levels" ]]; then [[ "$device" == cuda ]] && levels="O0,O1,O2" || levels="O0,O1,O2,O4,O5"; fi
args=(--device "$device" --steps "$steps" --batch-size "$batch" --seed "$seed"
      --subset "$subset" --test-subset "$test_subset")
[[ -n "$lr" ]] && args+=(--lr "$lr")
[[ -n "$data" ]] && args+=(--data "$data")

mkdir -p "$out"
rm -f "$out"/O?.jsonl "$out"/O?.log "$out"/O?.err "$out"/O?.status "$out"/summary.* "$out"/ab.png
status=0
IFS=',' read -r -a level_list <<<"$levels"
start=$SECONDS
for level in "${level_list[@]}"; do
  echo "== $level: ${trainer[*]##*/} --opt-level $level ${args[*]}"
  t0=$SECONDS
  # stdout (properties report, summary line) -> LEVEL.log; stderr -> LEVEL.err and the terminal,
  # with the trainer's progress line when the terminal is a TTY.
  OPTAMP_PROGRESS=$([[ -t 2 ]] && echo 1 || echo 0) \
    "${trainer[@]}" --opt-level "$level" "${args[@]}" --metrics "$out/$level.jsonl" \
    >"$out/$level.log" 2> >(tee "$out/$level.err" >&2)
  rc=$?
  wait  # for tee
  msg="$(tr '\r' '\n' <"$out/$level.err" | grep -v '^\s*$' | tail -1 | sed 's/\\/\\\\/g; s/"/\\"/g')"
  case $rc in
    0) st=ok; grep '^summary:' "$out/$level.log" ;;
    3) st=unsupported; msg="${msg##*unsupported: }"; echo "   $level unsupported: $msg" ;;
    *) st=failed; status=1; echo "   $level FAILED (exit $rc); log: $out/$level.log" >&2 ;;
  esac
  printf '{"status": "%s", "exit_code": %d, "message": "%s", "seconds": %d}\n' \
    "$st" "$rc" "$msg" "$((SECONDS - t0))" >"$out/$level.status"
done

"$PY" "$OPTAMP_ROOT/scripts/ab_report.py" --out "$out" --levels "$levels" || status=1
echo "ab_test.sh: ran in $((SECONDS - start)) s; report: $out/summary.md, $out/summary.json, $out/ab.png"
exit $status
