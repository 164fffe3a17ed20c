"""Plans the runs of scripts/ab_test.sh (the Fashion-MNIST job): the budget (steps or epochs) and seeds of each level,
and what this CPU offers for reduced precision.

    python -m optamp.ab.plan --out OUT --levels O0,O1,O2,O4,O5 --device cpu [--steps N]
        [--seeds N|S1,S2,..] [--slow-steps N] [--slow-seeds N] [--slow-levels auto|none|L,..]
        [--epochs E] [--lr-schedule constant|cosine] [--batch-size B] [--subset N]

Writes OUT/plan.json and OUT/runs.tsv (the runner's --plan: one run a line, seed by seed so
that a level's run and the baseline's run of the same seed are close in time: level, seed, run
name, then the arguments the run adds to the trainer's command, tab-separated) and prints the
plan, CPU features first. A run's files are OUT/<run name>.*: <level>-s<seed>, or <level>-s<seed>-n<steps> for
the baseline's runs at a shorter budget.

Budgets (docs/ab_test.md). Levels without fast kernels on this device ("slow": on a CPU the
fp16 levels O1-O3 always, since torch has no fast fp16 CPU convolutions, and O4/O5 when the CPU
has no bf16 instructions) get --slow-steps and the first --slow-seeds seeds; the others get
--steps and every seed. The baseline (O0 when listed, else the first level) runs the largest
budget on every seed, and each shorter budget on that budget's seeds, so every level is compared
with the baseline trained for the same number of steps (the learning rate decays to 0 over each
run: a cosine schedule, unless --lr-schedule constant). With --epochs every level trains that
many epochs (no slow budget) and the test set is also evaluated after each epoch.
"""
import argparse
import json
import os
import sys
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

FP16_LEVELS = ("O1", "O2", "O3")
BF16_LEVELS = ("O4", "O5")
TRAIN_IMAGES = 60000  # Fashion-MNIST's training split
DEFAULTS = {  # device -> steps, seeds, slow steps, slow seeds
    "cpu": {"steps": 400, "seeds": 5, "slow_steps": 100, "slow_seeds": 3},
    "cuda": {"steps": 1000, "seeds": 3, "slow_steps": 1000, "slow_seeds": 3},
}
WATCHED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16",
                 "amx_fp16")


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> Dict[str, Any]:
    """{model, flags: {flag: bool} for WATCHED_FLAGS, bf16, fp16, bf16_note, fp16_note};
    flags None where the CPU's flags cannot be read (not Linux)."""
    model = "unknown CPU"
    flags: Optional[Set[str]] = None
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key == "flags" and flags is None:
                    flags = set(value.split())
    except OSError:
        pass
    out: Dict[str, Any] = {
        "model": model,
        "flags": None if flags is None else {f: f in flags for f in WATCHED_FLAGS}}
    out.update(classify_cpu(out["flags"]))
    return out


def classify_cpu(flags: Optional[Mapping[str, bool]]) -> Dict[str, str]:
    """What the flags mean for the bf16 levels (O4/O5) and the fp16 levels (O1-O3) on a CPU."""
    if flags is None:
        return {"bf16": "unknown", "fp16": "unknown",
                "bf16_note": "CPU flags unknown (no /proc/cpuinfo): bf16 speed not predicted",
                "fp16_note": "fp16 has no fast CPU kernels in torch: O1/O2/O3 are slow"}
    if flags["amx_bf16"] and flags["amx_tile"]:
        bf16 = ("amx", "AMX-BF16: oneDNN runs bf16 convolutions and matmuls on AMX tiles, "
                "which make bf16 faster than fp32: O4/O5 can beat O0")
    elif flags["avx512_bf16"]:
        bf16 = ("avx512_bf16", "AVX512-BF16 without AMX: bf16 dot products, whose speed "
                "against fp32 depends on the CPU (measured: this CNN's O4/O5 0.69-0.74x O0's "
                "step time on an AMD EPYC Zen 4, 1.02-1.23x on an Intel Xeon; native autocast "
                "alike): the run says which")
    else:
        bf16 = ("emulated", "no bf16 instructions: bf16 ops convert to fp32 and back, as slow "
                "as fp16 here (measured 4.5-4.8x O0's step time on an AVX2-only CPU): O4/O5 get "
                "the slow budget")
    fp16 = ("amx_fp16" if flags["amx_fp16"] else
            "avx512_fp16" if flags["avx512_fp16"] else "none")
    if fp16 == "none":
        fp16_note = ("no AVX512-FP16: torch runs fp16 convolutions in its own kernels, "
                     "not oneDNN (measured 4.7x O0's step time on an AVX2-only CPU): O1/O2/O3 "
                     "get the slow budget")
    else:
        fp16_note = ("torch hands fp16 convolutions to oneDNN, whose fp16 weight gradient ran "
                     "as reference code on the Xeons measured (AVX512-FP16 without AMX-FP16: "
                     "32-47x O0's step time): O1/O2/O3 get the slow budget")
    return {"bf16": bf16[0], "bf16_note": bf16[1], "fp16": fp16, "fp16_note": fp16_note}


def describe_cpu(cpu: Mapping[str, Any]) -> str:
    """Two lines for the terminal and the report."""
    f = cpu["flags"]
    if f is None:
        return f"CPU: {cpu['model']}; flags unknown.\n  {cpu['bf16_note']}."

    def yes(name: str) -> str:
        return f"{name} {'yes' if f[name] else 'no'}"
    return (f"CPU: {cpu['model']} ({yes('avx2')}, {yes('avx512f')})\n"
            f"  bf16: {yes('avx512_bf16')}, {yes('amx_bf16')} -> {cpu['bf16_note']}.\n"
            f"  fp16: {yes('avx512_fp16')}, {yes('amx_fp16')} -> {cpu['fp16_note']}.")


def parse_seeds(text: str) -> List[int]:
    """'5' -> [0, 1, 2, 3, 4]; '3,7' -> [3, 7]; '4,' -> [4]."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError
            return list(range(n))
        seeds = [int(p) for p in parts if p]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"--seeds takes a count >= 1 or distinct seeds >= 0 separated by commas, got "
            f"\"{text}\"")
    return seeds


def slow_levels(spec: str, levels: Sequence[str], device: str,
                cpu: Mapping[str, Any]) -> List[str]:
    """The levels that get the slow budget: --slow-levels auto (by device and CPU), none, or a
    list."""
    if spec == "none":
        return []
    if spec != "auto":
        return [lv for lv in spec.split(",") if lv]
    if device != "cpu":
        return []
    slow = [lv for lv in levels if lv in FP16_LEVELS]
    if cpu["bf16"] == "emulated":
        slow += [lv for lv in levels if lv in BF16_LEVELS]
    return slow


def why_slow(level: str, cpu: Mapping[str, Any]) -> str:
    return "fp16 on a CPU" if level in FP16_LEVELS else (
        "bf16 emulated on this CPU" if cpu["bf16"] == "emulated" else "named by --slow-levels")


def make_plan(a: argparse.Namespace, cpu: Dict[str, Any]) -> Dict[str, Any]:
    levels = [lv for lv in a.levels.split(",") if lv]
    baseline = "O0" if "O0" in levels else levels[0]
    defaults = DEFAULTS[a.device]
    seeds = a.seeds if a.seeds is not None else list(range(
        1 if a.epochs else defaults["seeds"]))
    n_train = min(a.subset, TRAIN_IMAGES) if a.subset else TRAIN_IMAGES
    per_epoch = n_train // min(a.batch_size, n_train)
    slow = [] if a.epochs else slow_levels(a.slow_levels, levels, a.device, cpu)
    steps = a.steps or defaults["steps"]
    slow_steps = min(steps, a.slow_steps or defaults["slow_steps"])
    slow_seeds = seeds[:a.slow_seeds or defaults["slow_seeds"]]
    rows: List[Dict[str, Any]] = []
    for lv in levels:
        row: Dict[str, Any] = {"level": lv, "baseline": lv == baseline,
                               "slow": lv in slow and lv != baseline}
        if a.epochs:
            row.update(epochs=a.epochs, steps=a.epochs * per_epoch, seeds=seeds,
                       eval_at=[per_epoch * e for e in range(1, a.epochs + 1)])
        else:
            row.update(steps=slow_steps if row["slow"] else steps,
                       seeds=slow_seeds if row["slow"] else seeds, eval_at=[])
        if row["slow"]:
            row["why_slow"] = why_slow(lv, cpu)
        rows.append(row)
    base = next(r for r in rows if r["baseline"])
    longest = max(r["steps"] for r in rows)
    base.update(steps=longest, seeds=seeds, extra=[])
    for short in sorted({r["steps"] for r in rows if r["steps"] < longest}):
        # The baseline at each shorter budget, on the seeds of the levels that run it.
        short_seeds = sorted({s for r in rows if r["steps"] == short for s in r["seeds"]})
        base["extra"].append({"steps": short, "seeds": short_seeds})
    schedule = a.lr_schedule or "cosine"
    return {"device": a.device, "mode": "epochs" if a.epochs else "steps", "lr_schedule": schedule,
            "epochs": a.epochs or None, "baseline": baseline, "seeds": seeds,
            "batch_size": a.batch_size, "train_images": n_train, "steps_per_epoch": per_epoch,
            "levels": rows, "cpu": cpu}


def run_name(level: str, seed: int, steps: Optional[int] = None) -> str:
    """A run's file name stem: <level>-s<seed>, or <level>-s<seed>-n<steps> for the baseline's
    runs at a shorter budget."""
    return f"{level}-s{seed}" + (f"-n{steps}" if steps else "")


def runs(plan: Mapping[str, Any]) -> Iterator[Tuple[str, int, str, List[str]]]:
    """(level, seed, run name, [extra trainer arguments]) in run order: seed by seed, levels in
    order, the baseline's shorter budgets after its main run."""
    schedule = ["--lr-schedule", plan["lr_schedule"]]
    for seed in plan["seeds"]:
        for r in plan["levels"]:
            if seed in r["seeds"]:
                budget = ["--epochs", str(r["epochs"])] if r.get("epochs") else [
                    "--steps", str(r["steps"])]
                evals = ["--eval-at", ",".join(map(str, r["eval_at"]))] if r["eval_at"] else []
                yield r["level"], seed, run_name(r["level"], seed), budget + evals + schedule
            for extra in r.get("extra", []):
                if seed in extra["seeds"]:
                    yield (r["level"], seed, run_name(r["level"], seed, extra["steps"]),
                           ["--steps", str(extra["steps"])] + schedule)


def seed_text(seeds: List[int]) -> str:
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def describe_plan(plan: Mapping[str, Any]) -> str:
    lines = [describe_cpu(plan["cpu"]) if plan["device"] == "cpu" else
             f"device {plan['device']}: the CPU's features do not matter for the step time.",
             f"Budget per level (learning rate: {plan['lr_schedule']}):"]
    for r in plan["levels"]:
        budget = (f"{r['epochs']} epochs ({r['steps']} steps)" if r.get("epochs") else
                  f"{r['steps']} steps")
        note = " (baseline)" if r["baseline"] else (
            f" (slow: {r['why_slow']})" if r["slow"] else "")
        evals = (f"; test set also at steps {','.join(map(str, r['eval_at']))}"
                 if r["eval_at"] and not r.get("epochs") else "")
        extra = "".join(f"; also {e['steps']} steps on seeds {seed_text(e['seeds'])} (for the "
                        "levels with that budget)" for e in r.get("extra", []))
        lines.append(f"  {r['level']}{note}: {budget} x batch {plan['batch_size']}, "
                     f"seeds {seed_text(r['seeds'])}{evals}{extra}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--levels", default="O0,O1,O2,O4,O5")
    p.add_argument("--device", default="cpu", choices=sorted(DEFAULTS))
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--seeds", type=parse_seeds, default=None)
    p.add_argument("--slow-steps", type=int, default=0)
    p.add_argument("--slow-seeds", type=int, default=0)
    p.add_argument("--slow-levels", default="auto")
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--subset", type=int, default=0)
    p.add_argument("--cpuinfo", default="/proc/cpuinfo", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("steps", "slow_steps", "slow_seeds", "epochs", "subset"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {a.batch_size}")
    if not [lv for lv in a.levels.split(",") if lv]:
        p.error(f"--levels names no level: \"{a.levels}\"")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    plan = make_plan(a, cpu_features(a.cpuinfo))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "plan.json"), "w") as f:
        json.dump(plan, f, indent=2)
        f.write("\n")
    with open(os.path.join(a.out, "runs.tsv"), "w") as f:
        for level, seed, name, args in runs(plan):
            f.write("\t".join([level, str(seed), name] + args) + "\n")
    print(describe_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
