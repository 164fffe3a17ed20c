"""The A/B report's statistics and planning on synthetic data (no training, no data set):
optamp.ab.stats (paired verdicts against the baseline's noise floor, loss-curve
divergence), optamp.ab.plan (CPU features, budgets per level) and optamp.ab.summary on
hand-written JSON-lines files with known differences."""
import json
import math
import os
import random
import sys

import pytest

from optamp.ab import plan as ab_plan
from optamp.ab import summary as ab_report
from optamp.ab import stats as ab_stats

SEEDS = [0, 1, 2, 3, 4]


# ---- ab_stats ---------------------------------------------------------------------------------
def test_t_quantiles():
    assert ab_stats.t975(1) == 12.706 and ab_stats.t975(4) == 2.776
    assert ab_stats.t975(30) == 2.042
    assert ab_stats.t975(60) == pytest.approx(2.000, abs=2e-3)  # table value 2.000
    assert ab_stats.t975(120) == pytest.approx(1.980, abs=2e-3)  # table value 1.980
    with pytest.raises(ValueError, match="degrees of freedom"):
        ab_stats.t975(0)


def test_mean_interval():
    m, half = ab_stats.mean_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert ab_stats.mean_interval([5.0]) == (5.0, None)
    assert ab_stats.mean_interval([]) == (None, None)


def base_values(center, spread, seed=0):
    rng = random.Random(seed)
    return {s: center + rng.gauss(0, spread) for s in SEEDS}


def test_identical_runs_are_indistinguishable():
    base = base_values(85.0, 0.5)
    c = ab_stats.paired(dict(base), base, ab_stats.noise_floor(base))
    assert c["verdict"] == "indistinguishable"
    assert c["mean_diff"] == 0 and c["ci95"] == [0, 0] and c["n"] == 5


@pytest.mark.parametrize("shift,expected", [(2.0, "better"), (-2.0, "worse")])
def test_known_accuracy_difference(shift, expected):
    """A level 2 points off the baseline on every seed (with 0.1-point jitter) against a
    seed-to-seed spread of 0.5: the interval excludes 0 and the shift exceeds the floor."""
    base = base_values(85.0, 0.5)
    rng = random.Random(1)
    level = {s: v + shift + rng.gauss(0, 0.1) for s, v in base.items()}
    floor = ab_stats.noise_floor(base)
    assert 0.2 < floor < 1.0
    c = ab_stats.paired(level, base, floor)
    assert c["verdict"] == expected
    assert c["ci95"][0] < shift < c["ci95"][1]


def test_systematic_but_below_the_floor_is_indistinguishable():
    """A constant +0.1 point (the interval excludes 0) is smaller than what a change of seed
    does (floor ~0.5): not called better."""
    base = base_values(85.0, 0.5)
    c = ab_stats.paired({s: v + 0.1 for s, v in base.items()}, base, ab_stats.noise_floor(base))
    assert c["ci95"][0] > 0
    assert c["verdict"] == "indistinguishable"


def test_large_but_inconsistent_difference_is_indistinguishable():
    """+3 points on average, but +9/-3 from seed to seed: the interval contains 0."""
    base = {s: 85.0 + 0.6 * s for s in SEEDS}
    diffs = [9.0, -3.0, 9.0, -3.0, 3.0]
    c = ab_stats.paired({s: base[s] + d for s, d in zip(SEEDS, diffs)}, base,
                        ab_stats.noise_floor(base))
    assert c["mean_diff"] == pytest.approx(3.0) and c["ci95"][0] < 0
    assert c["verdict"] == "indistinguishable"


def test_lower_loss_is_better():
    base = base_values(0.40, 0.01)
    floor = ab_stats.noise_floor(base)
    lower = {s: v - 0.05 for s, v in base.items()}
    assert ab_stats.paired(lower, base, floor, higher_is_better=False)["verdict"] == "better"
    higher = {s: v + 0.05 for s, v in base.items()}
    assert ab_stats.paired(higher, base, floor, higher_is_better=False)["verdict"] == "worse"


def test_step_time_on_log_scale():
    base = base_values(10.0, 0.3)
    floor = ab_stats.noise_floor(base, log=True)
    words = ("faster", "slower")
    for factor, expected in ((0.5, "faster"), (2.0, "slower"), (1.0, "indistinguishable")):
        c = ab_stats.paired({s: v * factor for s, v in base.items()}, base, floor,
                            higher_is_better=False, log=True, words=words)
        assert c["verdict"] == expected
        assert c["ratio"] == pytest.approx(factor)


def test_one_seed_gives_no_verdict():
    base = {0: 85.0}
    assert ab_stats.noise_floor(base) is None
    assert ab_stats.paired({0: 90.0}, base, None)["verdict"] == "n/a"
    two = {0: 85.0, 1: 85.5}  # a floor, but only one paired seed
    assert ab_stats.paired({0: 90.0}, two, ab_stats.noise_floor(two))["verdict"] == "n/a"


def test_paired_uses_common_seeds_only():
    base = {0: 80.0, 1: 81.0, 2: 82.0, 3: 83.0}
    c = ab_stats.paired({1: 82.0, 2: 83.0, 7: 99.0}, base, 0.1)
    assert c["seeds"] == [1, 2] and c["diffs"] == [1.0, 1.0]


def test_smooth_skips_missing_values():
    assert ab_stats.smooth([1.0, 3.0, None, 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert ab_stats.smooth([None, float("inf"), 2.0], 5) == [None, None, 2.0]


def test_divergence():
    rng = random.Random(3)
    base = {s: [2.0 * math.exp(-k / 50) + rng.gauss(0, 0.2) for k in range(200)] for s in SEEDS}
    same = ab_stats.divergence({s: list(c) for s, c in base.items()}, base, 200)
    assert same["mean"] == 0 and same["ratio"] == 0 and same["floor"] > 0
    shifted = ab_stats.divergence({s: [v + 0.1 for v in c] for s, c in base.items()}, base, 200)
    assert shifted["mean"] == pytest.approx(0.1) and shifted["floor"] == same["floor"]
    # Over the first 50 steps only: the curves are compared on the same prefix.
    prefix = ab_stats.divergence({s: c[:50] for s, c in base.items()}, base, 50)
    assert prefix["mean"] == 0


# ---- ab_plan ----------------------------------------------------------------------------------
def cpuinfo(tmp_path, *flags):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 "
                    + " ".join(flags) + "\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return str(path)


def plan_of(tmp_path, flags, *argv):
    out = tmp_path / "out"
    ab_plan.main(["--out", str(out), "--cpuinfo", cpuinfo(tmp_path, *flags), *argv])
    with open(out / "plan.json") as f:
        plan = json.load(f)
    runs = [line.split("\t") for line in (out / "runs.tsv").read_text().splitlines()]
    return plan, {r["level"]: r for r in plan["levels"]}, runs


def test_cpu_features(tmp_path):
    amx = ab_plan.cpu_features(cpuinfo(tmp_path, "avx2", "avx512f", "avx512_bf16", "amx_tile",
                                       "amx_bf16"))
    assert amx["model"] == "Test CPU" and amx["bf16"] == "amx"
    assert amx["flags"]["amx_bf16"] and not amx["flags"]["avx512_fp16"]
    assert ab_plan.cpu_features(cpuinfo(tmp_path, "avx512_bf16"))["bf16"] == "avx512_bf16"
    assert ab_plan.cpu_features(cpuinfo(tmp_path, "avx2"))["bf16"] == "emulated"
    assert ab_plan.cpu_features(str(tmp_path / "absent"))["bf16"] == "unknown"
    text = ab_plan.describe_cpu(amx)
    assert "amx_bf16 yes" in text and "avx512_bf16 yes" in text and "AMX" in text
    # Where torch sends fp16 convolutions decides how slow O1-O3 are: oneDNN (whose fp16
    # weight gradient is reference code) only with AVX512-FP16, torch's own kernels otherwise.
    assert amx["fp16"] == "none" and "own kernels" in amx["fp16_note"]
    fp16 = ab_plan.cpu_features(cpuinfo(tmp_path, "avx512f", "avx512_fp16"))
    assert fp16["fp16"] == "avx512_fp16" and "oneDNN" in fp16["fp16_note"]
    assert "reference code" in ab_plan.describe_cpu(fp16)


def test_default_cpu_budget_without_bf16(tmp_path, capsys):
    """AVX2 only: fp16 and bf16 levels are slow (fewer steps and seeds); the baseline runs the
    full budget on every seed and the slow budget on the slow levels' seeds."""
    plan, lv, runs = plan_of(tmp_path, ["avx2"])
    assert plan["baseline"] == "O0" and plan["seeds"] == SEEDS
    assert plan["lr_schedule"] == "cosine"
    assert lv["O0"]["steps"] == 400 and lv["O0"]["seeds"] == SEEDS
    assert lv["O0"]["extra"] == [{"steps": 100, "seeds": [0, 1, 2]}]
    for level in ("O1", "O2", "O4", "O5"):
        assert lv[level]["slow"] and lv[level]["steps"] == 100 and lv[level]["seeds"] == [0, 1, 2]
    # Seed by seed: each level's run next to the baseline's of the same seed and budget.
    assert [r[2] for r in runs[:7]] == ["O0-s0", "O0-s0-n100", "O1-s0", "O2-s0", "O4-s0",
                                         "O5-s0", "O0-s1"]
    assert runs[0] == ["O0", "0", "O0-s0", "--steps", "400", "--lr-schedule", "cosine"]
    assert runs[1] == ["O0", "0", "O0-s0-n100", "--steps", "100", "--lr-schedule", "cosine"]
    assert runs[2] == ["O1", "0", "O1-s0", "--steps", "100", "--lr-schedule", "cosine"]
    assert len(runs) == 5 + 3 + 4 * 3
    out = capsys.readouterr().out
    assert "bf16: avx512_bf16 no, amx_bf16 no" in out and "O1 (slow: fp16 on a CPU)" in out
    assert "also 100 steps on seeds 0-2" in out


def test_budget_with_avx512_bf16(tmp_path):
    plan, lv, _ = plan_of(tmp_path, ["avx2", "avx512f", "avx512_bf16"], "--seeds", "3",
                          "--steps", "300", "--slow-steps", "120", "--slow-seeds", "2")
    assert not lv["O4"]["slow"] and lv["O4"]["steps"] == 300 and lv["O4"]["seeds"] == [0, 1, 2]
    assert lv["O1"]["slow"] and lv["O1"]["steps"] == 120 and lv["O1"]["seeds"] == [0, 1]
    assert lv["O0"]["extra"] == [{"steps": 120, "seeds": [0, 1]}]


def test_budget_options(tmp_path):
    _, lv, runs = plan_of(tmp_path, ["avx2"], "--levels", "O4,O1", "--seeds", "7,3",
                          "--slow-levels", "none", "--steps", "50")
    assert lv["O4"]["baseline"] and not lv["O1"]["slow"]  # no O0: the first level
    assert lv["O1"]["steps"] == 50 and lv["O1"]["seeds"] == [7, 3]
    assert [r[2] for r in runs] == ["O4-s7", "O1-s7", "O4-s3", "O1-s3"]
    _, lv, _ = plan_of(tmp_path, ["avx2"], "--steps", "60")  # slow steps capped by --steps
    assert lv["O1"]["steps"] == 60 and lv["O0"]["extra"] == []


def test_epochs_mode(tmp_path):
    plan, lv, runs = plan_of(tmp_path, ["avx2"], "--epochs", "3", "--subset", "640",
                             "--batch-size", "64")
    assert plan["mode"] == "epochs" and plan["seeds"] == [0] and plan["lr_schedule"] == "cosine"
    for r in lv.values():  # no slow budget, the test set after every epoch
        assert not r["slow"] and r["epochs"] == 3 and r["steps"] == 30
        assert r["eval_at"] == [10, 20, 30]
    assert runs[0] == ["O0", "0", "O0-s0", "--epochs", "3", "--eval-at", "10,20,30",
                       "--lr-schedule", "cosine"]
    plan, _, runs = plan_of(tmp_path, ["avx2"], "--epochs", "1", "--lr-schedule", "constant")
    assert plan["lr_schedule"] == "constant" and runs[0][-1] == "constant"


@pytest.mark.parametrize("text,expected", [("3", [0, 1, 2]), ("4,9", [4, 9]), ("5,", [5])])
def test_parse_seeds(text, expected):
    assert ab_plan.parse_seeds(text) == expected


@pytest.mark.parametrize("text", ["0", "x", "1,1", "-2,3"])
def test_parse_seeds_rejects(text):
    with pytest.raises(Exception, match="--seeds takes"):
        ab_plan.parse_seeds(text)


# ---- ab_report on synthetic runs ---------------------------------------------------------------
def write_run(out, level, seed, steps, accuracy, loss0, step_ms, evals=None, test_loss=0.5,
              name=None, schedule="cosine"):
    """A trainer's JSON lines: the loss curve decays from loss0 (with seeded noise), so two
    levels with the same loss0 and seed have the same curve."""
    rng = random.Random(seed)
    losses = [loss0 * math.exp(-k / 40) + 0.3 + rng.gauss(0, 0.05) for k in range(steps)]
    lines = [{"type": "config", "opt_level": level, "seed": seed, "steps": steps,
              "batch_size": 64, "device": "cpu", "program": "synthetic", "language": "test",
              "lr_schedule": schedule}]
    for k, v in enumerate(losses, 1):
        lines.append({"type": "step", "step": k, "loss": v, "loss_scale": 1.0,
                      "skipped": False, "step_ms": step_ms})
        if evals and k in evals:
            lines.append({"type": "eval", "step": k, "test_accuracy": evals[k],
                          "test_loss": test_loss})
    tail = losses[-20:]
    lines.append({"type": "summary", "steps": steps, "test_accuracy": accuracy,
                  "test_loss": test_loss, "final_train_loss": sum(tail) / len(tail),
                  "median_step_ms": step_ms, "peak_memory_mb": 100.0,
                  "peak_memory_kind": "cpu_peak_rss", "skipped_steps": 0,
                  "final_loss_scale": 1.0, "train_time_s": 1.0})
    name = name or f"{level}-s{seed}"
    with open(out / f"{name}.jsonl", "w") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    (out / f"{name}.status").write_text(json.dumps({"status": "ok", "exit_code": 0}))


def write_plan(out, levels):
    plan = {"device": "cpu", "mode": "steps", "baseline": "O0", "batch_size": 64,
            "seeds": SEEDS, "cpu": None, "levels": levels}
    (out / "plan.json").write_text(json.dumps(plan))


@pytest.fixture
def synthetic(tmp_path):
    """O0 (baseline, 200 steps, 5 seeds, and 100 steps on seeds 0-2); O1 (slow: 100 steps, 3
    seeds) as accurate as the baseline's 100-step runs; O2 identical to O0; O4 2 points worse and
    twice as slow; O5 1.5 points better, half the step time, the same loss curve + 0.1."""
    rng = random.Random(7)
    acc200 = {s: 85.0 + rng.gauss(0, 0.5) for s in SEEDS}
    acc100 = {s: 80.0 + rng.gauss(0, 0.8) for s in SEEDS}
    for s in SEEDS:
        write_run(tmp_path, "O0", s, 200, acc200[s], 2.0, 10.0 + 0.2 * s)
        write_run(tmp_path, "O2", s, 200, acc200[s], 2.0, 10.0 + 0.2 * s)
        write_run(tmp_path, "O4", s, 200, acc200[s] - 2.0 + rng.gauss(0, 0.1), 2.0,
                  2 * (10.0 + 0.2 * s))
        write_run(tmp_path, "O5", s, 200, acc200[s] + 1.5 + rng.gauss(0, 0.1), 2.1,
                  0.5 * (10.0 + 0.2 * s))
        if s < 3:
            write_run(tmp_path, "O1", s, 100, acc100[s], 2.0, 50.0)
            write_run(tmp_path, "O0", s, 100, acc100[s], 2.0, 10.0 + 0.2 * s,
                      name=f"O0-s{s}-n100")
    write_plan(tmp_path, [
        {"level": "O0", "baseline": True, "slow": False, "steps": 200, "seeds": SEEDS,
         "eval_at": [], "extra": [{"steps": 100, "seeds": [0, 1, 2]}]},
        {"level": "O1", "baseline": False, "slow": True, "why_slow": "fp16 on a CPU",
         "steps": 100, "seeds": [0, 1, 2], "eval_at": []},
        *({"level": lv, "baseline": False, "slow": False, "steps": 200, "seeds": SEEDS,
           "eval_at": []} for lv in ("O2", "O4", "O5"))])
    return tmp_path, acc100


def test_report_classifies_known_differences(synthetic):
    out, acc100 = synthetic
    summary, _ = ab_report.build(str(out))
    rows = {r["level"]: r for r in summary["levels"]}
    verdict = {lv: {k: c["verdict"] for k, c in r["vs_baseline"].items()}
               for lv, r in rows.items()}
    assert verdict["O0"] == {"test_accuracy": "indistinguishable", "test_loss": "indistinguishable",
                             "final_train_loss": "indistinguishable",
                             "step_time": "indistinguishable"}
    assert verdict["O2"] == verdict["O0"]  # identical runs
    assert verdict["O4"]["test_accuracy"] == "worse" and verdict["O4"]["step_time"] == "slower"
    assert verdict["O5"]["test_accuracy"] == "better" and verdict["O5"]["step_time"] == "faster"
    # O1 ran 100 steps: compared with the baseline's 100-step runs, on seeds 0-2, not with its
    # 200-step result.
    o1 = rows["O1"]
    assert o1["steps"] == 100 and o1["vs_baseline"]["test_accuracy"]["seeds"] == [0, 1, 2]
    assert [s["baseline_test_accuracy"] for s in o1["per_seed"]] == [acc100[s] for s in (0, 1, 2)]
    assert verdict["O1"]["test_accuracy"] == "indistinguishable"
    assert o1["vs_baseline"]["test_accuracy"]["mean_diff"] == 0
    assert o1["vs_baseline"]["step_time"]["ratio"] == pytest.approx(50.0 / 10.4, rel=0.05)
    # Divergence: O2 follows the baseline exactly, O5's curve starts 0.1 higher.
    assert rows["O2"]["divergence"]["mean"] == 0 and rows["O2"]["divergence"]["floor"] > 0
    assert 0 < rows["O5"]["divergence"]["mean"] < 0.1
    # O5 is the fastest; O4 is excluded as worse.
    assert summary["fastest_not_worse"] == "O5"
    assert summary["verdict"].startswith("Verdict: O5 is the fastest")
    assert "O4 (test accuracy worse" in summary["verdict"]


def test_report_files(synthetic):
    out, _ = synthetic
    assert ab_report.main(["--out", str(out)]) == 0
    md = (out / "summary.md").read_text()
    for text in ("## Metrics", "## Per seed", "Verdict rule: paired by seed",
                 "| O1 (slow) | 100 x 3 |", "| O4 | 200 x 5 |", "worse", "better",
                 "O0's seed-to-seed distance"):
        assert text in md, text
    assert md.count("| O0 | ") == 5 + 3  # per-seed rows: the baseline's 200- and 100-step runs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rule"] == ab_stats.RULE and summary["baseline"] == "O0"
    o4 = next(r for r in summary["levels"] if r["level"] == "O4")
    assert len(o4["per_seed"]) == 5 and o4["test_accuracy"]["n"] == 5
    pytest.importorskip("matplotlib")
    assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_plan_and_failed_runs(tmp_path):
    """No plan.json: levels from --levels, seeds from the files. An unsupported level and a
    failed seed are reported, not compared."""
    for s in (0, 1):
        write_run(tmp_path, "O0", s, 30, 80.0 + s, 2.0, 10.0)
        write_run(tmp_path, "O2", s, 30, 80.5 + s, 2.0, 12.0)
        (tmp_path / f"O3-s{s}.status").write_text(json.dumps(
            {"status": "unsupported", "exit_code": 3, "message": "no fp16 here"}))
    (tmp_path / "O2-s1.status").write_text(json.dumps(
        {"status": "failed", "exit_code": 1, "message": "boom"}))
    summary, _ = ab_report.build(str(tmp_path), ["O0", "O2", "O3"])
    rows = {r["level"]: r for r in summary["levels"]}
    assert rows["O0"]["seeds_ok"] == [0, 1] and rows["O0"]["steps"] == 30
    assert rows["O2"]["status"] == "partly failed"
    assert "seed 1: failed boom" in rows["O2"]["message"]
    assert rows["O2"]["vs_baseline"]["test_accuracy"]["verdict"] == "n/a"  # one paired seed
    assert rows["O3"]["status"] == "unsupported" and "vs_baseline" not in rows["O3"]
    assert "Not run: O3" in summary["verdict"]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_shorter_budget_without_its_baseline_runs(tmp_path, schedule):
    """No baseline run of the slow level's budget: with a constant learning rate its test pass
    at that step of the longer run stands in (a shorter run is the prefix of a longer one);
    with a cosine schedule nothing does (the longer run's step 50 is not a 50-step run's end)."""
    for s in (0, 1, 2):
        write_run(tmp_path, "O0", s, 100, 85.0 + s, 2.0, 10.0, {50: 80.0 + s}, schedule=schedule)
        write_run(tmp_path, "O1", s, 50, 80.5 + s, 2.0, 40.0, schedule=schedule)
    summary, _ = ab_report.build(str(tmp_path), ["O0", "O1"])
    o1 = next(r for r in summary["levels"] if r["level"] == "O1")
    acc = o1["vs_baseline"]["test_accuracy"]
    if schedule == "constant":
        assert acc["n"] == 3 and acc["mean_diff"] == pytest.approx(0.5)
        assert [s["baseline_test_accuracy"] for s in o1["per_seed"]] == [80.0, 81.0, 82.0]
    else:
        assert acc["n"] == 0 and acc["verdict"] == "n/a"


def test_report_lists_the_baselines_shorter_budget(synthetic):
    out, acc100 = synthetic
    summary, _ = ab_report.build(str(out))
    (short,) = summary["baseline_budgets"]
    assert short["level"] == "O0" and short["baseline"] and short["steps"] == 100
    assert short["test_accuracy"]["mean"] == pytest.approx(sum(acc100[s] for s in (0, 1, 2)) / 3)
    ab_report.write_markdown(str(out / "summary.md"), summary, plot=False)
    md = (out / "summary.md").read_text()
    assert "| O0 (baseline) | 200 x 5 |" in md and "| O0 (baseline) | 100 x 3 |" in md
