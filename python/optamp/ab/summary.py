"""The A/B report: statistics, verdicts, summary.md/json and ab.png from the runs' metrics.

    python -m optamp.ab.summary --out results/ab [--levels O0,O1,O2]

Reads OUT/plan.json (written by the runner, ``python -m optamp.ab``, or by optamp.ab.plan for
the Fashion-MNIST job: levels, budgets, seeds, CPU features), OUT/<run>.jsonl (what the program
reported through optamp.ab.report / amp::ab::report, or the typed config/step/eval/summary lines
of the Fashion-MNIST trainers) and OUT/<run>.status (JSON: status ok|unsupported|failed|
diverged|timeout, message, exit_code, peak_rss_mb; written by the runner) for every run
<level>-s<seed> and the baseline's shorter budgets <level>-s<seed>-n<steps>, and writes
OUT/summary.md, OUT/summary.json and OUT/ab.png (matplotlib, Agg). Without plan.json the levels
come from --levels and the runs from the files found.

The baseline is O0 when it ran, else the first level that ran. Every level is compared with
the baseline seed by seed after the same number of steps (the baseline's run of that budget;
with a constant learning rate also its test pass at that step of a longer run), by the rule in
optamp.ab.stats (RULE, printed in the report), for each final metric the program reported and
the final train loss, and for the step time.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import sys
from typing import (TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set,
                    Tuple, cast)

from . import stats as ab_stats
from .plan import run_name

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Record = Dict[str, Any]  # a JSON-like record: a run, its status, a plan, a report row
Runs = Dict[int, Record]  # seed -> run
Specs = Sequence[Tuple[str, bool]]  # (metric, higher is better)
CurveSet = Tuple[str, str, Runs]  # label, level, {seed: run}

STEADY_SKIP = 5  # step times: the first 5 steps (warm-up) are left out when there are > 10
TAIL = 20  # final train loss: mean of the last 20 finite step losses


# ---- reading ----------------------------------------------------------------------------------
# Keys of a run's summary that describe the run rather than measure the model: never compared.
BOOKKEEPING = {"type", "step", "steps", "t", "seed", "opt_level", "epochs", "batch_size", "lr",
               "threads", "train_images", "test_images", "peak_memory_mb", "cuda_peak_mb",
               "median_step_ms", "samples_per_s", "final_train_loss", "skipped_steps",
               "final_loss_scale", "train_time_s", "loss_scale", "skipped", "step_ms", "loss",
               "params", "exit_code"}
# A metric is higher-is-better when its name says so (accuracy, throughput, ...), else lower
# (losses, bits per character, perplexity, error rates); --higher / --lower override.
HIGHER_WORDS = ("acc", "auc", "f1", "score", "precision", "recall", "bleu", "per_s", "throughput",
                "iou", "map")


def higher_is_better(name: str, directions: Optional[Mapping[str, Any]] = None) -> bool:
    if directions and name in directions:
        return bool(directions[name])
    return any(w in name.lower() for w in HIGHER_WORDS)


def finite_or_none(v: Any) -> Optional[float]:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        else None


def read_jsonl(path: str) -> Record:
    """{config, steps: [step objects], evals: {step: eval object}, summary} of a metrics file.

    Lines with "type" (config, step, eval, summary) are taken as they are. Lines written by
    optamp.ab.report carry no type: with "step" and "loss" they are a step, with "step" only an
    evaluation at that step, without "step" final values (summary and config both). A line that
    does not parse (a run killed while writing) ends the file."""
    run: Record = {"config": {}, "steps": [], "evals": {}, "summary": None}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                break
            kind = obj.get("type") or ("step" if "step" in obj and "loss" in obj else
                                       "eval" if "step" in obj else "final")
            if kind == "config":
                run["config"].update(obj)
            elif kind == "step":
                obj["loss"] = finite_or_none(obj.get("loss"))
                run["steps"].append(obj)
            elif kind == "eval":
                run["evals"].setdefault(obj["step"], {}).update(obj)
            elif kind == "summary":
                run["summary"] = dict(run["summary"] or {}, **obj)
            elif kind == "precision":
                run["precision"] = obj
            else:
                run["config"].update(obj)
                run["summary"] = dict(run["summary"] or {}, **obj)
    return run


def derive_summary(run: Record, status: Mapping[str, Any]) -> None:
    """Fills what a program did not report itself: step times from the reporter's time stamps,
    the step count, median step, final train loss, skipped steps, last loss scale, peak memory
    (the program's CUDA peak, else the peak RSS the runner measured), training time."""
    steps, summary = run["steps"], dict(run["summary"] or {})
    prev_t = None
    for s in steps:
        if s.get("step_ms") is None and s.get("t") is not None and prev_t is not None:
            s["step_ms"] = 1000.0 * (s["t"] - prev_t)
        prev_t = s.get("t", prev_t)
    summary.setdefault("steps", len(steps))
    summary.setdefault("median_step_ms", median_step_ms(run, len(steps)))
    summary.setdefault("final_train_loss", final_train_loss(run, len(steps)))
    if any("skipped" in s for s in steps):
        summary.setdefault("skipped_steps", sum(bool(s.get("skipped")) for s in steps))
    scales = [s["loss_scale"] for s in steps if s.get("loss_scale") is not None]
    if scales:
        summary.setdefault("final_loss_scale", scales[-1])
    cuda = [v for o in steps + list(run["evals"].values()) + [summary]
            for v in [o.get("cuda_peak_mb")] if v is not None]
    if "peak_memory_mb" not in summary:
        if cuda:
            summary.update(peak_memory_mb=max(cuda), peak_memory_kind="cuda_peak_allocated")
        elif status.get("peak_rss_mb") is not None:
            summary.update(peak_memory_mb=status["peak_rss_mb"], peak_memory_kind="cpu_peak_rss")
    times = [s["t"] for s in steps if s.get("t") is not None]
    if len(times) > 1:
        summary.setdefault("train_time_s", times[-1] - times[0])
    run["summary"] = summary


def diverged(run: Record) -> bool:
    """A run whose last reported losses are all non-finite (NaN, inf) has diverged."""
    tail = run["steps"][-max(1, len(run["steps"]) // 20):]
    return bool(tail) and all(s.get("loss") is None for s in tail) and \
        any("loss" in s for s in tail)


def read_run(out: str, name: str) -> Record:
    """One run: status (ok|unsupported|failed|diverged|timeout|missing), message, metrics."""
    status_path, metrics = (os.path.join(out, name + ext) for ext in (".status", ".jsonl"))
    status: Record = {"status": "ok"}
    if os.path.isfile(status_path):
        with open(status_path) as f:
            status = json.load(f)
    elif not os.path.isfile(metrics):
        return {"status": "missing", "message": f"no {name}.jsonl in {out}"}
    run: Record = {"status": status.get("status", "ok"), "message": status.get("message", "")}
    if run["status"] != "ok":
        return run
    if not os.path.isfile(metrics):
        return {"status": "failed", "message": f"no metrics file {metrics}"}
    run.update(read_jsonl(metrics))
    if not run["steps"] and run["summary"] is None:
        return {"status": "failed", "message": f"{metrics} reports nothing"}
    derive_summary(run, status)
    if diverged(run):
        return {"status": "diverged", "message": "the loss is not finite at the end of the run"}
    run["message"] = ""  # for an ok run the last stderr line is noise (warnings, progress)
    return run


def plan_from_files(out: str, levels: Sequence[str]) -> Record:
    """A plan for output without plan.json: the runs found per level, steps from the files."""
    rows = []
    for lv in levels:
        found: Dict[Optional[int], Set[int]] = {}  # steps (None: the level's main runs) -> seeds
        for path in glob.glob(os.path.join(out, f"{lv}-s*.*")):
            m = re.fullmatch(re.escape(lv) + r"-s(\d+)(?:-n(\d+))?\.(?:status|jsonl)",
                             os.path.basename(path))
            if m:
                steps = int(m.group(2)) if m.group(2) else None
                found.setdefault(steps, set()).add(int(m.group(1)))
        rows.append({"level": lv, "seeds": sorted(found.pop(None, ())), "steps": None,
                     "slow": False, "eval_at": [],
                     "extra": [{"steps": k, "seeds": sorted(v)} for k, v in sorted(found.items())]})
    return {"levels": rows, "cpu": None, "device": None, "mode": "steps", "baseline": None}


def load_plan(out: str, levels: Optional[Sequence[str]] = None) -> Record:
    path = os.path.join(out, "plan.json")
    if os.path.isfile(path):
        with open(path) as f:
            plan: Record = json.load(f)
        if levels:
            plan["levels"] = [r for r in plan["levels"] if r["level"] in levels]
        return plan
    return plan_from_files(out, levels or [])


# ---- metrics of one run at a step ------------------------------------------------------------
def losses(run: Record, upto: Optional[int] = None) -> List[Optional[float]]:
    """Per-step losses (None where not finite), steps 1..upto."""
    return [s.get("loss") for s in run["steps"][:upto]]


def final_train_loss(run: Record, upto: Optional[int]) -> Optional[float]:
    tail = [v for v in reversed(losses(run, upto)) if v is not None and math.isfinite(v)][:TAIL]
    return sum(tail) / len(tail) if tail else None


def median_step_ms(run: Record, upto: Optional[int]) -> Optional[float]:
    times: List[float] = [s["step_ms"] for s in run["steps"][:upto]
                          if s.get("step_ms") is not None]
    steady = times[STEADY_SKIP:] if len(times) > 2 * STEADY_SKIP else times
    return statistics.median(steady) if steady else None


def valid_at(run: Record, steps: Optional[int]) -> bool:
    """Whether a run stands for `steps` steps of training: its own length, or (constant learning
    rate only: then a shorter run is the prefix of a longer one) a longer run's prefix."""
    if run.get("status") != "ok" or steps is None or len(run["steps"]) < steps:
        return False
    return len(run["steps"]) == steps or \
        run["config"].get("lr_schedule", "constant") == "constant"


def metrics_at(run: Record, steps: Optional[int]) -> Optional[Record]:
    """The final metrics (test accuracy, bits per character, ...), final train loss and median
    step time of a run after `steps` steps: the summary for its last step, an eval line and the
    curves' prefix for an earlier one."""
    if not valid_at(run, steps):
        return None
    if run["summary"].get("steps") == steps:
        test = run["summary"]
    else:
        test = run["evals"].get(steps, {})
    out = {k: finite_or_none(v) for k, v in test.items() if k not in BOOKKEEPING}
    out.update(final_train_loss=final_train_loss(run, steps),
               median_step_ms=median_step_ms(run, steps))
    return out


# ---- one level against the baseline ----------------------------------------------------------
def summarize(values: Mapping[int, Optional[float]]) -> Record:
    """{mean, sd, half_width95, n} of a {seed: value} map (None values left out)."""
    vals = [v for v in values.values() if v is not None]
    m, half = ab_stats.mean_interval(vals)
    return {"mean": m, "sd": ab_stats.sample_sd(vals), "half_width95": half, "n": len(vals)}


def column(at: Mapping[int, Optional[Record]], key: str) -> Dict[int, float]:
    return {s: m[key] for s, m in at.items() if m is not None and m.get(key) is not None}


def compare(level_at: Mapping[int, Optional[Record]], base_at: Mapping[int, Optional[Record]],
            specs: Specs) -> Dict[str, Record]:
    """The paired comparisons of RULE for each metric of specs ((name, higher is better)) and the
    step time, given {seed: metrics_at(...)} of both."""
    out: Dict[str, Record] = {}
    for key, higher in specs:
        base = column(base_at, key)
        out[key] = ab_stats.paired(column(level_at, key), base, ab_stats.noise_floor(base),
                                   higher_is_better=higher)
    base = column(base_at, "median_step_ms")
    out["step_time"] = ab_stats.paired(column(level_at, "median_step_ms"), base,
                                       ab_stats.noise_floor(base, log=True),
                                       higher_is_better=False, log=True,
                                       words=("faster", "slower"))
    return out


def per_seed_rows(runs: Mapping[int, Record], level_at: Mapping[int, Optional[Record]],
                  base_at: Mapping[int, Optional[Record]], div: Record,
                  specs: Specs) -> List[Record]:
    rows: List[Record] = []
    for seed, run in sorted(runs.items()):
        row: Record = {"seed": seed, "status": run["status"]}
        if run["status"] != "ok":
            row["message"] = run.get("message", "")
            rows.append(row)
            continue
        m, b, s = level_at.get(seed) or {}, base_at.get(seed) or {}, run["summary"]
        row.update(m)
        row.update({"steps": len(run["steps"]), "skipped_steps": s.get("skipped_steps"),
                    "final_loss_scale": s.get("final_loss_scale"),
                    "peak_memory_mb": s.get("peak_memory_mb"),
                    "train_time_s": s.get("train_time_s"),
                    "baseline_median_step_ms": b.get("median_step_ms"),
                    "divergence": div["per_seed"].get(seed),
                    "metric_by_step": {k: e.get(specs[0][0])
                                       for k, e in sorted(run["evals"].items())}})
        row.update({f"baseline_{key}": b.get(key) for key, _ in specs})
        rows.append(row)
    return rows


def level_status(runs: Mapping[int, Record]) -> str:
    states = {r["status"] for r in runs.values()}
    if states == {"ok"}:
        return "ok"
    if "ok" not in states and states <= {"unsupported"}:
        return "unsupported"
    if "ok" not in states and states <= {"diverged"}:
        return "diverged"
    return "failed" if "ok" not in states else "partly failed"


def aggregate(level_at: Mapping[int, Optional[Record]], ok: Mapping[int, Record],
              batch: Optional[int], specs: Specs) -> Record:
    """A level's numbers over its seeds: mean and sd of each metric, median (min, max) step time,
    median peak memory, samples/s."""
    out: Record = {key: summarize(column(level_at, key)) for key, _ in specs}
    times = column(level_at, "median_step_ms").values()
    med = statistics.median(times) if times else None
    out["median_step_ms"] = {"median": med, "min": min(times, default=None),
                             "max": max(times, default=None)}
    mems = [r["summary"].get("peak_memory_mb") for r in ok.values()
            if r["summary"].get("peak_memory_mb") is not None]
    out["peak_memory_mb"] = statistics.median(mems) if mems else None
    out["peak_memory_kind"] = next(iter(ok.values()))["summary"].get("peak_memory_kind")
    out["samples_per_s"] = batch / (med / 1000.0) if med and batch else None
    return out


def level_row(plan_row: Mapping[str, Any], runs: Mapping[int, Record],
              base_runs: Mapping[int, Runs], batch: Optional[int], specs: Specs) -> Record:
    """Everything the report says about one level. base_runs: {steps: {seed: run}}, the
    baseline's runs by budget."""
    ok = {s: r for s, r in runs.items() if r["status"] == "ok"}
    row: Record = {"level": plan_row["level"],
                   "status": level_status(runs) if runs else "missing",
                   "seeds": sorted(runs), "seeds_ok": sorted(ok),
                   "slow": plan_row.get("slow", False)}
    if plan_row.get("why_slow"):
        row["why_slow"] = plan_row["why_slow"]
    bad = [f"seed {s}: {r['status']} {r.get('message', '')}".strip()
           for s, r in sorted(runs.items()) if r["status"] != "ok"]
    if bad:
        row["message"] = "; ".join(bad)
    if not ok:
        return row
    steps = plan_row.get("steps") or min(len(r["steps"]) for r in ok.values())
    row["steps"] = steps
    if plan_row.get("epochs"):
        row["epochs"] = plan_row["epochs"]
    level_at = {s: metrics_at(r, steps) for s, r in ok.items()}
    base = baseline_for(base_runs, steps)
    base_at = {s: metrics_at(r, steps) for s, r in base.items()}
    row.update(aggregate(level_at, ok, batch, specs))
    row["vs_baseline"] = compare(level_at, base_at, specs)
    div = ab_stats.divergence({s: losses(r, steps) for s, r in ok.items()},
                              {s: losses(r, steps) for s, r in base.items()}, steps)
    row["divergence"] = {k: v for k, v in div.items() if k != "per_seed"}
    row["divergence"]["window"] = ab_stats.smoothing_window(steps)
    row["per_seed"] = per_seed_rows(runs, level_at, base_at, div, specs)
    precision = next((r["precision"] for _, r in sorted(ok.items()) if r.get("precision")), None)
    if precision:
        row["precision"] = precision
    return row


def baseline_for(base_runs: Mapping[int, Runs], steps: int) -> Runs:
    """{seed: run} of the baseline standing for `steps` steps: its run of that budget, else (a
    constant learning rate) the prefix of its longest runs."""
    if steps in base_runs:
        return {s: r for s, r in base_runs[steps].items() if valid_at(r, steps)}
    longest = max(base_runs, default=None)
    longest_runs = base_runs.get(longest, {}) if longest is not None else {}
    return {s: r for s, r in longest_runs.items() if valid_at(r, steps)}


# ---- the whole report -------------------------------------------------------------------------
def ok_runs(runs: Mapping[int, Record]) -> Runs:
    return {s: r for s, r in runs.items() if r["status"] == "ok"}


TITLES = {"train_fashion_mnist": "Fashion-MNIST CNN", "train_char_gpt": "character-level GPT"}


def program_of(command: Optional[List[str]]) -> str:
    """The program a command runs: its .py script, else its executable (without the .py)."""
    if not command:
        return ""
    script = next((a for a in command if a.endswith(".py")), command[0])
    return os.path.basename(script)[:-3] if script.endswith(".py") else os.path.basename(script)


def title_of(program: Optional[str]) -> str:
    program = (program or "")[:-3] if (program or "").endswith(".py") else (program or "")
    return TITLES.get(program, program)


def metric_specs(base_runs: Mapping[int, Record], all_runs: Sequence[Record],
                 directions: Optional[Mapping[str, Any]] = None) -> List[Tuple[str, bool]]:
    """[(metric, higher is better)]: the numbers the baseline's runs report as final values
    (test accuracy, bits per character, ...), in the order first reported, then the final train
    loss when the runs report step losses. An integer that is the same in every run (a model
    size, a batch size) describes the runs rather than measures them: not compared."""
    names: List[str] = []
    for run in base_runs.values():
        for k, v in run["summary"].items():
            if k not in BOOKKEEPING and k not in names and finite_or_none(v) is not None:
                names.append(k)
    def constant_int(k: str) -> bool:
        values = {r["summary"].get(k) for r in all_runs}
        return len(values) == 1 and all(isinstance(v, int) and not isinstance(v, bool)
                                        for v in values)
    names = [k for k in names if not constant_int(k)]
    specs = [(k, higher_is_better(k, directions)) for k in names]
    if any(s.get("loss") is not None for r in base_runs.values() for s in r["steps"]):
        specs.append(("final_train_loss", False))
    return specs


def build(out: str, levels: Optional[Sequence[str]] = None) -> Tuple[Record, List[CurveSet]]:
    """(summary dict, curve sets) for OUT; a curve set is (label, level, {seed: run}) for every
    level and for each of the baseline's shorter budgets."""
    plan = load_plan(out, levels)
    # level -> {seed: run}; keyed Optional[str] since the baseline is None when no level ran
    runs: Dict[Optional[str], Runs] = {
        r["level"]: {s: read_run(out, run_name(r["level"], s)) for s in r["seeds"]}
        for r in plan["levels"]}
    for level_runs in runs.values():
        for seed, run in level_runs.items():
            if run["status"] == "ok":
                run["config"].setdefault("seed", seed)
    ok_levels = [r["level"] for r in plan["levels"] if ok_runs(runs[r["level"]])]
    base = "O0" if "O0" in ok_levels else (ok_levels[0] if ok_levels else None)
    base_plan: Record = next((r for r in plan["levels"] if r["level"] == base), {})
    base_runs: Dict[int, Runs] = {}  # steps -> {seed: run}: the baseline's runs by budget
    for r in ok_runs(runs.get(base, {})).values():
        base_runs.setdefault(len(r["steps"]), {})[r["config"].get("seed")] = r
    extra_rows: List[Tuple[Record, Runs]] = []
    for extra in base_plan.get("extra", []):
        base_level = cast(str, base)  # base_plan is {} (no extra) when base is None
        extra_runs = {s: read_run(out, run_name(base_level, s, extra["steps"]))
                      for s in extra["seeds"]}
        for seed, run in ok_runs(extra_runs).items():
            run["config"].setdefault("seed", seed)
        base_runs.setdefault(extra["steps"], {}).update(ok_runs(extra_runs))
        extra_rows.append((dict(base_plan, steps=extra["steps"], seeds=extra["seeds"],
                                epochs=None, extra=[]), extra_runs))
    config: Record = next((r["config"] for r in ok_runs(runs.get(base, {})).values()), {})
    batch = config.get("batch_size") or plan.get("batch_size")
    specs = metric_specs(ok_runs(runs.get(base, {})),
                         [r for lv in runs.values() for r in ok_runs(lv).values()],
                         plan.get("higher_is_better"))
    rows = [level_row(p, runs[p["level"]], base_runs, batch, specs) for p in plan["levels"]]
    budgets = [level_row(p, r, base_runs, batch, specs) for p, r in extra_rows]
    base_row = next((r for r in rows if r["level"] == base), None)
    for r in [base_row] + budgets if base_row is not None else []:
        r["baseline"] = True
    base_mem = base_row.get("peak_memory_mb") if base_row else None
    for r in rows + budgets:
        if r.get("peak_memory_mb") is not None and base_mem:
            r["peak_memory_ratio"] = r["peak_memory_mb"] / base_mem
    fastest, verdict = overall_verdict(rows, base, specs)
    summary: Record
    summary = {"baseline": base, "rule": ab_stats.RULE, "verdict": verdict,
               "metrics": [{"name": k, "higher_is_better": h} for k, h in specs],
               "title": plan.get("title") or title_of(config.get("program")
                                                      or program_of(plan.get("command"))),
               "command": plan.get("command"),
               "fastest_not_worse": fastest, "config": config, "cpu": plan.get("cpu"),
               "mode": plan.get("mode"), "lr_schedule": config.get("lr_schedule"),
               "device": plan.get("device") or config.get("device"), "levels": rows,
               "baseline_budgets": budgets}
    curve_sets: List[CurveSet] = []
    for r in plan["levels"]:
        curve_sets.append((r["level"], r["level"], ok_runs(runs[r["level"]])))
        if r["level"] == base:
            curve_sets += [(f"{base}, {p['steps']} steps", base, ok_runs(x))
                           for p, x in extra_rows]
    return summary, curve_sets


def overall_verdict(rows: Sequence[Record], base: Optional[str],
                    specs: Specs) -> Tuple[Optional[str], str]:
    """The fastest level (median step time) none of whose metrics is 'worse' than the
    baseline's, and how the others' step times compare."""
    if base is None:
        return None, "Verdict: no level ran; see the logs next to this report."
    names = [k for k, _ in specs]
    labels = [metric_label(k) for k in names]
    what = (", ".join(labels[:-1]) + " and " + labels[-1]) if len(labels) > 1 else (
        labels[0] if labels else "metrics")
    ok = [r for r in rows if r.get("vs_baseline") and r["median_step_ms"]["median"]]
    if not ok:
        return None, "Verdict: no level reported step times; see the logs next to this report."
    worse = [r for r in ok if any(r["vs_baseline"][k]["verdict"] == "worse" for k in names)]
    candidates = [r for r in ok if r not in worse]
    fastest = min(candidates, key=lambda r: r["median_step_ms"]["median"]) if candidates else None
    if fastest is None:
        text = f"Verdict: every level's {what} is worse than {base}'s."
    elif fastest["level"] == base:
        text = (f"Verdict: {base} (baseline) is the fastest level whose {what} are not worse "
                "than the baseline's.")
    else:
        text = f"Verdict: {fastest['level']} is the fastest level whose {what} are not worse " \
               f"than {base}'s"
        if names:
            first = fastest["vs_baseline"][names[0]]
            text += (f" ({metric_label(names[0])} {first['verdict']}: "
                     f"{fmt_signed(first['mean_diff'], '.4g')} over {first['n']} seeds at "
                     f"{fastest['steps']} steps)")
        text += "."
    others = [r for r in ok if r["level"] != base]
    if others:
        text += f" Step time vs {base}: " + "; ".join(
            f"{r['level']} {fmt(r['vs_baseline']['step_time'].get('ratio'), '.2f', 'x')} "
            f"({r['vs_baseline']['step_time']['verdict']})" for r in others) + "."
    if worse:
        text += " Worse than the baseline (excluded): " + ", ".join(
            f"{r['level']} (" + ", ".join(f"{metric_label(k)} {r['vs_baseline'][k]['verdict']}"
                                          for k in names) + ")" for r in worse) + "."
    unverified = [r["level"] for r in candidates if r["level"] != base and names
                  and r["vs_baseline"][names[0]]["verdict"] == "n/a"]
    if unverified:
        text += (f" No {metric_label(names[0])} verdict for {', '.join(unverified)} (fewer than "
                 "2 seeds: run with --seeds 3 or more).")
    partly = [f"{r['level']} ({r.get('message', '')})" for r in rows
              if r["status"] == "partly failed"]
    if partly:
        text += f" Some seeds did not finish: {'; '.join(partly)}."
    not_run = [f"{r['level']} ({r['status']})" if r["status"] in ("diverged", "timeout")
               else r["level"] for r in rows
               if r["status"] in ("unsupported", "failed", "missing", "diverged", "timeout")]
    if not_run:
        text += f" Not run: {', '.join(not_run)}."
    return fastest["level"] if fastest else None, text


LABELS = {"test_accuracy": "test accuracy", "final_train_loss": "final train loss",
          "test_loss": "test loss", "val_bpc": "validation bits per character"}


def metric_label(name: str) -> str:
    return LABELS.get(name, name.replace("_", " "))


def metric_format(name: str) -> Tuple[str, str]:
    """(format spec, suffix) for a metric's values."""
    if "accuracy" in name:
        return ".2f", "%"
    return ".4f", ""


# ---- formatting -------------------------------------------------------------------------------
def fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec) + suffix


def fmt_signed(v: Optional[float], spec: str) -> str:
    return fmt(v, "+" + spec)


def fmt_interval(c: Optional[Mapping[str, Any]], spec: str, suffix: str = "") -> str:
    """'+0.12 [-0.30, +0.54]' for a paired comparison."""
    if c is None or c["mean_diff"] is None:
        return "n/a"
    if c.get("ratio") is not None:
        lo_hi = c.get("ratio_ci95")
        text = fmt(c["ratio"], ".2f", "x")
        return text + (f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" if lo_hi else "")
    text = fmt_signed(c["mean_diff"], spec) + suffix
    return text + (f" [{c['ci95'][0]:+{spec}}, {c['ci95'][1]:+{spec}}]" if c["ci95"] else "")


def fmt_floor(c: Optional[Mapping[str, Any]], spec: str, rel: bool = False) -> str:
    f = c.get("floor") if c else None
    if f is None:
        return "n/a"
    return f"±{100 * (math.exp(f) - 1):.1f}%" if rel else f"±{f:{spec}}"


def fmt_mean_sd(s: Optional[Mapping[str, Any]], spec: str, suffix: str = "") -> str:
    if s is None or s.get("mean") is None:
        return "n/a"
    sd = f" ± {s['sd']:{spec}}" if s.get("sd") is not None else ""
    return f"{s['mean']:{spec}}{suffix}{sd}"


def budget_text(r: Mapping[str, Any]) -> str:
    seeds = r.get("seeds_ok") or r.get("seeds") or []
    if r.get("epochs"):
        return f"{r['epochs']} ep ({r['steps']}) x {len(seeds)}"
    return f"{r.get('steps', '?')} x {len(seeds)}"


def describe_cpu(cpu: Optional[Mapping[str, Any]]) -> List[str]:
    if not cpu:
        return []
    from .plan import describe_cpu as describe
    return ["```", describe(cpu), "```", ""]


def markdown_header(summary: Mapping[str, Any]) -> List[str]:
    c = summary["config"]
    lines = [f"# optamp A/B test: {summary.get('title') or 'training program'}", ""]
    if c.get("train_images") is not None:  # the Fashion-MNIST trainers
        schedule = c.get("lr_schedule", "constant")
        schedule += " decay to 0 over each run" if schedule == "cosine" else ""
        lines += [f"{c.get('program', 'train_fashion_mnist')} ({c.get('language', '?')}), device "
                  f"{c.get('device', '?')}, batch {c.get('batch_size', '?')}, lr "
                  f"{c.get('lr', '?')} ({schedule}), {c.get('train_images', '?')} training "
                  f"images, {c.get('test_images', '?')} test images, {c.get('threads', '?')} "
                  f"threads, torch {c.get('torch', '?')}."]
    else:
        described = ", ".join(f"{k} {v}" for k, v in c.items()
                              if k not in ("type", "t", "seed") and not isinstance(v, float))
        lines += [(f"Command: `{' '.join(summary['command'])}`. " if summary.get("command")
                   else "") + (f"It reported: {described}." if described else "")]
    lines += [f"Baseline: {summary['baseline']}. Budget: steps x seeds per level (slow levels, "
              "which have no fast kernels on this device, run fewer; each is compared with the "
              "baseline at its own step count).", ""]
    if summary.get("device") in (None, "cpu"):
        lines += describe_cpu(summary.get("cpu"))
    return lines


def metrics_table(rows: Sequence[Record], base: str, specs: Specs) -> List[str]:
    """One column group per compared metric: mean ± sd over seeds, paired difference to the
    baseline with its 95% interval, the floor, the verdict."""
    head, align = "| level | steps x seeds |", "|---|---|"
    for name, higher in specs:
        what = metric_label(name)
        head += (f" {what} (mean ± sd) | vs {base} [95% interval] | floor | {what} verdict "
                 f"({'higher' if higher else 'lower'} is better) |")
        align += "---:|---:|---:|---|"
    lines = [head, align]
    for r in rows:
        if not r.get("vs_baseline"):
            lines.append(f"| {r['level']} | {r['status']}: {r.get('message', '')} |"
                         + " |" * (4 * len(specs)))
            continue
        cells = f"| {label(r)} | {budget_text(r)} |"
        for name, _ in specs:
            spec, suffix = metric_format(name)
            c = r["vs_baseline"][name]
            cells += (f" {fmt_mean_sd(r[name], spec, suffix)} | {fmt_interval(c, spec)} | "
                      f"{fmt_floor(c, spec)} | {c['verdict']} |")
        lines.append(cells)
    return lines


def speed_table(rows: Sequence[Record], base: str, mem_label: str) -> List[str]:
    lines = [f"| level | median step (ms) [min-max over seeds] | step time vs {base} [95% "
             f"interval] | floor | speed verdict | samples/s | {mem_label} (MB) | memory vs "
             f"{base} | loss divergence from {base} | {base}'s seed-to-seed distance | ratio |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.get("vs_baseline"):
            continue
        st, d, t = r["vs_baseline"]["step_time"], r["divergence"], r["median_step_ms"]
        lines.append(
            f"| {label(r)} | {fmt(t['median'], '.2f')} [{fmt(t['min'], '.2f')}-"
            f"{fmt(t['max'], '.2f')}] | {fmt_interval(st, '.2f')} | "
            f"{fmt_floor(st, '.2f', rel=True)} | {st['verdict']} | "
            f"{fmt(r['samples_per_s'], '.0f')} | {fmt(r['peak_memory_mb'], '.1f')} | "
            f"{fmt(r.get('peak_memory_ratio'), '.2f', 'x')} | {fmt(d['mean'], '.4f')} | "
            f"{fmt(d['floor'], '.4f')} | {fmt(d['ratio'], '.2f')} |")
    return lines


def seed_table(rows: Sequence[Record], base: str, specs: Specs) -> List[str]:
    head = "| level | seed | steps |" + "".join(
        f" {metric_label(k)} | {base}'s (same seed and step) |" for k, _ in specs)
    head += (f" median step (ms) | {base}'s | divergence | skipped steps | final loss scale |")
    lines = [head, "|---|---:|---:|" + "---:|---:|" * len(specs) + "---:|---:|---:|---:|---:|"]
    for r in rows:
        for s in r.get("per_seed", []):
            if s["status"] != "ok":
                lines.append(f"| {r['level']} | {s['seed']} | {s['status']}: "
                             f"{s.get('message', '')} |" + " |" * (2 * len(specs) + 5))
                continue
            cells = f"| {r['level']} | {s['seed']} | {s['steps']} |"
            for k, _ in specs:
                spec, suffix = metric_format(k)
                cells += (f" {fmt(s.get(k), spec, suffix)} | "
                          f"{fmt(s.get('baseline_' + k), spec, suffix)} |")
            cells += (f" {fmt(s['median_step_ms'], '.2f')} | "
                      f"{fmt(s['baseline_median_step_ms'], '.2f')} | {fmt(s['divergence'], '.4f')} "
                      f"| {fmt(s['skipped_steps'], 'd')} | {fmt(s['final_loss_scale'], 'g')} |")
            lines.append(cells)
    return lines


def epoch_table(rows: Sequence[Record], specs: Specs) -> List[str]:
    """Epoch mode: the first metric after each epoch, mean over seeds."""
    ok = [r for r in rows if r.get("per_seed") and r.get("epochs")]
    if not ok or not specs:
        return []
    epochs = max(r["epochs"] for r in ok)
    lines = ["| level | " + " | ".join(f"epoch {e}" for e in range(1, epochs + 1))
             + " | train time per seed (s) |", "|---|" + "---:|" * (epochs + 1)]
    for r in ok:
        seeds = [s for s in r["per_seed"] if s["status"] == "ok"]
        steps = sorted({k for s in seeds for k in s["metric_by_step"]})
        cells: List[str] = []
        for k in steps:
            vals = [s["metric_by_step"][k] for s in seeds
                    if s["metric_by_step"].get(k) is not None]
            cells.append(fmt(statistics.mean(vals) if vals else None, *metric_format(specs[0][0])))
        times = [s["train_time_s"] for s in seeds if s.get("train_time_s") is not None]
        lines.append(f"| {r['level']} | " + " | ".join(cells) + " | "
                     + fmt(statistics.mean(times) if times else None, ".0f") + " |")
    what = metric_label(specs[0][0])
    return [f"{what[:1].upper() + what[1:]} after each epoch (mean over seeds):", ""] + lines + [""]


def label(r: Mapping[str, Any]) -> str:
    level: str = r["level"]
    return level + (" (baseline)" if r.get("baseline") else "") + (
        " (slow)" if r.get("slow") else "")


def table_rows(summary: Mapping[str, Any]) -> List[Record]:
    """The levels in order, the baseline's shorter budgets right after the baseline."""
    out: List[Record] = []
    for r in summary["levels"]:
        out.append(r)
        if r.get("baseline"):
            out += summary.get("baseline_budgets", [])
    return out


def precision_section(summary: Mapping[str, Any]) -> List[str]:
    """Each level's per-op precision table, where the runs recorded one (--precision-steps)."""
    tables = [(r["level"], r["precision"]) for r in summary["levels"] if r.get("precision")]
    if not tables:
        return []
    lines = ["## Where precision is lost (per-op report of the first seed's first steps)", ""]
    for level, p in tables:
        first = p.get("first_nonfinite")  # the table ends with it too, in the probe's words
        lines += [f"### {level}", "", f"First inf/NaN: {describe_nonfinite(first)}." if first
                  else "No op produced an inf or NaN.", "", p.get("table", "").rstrip(), ""]
    return lines


def describe_nonfinite(first: Mapping[str, Any]) -> str:
    where = f" in {first['scope']}" if first.get("scope") else ""
    node = f" ({first['node']})" if first.get("node") else ""
    outside = " (no op made one: already in its inputs)" if first.get("from_inputs") else ""
    return f"{first.get('op', '?')}{node}{where}, {first.get('phase', '?')}{outside}"


def write_markdown(path: str, summary: Mapping[str, Any], plot: bool = True) -> None:
    rows, base = table_rows(summary), summary["baseline"] or "baseline"
    kind = next((r["peak_memory_kind"] for r in rows if r.get("peak_memory_kind")), "")
    mem_label = {"cpu_peak_rss": "peak RSS", "cuda_peak_allocated": "CUDA peak allocated"}.get(
        kind, "peak memory")
    lines = markdown_header(summary)
    lines += [f"**{summary['verdict']}**", ""]
    specs = [(m["name"], m["higher_is_better"]) for m in summary.get("metrics", [])]
    lines += ["## Metrics", ""] if specs else []
    lines += (metrics_table(rows, base, specs) if specs else []) + [
        "", "## Step time, memory, loss trajectory", ""]
    lines += speed_table(rows, base, mem_label) + [""]
    lines += epoch_table(rows, specs)
    lines += precision_section(summary)
    lines += ["## Per seed", ""] + seed_table(rows, base, specs) + [""]
    lines += [
        "## How to read it", "",
        f"Verdict rule: {summary['rule']}.", "",
        "Metrics: the final values the program reported (the Fashion-MNIST trainers: test "
        "accuracy and loss on the test images, eval mode, no grad). Final train "
        f"loss: mean of the last {TAIL} finite step losses. Step time: median over the steps "
        f"after the first {STEADY_SKIP} (the program's own step_ms, else the time between two "
        "step reports); its floor is shown as the baseline's relative seed-to-seed spread. Loss "
        "divergence: mean absolute difference between the level's and the baseline's training-"
        "loss curves of the same seed, each smoothed by a trailing moving average of 1/20 of "
        "the run (at least 5 steps), averaged over seeds; the seed-to-seed distance is the same "
        "between the baseline's curves of two different seeds; ratio below 1: the level stays "
        "closer to the baseline than a change of seed does. A level with fewer steps (a slow "
        "level) is compared with the baseline's own runs of that many steps, on the same seeds "
        f"(the {base} (baseline) rows with that budget). "
        + ("Plot: ab.png." if plot else "No plot: matplotlib is not installed."), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# ---- plot -------------------------------------------------------------------------------------
COLORS = {"O0": "#222222", "O1": "#1f77b4", "O2": "#d62728", "O3": "#ff7f0e", "O4": "#2ca02c",
          "O5": "#9467bd"}
STYLES = {"O0": "-", "O1": "--", "O2": "-", "O3": "-.", "O4": "--", "O5": ":"}


def plot_curves(ax_loss: "Axes", ax_scale: "Axes", curve_sets: Sequence[CurveSet],
                primary: Optional[str]) -> None:
    for i, (label, level, ok) in enumerate(curve_sets):
        if not ok:
            continue
        c, ls, lw = COLORS.get(level), STYLES.get(level, "-"), max(1.2, 3.0 - 0.4 * i)
        if label != level:  # the baseline's shorter budget: thin, dotted
            ls, lw = ":", 1.5
        n = min(len(r["steps"]) for r in ok.values())
        window = ab_stats.smoothing_window(n)
        curves = [ab_stats.smooth(losses(r, n), window) for r in ok.values()]
        xs = list(range(1, n + 1))
        pts = [[v for v in col if v is not None] for col in zip(*curves)]
        keep = [j for j, p in enumerate(pts) if p]
        accs = [r["summary"][primary] for r in ok.values()
                if primary and finite_or_none(r["summary"].get(primary)) is not None]
        ax_loss.plot([xs[j] for j in keep], [statistics.mean(pts[j]) for j in keep], color=c,
                     linestyle=ls, linewidth=lw, label=f"{label}" + (
                         f" ({fmt(statistics.mean(accs), *metric_format(primary))} at {n})"
                         if primary and accs else ""))
        if len(curves) > 1:
            ax_loss.fill_between([xs[j] for j in keep], [min(pts[j]) for j in keep],
                                 [max(pts[j]) for j in keep], color=c, alpha=0.12)
        first = ok[min(ok)]
        if label != level:
            continue
        sc = [(s["step"], s["loss_scale"]) for s in first["steps"] if s.get("loss_scale")]
        if sc:
            ax_scale.step(*zip(*sc), where="post", color=c, linestyle=ls, linewidth=lw,
                          label=level)
        sk = [(s["step"], s["loss_scale"]) for s in first["steps"]
              if s.get("skipped") and s.get("loss_scale")]
        if sk:
            sk_steps, sk_scales = zip(*sk)
            ax_scale.scatter(sk_steps, sk_scales, marker="x", color=c, s=40, zorder=3)
    import matplotlib.ticker
    ax_loss.set_yscale("log")
    ax_loss.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_loss.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    ax_loss.set_ylabel("training loss (moving average;\nline: mean over seeds, band: min-max)")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=9,
                   title=f"level ({metric_label(primary or 'loss')} at its budget)",
                   title_fontsize=8)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale, first seed\n(x: skipped step)")
    ax_scale.set_xlabel("step")
    ax_scale.grid(True, which="both", alpha=0.3)
    if ax_scale.get_legend_handles_labels()[0]:
        ax_scale.legend(loc="best", fontsize=8, ncol=3)


def plot_interval(ax: "Axes", comparison: Mapping[str, Any], color: str,
                  ratio: bool = False) -> None:
    """A paired comparison as a point with its 95% interval, the floor as a grey band around
    "no difference" (0, or 1x for a ratio)."""
    center = 1.0 if ratio else 0.0
    ax.axvline(center, color="#222222", linewidth=1)
    f = comparison.get("floor")
    if f is not None and f > 0:
        lo, hi = (math.exp(-f), math.exp(f)) if ratio else (-f, f)
        ax.axvspan(lo, hi, color="#999999", alpha=0.3, label="noise floor")
    m = comparison.get("ratio") if ratio else comparison.get("mean_diff")
    if m is None:
        ax.text(0.5, 0.5, "n/a", transform=ax.transAxes, ha="center", va="center")
        return
    ci = comparison.get("ratio_ci95" if ratio else "ci95") or [m, m]
    ax.errorbar([m], [0], xerr=[[m - ci[0]], [ci[1] - m]], fmt="o", color=color, capsize=5,
                markersize=7)
    points = [math.exp(d) for d in comparison["diffs"]] if ratio else comparison["diffs"]
    ax.scatter(points, [0.25] * len(points), color=color, s=12, alpha=0.6, marker="|")
    if ratio:
        import matplotlib.ticker
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylim(-1, 1)
    ax.set_yticks([])
    ax.tick_params(labelsize=7)
    ax.grid(True, which="both", axis="x", alpha=0.3)


def plot_level(ax_acc: "Axes", ax_time: "Axes", row: Mapping[str, Any], base: str,
               primary: str) -> None:
    """One level's panel: its first metric and step time against the baseline's, paired by
    seed (point: mean difference / ratio, bar: 95% interval, ticks: single seeds, grey: the
    baseline's seed-to-seed noise floor)."""
    c = COLORS.get(row["level"], "C0")
    acc, st = row["vs_baseline"][primary], row["vs_baseline"]["step_time"]
    base_acc = [s["baseline_" + primary] for s in row["per_seed"]
                if s.get("baseline_" + primary) is not None]
    spec, suffix = metric_format(primary)
    plot_interval(ax_acc, acc, c)
    ax_acc.set_xlabel(f"{metric_label(primary)} - {base}'s", fontsize=8)
    ax_acc.set_title(f"{row['level']}, {row['steps']} steps x {acc['n']} seeds\n"
                     f"{fmt(row[primary]['mean'], spec, suffix)} vs {base} "
                     f"{fmt(statistics.mean(base_acc) if base_acc else None, spec, suffix)}: "
                     f"{acc['verdict']}", fontsize=8)
    plot_interval(ax_time, st, c, ratio=True)
    ax_time.set_xlabel(f"step time / {base}'s", fontsize=8)
    ax_time.set_title(f"step time\nmedian {fmt(row['median_step_ms']['median'], '.1f')} ms: "
                      f"{st['verdict']}", fontsize=8)


def write_plot(path: str, summary: Mapping[str, Any], curve_sets: Sequence[CurveSet]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = summary["baseline"]
    primary = summary["metrics"][0]["name"] if summary.get("metrics") else None
    others = [r for r in summary["levels"] if r.get("vs_baseline") and r["level"] != base]
    n = max(2, len(others))
    fig = plt.figure(figsize=(15, max(7.5, 2.0 * n)))
    grid = fig.add_gridspec(n, 3, width_ratios=[3.0, 1.3, 1.3], wspace=0.15, hspace=0.9)
    ax_loss = fig.add_subplot(grid[:max(1, n * 3 // 5), 0])
    ax_scale = fig.add_subplot(grid[max(1, n * 3 // 5):, 0], sharex=ax_loss)
    plot_curves(ax_loss, ax_scale, curve_sets, primary)
    c = summary["config"]
    ax_loss.set_title(f"optamp A/B: {summary.get('title') or 'training program'}, "
                      f"{c.get('device', '?')}, batch {c.get('batch_size', '?')}, baseline {base}",
                      fontsize=11)
    for i, row in enumerate(others):
        if primary:
            plot_level(fig.add_subplot(grid[i, 1]), fig.add_subplot(grid[i, 2]), row, base,
                       primary)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_report(out: str, levels: Optional[Sequence[str]] = None) -> Record:
    """Builds the report of OUT and writes summary.json, summary.md and ab.png; returns the
    summary."""
    summary, curve_sets = build(out, levels)
    try:
        write_plot(os.path.join(out, "ab.png"), summary, curve_sets)
        plot = True
    except ImportError as e:  # e.g. the GPU machine's bare python3; the numbers are all here
        print(f"optamp.ab: no plot ({e}); install matplotlib (e.g. apt-get install "
              "python3-matplotlib) for ab.png", file=sys.stderr)
        plot = False
    summary["plot"] = "ab.png" if plot else None
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    write_markdown(os.path.join(out, "summary.md"), summary, plot)
    return summary


def any_level_ran(summary: Mapping[str, Any]) -> bool:
    return any(r["status"] != "missing" and r.get("seeds_ok") for r in summary["levels"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/ab")
    p.add_argument("--levels", default="", help="only these levels (default: the plan's)")
    args = p.parse_args(argv)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()] or None
    summary = write_report(args.out, levels)
    print(summary["verdict"])
    return 0 if any_level_ran(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
