"""python -m optamp.ab on programs that are not part of the project: a script that speaks the
protocol (optamp.ab.opt_level / seed / report), with planted differences, a crash, a divergence,
an unsupported level and a hang; the protocol functions themselves."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import optamp as amp
from optamp.ab import runner

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# A training loop in miniature: the level and seed from the environment, a loss curve that
# decays with seeded noise, a final "accuracy". What each level does is planted by PLANT (JSON).
PROGRAM = textwrap.dedent("""
    import json, math, os, random, sys, time
    import optamp as amp

    level, seed = amp.ab.opt_level("O0"), amp.ab.seed(0)
    plant = json.loads(os.environ.get("PLANT", "{}")).get(level, {})
    if plant.get("crash_seed") == seed:
        raise RuntimeError("planted crash")
    if plant.get("unsupported"):
        raise NotImplementedError(f"{level} is not supported here")
    if plant.get("hang"):
        time.sleep(60)
    ballast = b"\x01" * (plant.get("ballast_mb", 0) * 2**20)
    rng = random.Random(seed)
    for step in range(1, 41):
        loss = 2.0 * math.exp(-step / 10) + 0.3 + rng.gauss(0, 0.01)
        if plant.get("diverge") and step > 30:
            loss = float("nan")
        amp.ab.report(step=step, loss=loss, step_ms=10.0 * plant.get("slower", 1.0)
                      * (1 + 0.01 * rng.random()), loss_scale=65536.0, skipped=False)
    amp.ab.report(step=40, accuracy=80.0 + rng.gauss(0, 0.2) + plant.get("accuracy", 0.0))
    amp.ab.report(accuracy=80.0 + rng.gauss(0, 0.2) + plant.get("accuracy", 0.0),
                  bpc=1.5 + rng.gauss(0, 0.01), device="cpu", batch_size=8)
""")


def run_ab(tmp_path, plant, *options, timeout=300):
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    out = tmp_path / "out"
    env = dict(os.environ, PLANT=json.dumps(plant),
               PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    for var in (amp.ab.OPT_LEVEL_ENV, amp.ab.SEED_ENV, amp.ab.METRICS_ENV):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "optamp.ab", "--out", str(out), *options, "--",
                           sys.executable, str(program)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    summary = None
    if (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
    return proc, out, summary


def levels_of(summary):
    return {r["level"]: r for r in summary["levels"]}


def test_any_program_gets_verdicts_per_level(tmp_path):
    """O1 planted 3 points more accurate and half as fast, O2 identical to O0: the report
    compares every metric the program reported (higher accuracy is better, lower bpc and loss)
    and the step time, seed by seed."""
    plant = {"O1": {"accuracy": 3.0, "slower": 2.0}}
    proc, out, summary = run_ab(tmp_path, plant, "--levels", "O0,O1,O2", "--seeds", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = levels_of(summary)
    assert [m["name"] for m in summary["metrics"]] == ["accuracy", "bpc", "final_train_loss"]
    assert [m["higher_is_better"] for m in summary["metrics"]] == [True, False, False]
    o1, o2 = rows["O1"]["vs_baseline"], rows["O2"]["vs_baseline"]
    assert o1["accuracy"]["verdict"] == "better" and o1["step_time"]["verdict"] == "slower"
    assert o1["step_time"]["ratio"] == pytest.approx(2.0, rel=0.02)
    assert o2["accuracy"]["verdict"] == "indistinguishable" and o2["accuracy"]["mean_diff"] == 0
    assert o2["step_time"]["verdict"] == "indistinguishable"
    assert summary["fastest_not_worse"] in ("O0", "O2")
    assert all(r["status"] == "ok" and r["steps"] == 40 for r in rows.values())
    assert rows["O0"]["peak_memory_mb"] > 0 and rows["O0"]["peak_memory_kind"] == "cpu_peak_rss"
    # Every run's files, the environment the program saw, the progress and the report.
    for level in ("O0", "O1", "O2"):
        for seed in (0, 1, 2):
            status = json.loads((out / f"{level}-s{seed}.status").read_text())
            assert status["status"] == "ok" and status["opt_level"] == level
            assert status["seed"] == seed
    assert "[9/9] O2 seed 2: ok, 40 steps" in proc.stderr
    md = (out / "summary.md").read_text()
    assert "| O1 | 40 x 3 |" in md and "better" in md and "train.py" in md
    assert proc.stdout.startswith("Verdict: ")


def test_crash_divergence_and_unsupported_are_verdicts(tmp_path):
    """A crash on one seed, a diverged level and an unsupported one do not stop the others;
    each is named in the report, and an unsupported level is not retried on the next seeds."""
    plant = {"O1": {"crash_seed": 1}, "O2": {"diverge": True}, "O3": {"unsupported": True}}
    proc, out, summary = run_ab(tmp_path, plant, "--levels", "O0,O1,O2,O3", "--seeds", "2")
    assert proc.returncode == 1  # a run failed
    rows = levels_of(summary)
    assert rows["O0"]["status"] == "ok"
    assert rows["O1"]["status"] == "partly failed" and "planted crash" in rows["O1"]["message"]
    assert rows["O2"]["status"] == "diverged"
    assert rows["O3"]["status"] == "unsupported"
    assert "not supported here" in rows["O3"]["message"]
    assert json.loads((out / "O3-s1.status").read_text())["seconds"] == 0  # not rerun
    assert not (out / "O3-s1.log").exists()
    assert "O2 (diverged)" in summary["verdict"] and "O3" in summary["verdict"]
    assert "Some seeds did not finish: O1" in summary["verdict"]


def test_timeout_and_memory(tmp_path):
    """--timeout kills a hanging run (a failure, named as such); the peak RSS is the run's own.
    The baseline's peak is reached while torch imports; 600 MB held after it shows anyway."""
    plant = {"O1": {"hang": True}, "O2": {"ballast_mb": 600}}
    proc, out, summary = run_ab(tmp_path, plant, "--levels", "O0,O1,O2", "--seeds", "1",
                                "--timeout", "10")
    rows = levels_of(summary)
    assert rows["O1"]["status"] == "failed" and "killed after 10 s" in rows["O1"]["message"]
    assert json.loads((out / "O1-s0.status").read_text())["status"] == "timeout"
    assert rows["O2"]["peak_memory_mb"] > rows["O0"]["peak_memory_mb"] + 300
    assert rows["O2"]["peak_memory_ratio"] > 1.4


@pytest.mark.parametrize("options,message", [
    ([], "give the command to run after --"),
    (["--levels", "O1,O9", "--"], "--levels must list opt levels"),
    (["--seeds", "0", "--"], "--seeds takes"),
    (["--timeout", "0", "--"], "--timeout must be > 0"),
    (["--"], "no command after --"),
])
def test_bad_options(options, message, capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(options + (["true"] if options and options[-1] == "--" and
                               options != ["--"] else []))
    assert e.value.code != 0
    text = str(e.value.code) + capsys.readouterr().err
    assert message in text


def test_plan_file(tmp_path):
    plan = tmp_path / "runs.tsv"
    plan.write_text("O0\t0\tO0-s0\t--steps\t5\nO1\t0\tO1-s0\n")
    assert runner.read_plan_file(str(plan)) == [("O0", 0, "O0-s0", ["--steps", "5"]),
                                                ("O1", 0, "O1-s0", [])]
    plan.write_text("O7\t0\tx\n")
    with pytest.raises(ValueError, match="line 1: expected"):
        runner.read_plan_file(str(plan))


# ---- the protocol --------------------------------------------------------------------------
def test_opt_level_and_seed_come_from_the_environment_only_when_asked(monkeypatch):
    monkeypatch.delenv(amp.ab.OPT_LEVEL_ENV, raising=False)
    monkeypatch.delenv(amp.ab.SEED_ENV, raising=False)
    assert amp.ab.opt_level("O2") == "O2" and amp.ab.seed(7) == 7
    monkeypatch.setenv(amp.ab.OPT_LEVEL_ENV, "O5")
    monkeypatch.setenv(amp.ab.SEED_ENV, "3")
    assert amp.ab.opt_level("O2") == "O5" and amp.ab.seed(7) == 3
    monkeypatch.setenv(amp.ab.OPT_LEVEL_ENV, "fast")
    with pytest.raises(ValueError, match="OPTAMP_OPT_LEVEL must be an opt level O0..O5, got 'fast'"):
        amp.ab.opt_level()
    monkeypatch.setenv(amp.ab.SEED_ENV, "-1")
    with pytest.raises(ValueError, match="OPTAMP_SEED must be an integer >= 0, got '-1'"):
        amp.ab.seed()


def test_reporter_lines(tmp_path):
    import torch

    path = tmp_path / "m.jsonl"
    rep = amp.ab.Reporter(str(path))
    rep.report(step=1, loss=torch.tensor(0.5), skipped=False)
    rep.report(val_bpc=float("nan"), device="cpu")
    with pytest.raises(ValueError, match='"t" is the reporter'):
        rep.report(t=1.0)
    with pytest.raises(TypeError, match="must be a number, bool, str or one-element tensor"):
        rep.report(weights=[1, 2])
    rep.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["loss"] == 0.5 and lines[0]["skipped"] is False
    assert lines[1]["device"] == "cpu" and lines[1]["val_bpc"] != lines[1]["val_bpc"]  # NaN
    assert all(line["t"] >= 0 for line in lines)
    inactive = amp.ab.Reporter(None)
    inactive.report(step=1, loss=1.0)  # writes nothing, fails on nothing
    assert not inactive.active


PROBED = textwrap.dedent("""
    import torch
    import optamp as amp

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Linear(8, 8)
            self.big = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.big(self.small(x))

    torch.manual_seed(amp.ab.seed(0))
    model = Net()
    with torch.no_grad():  # big's outputs exceed fp16's range (65504): inf at O1, fine at O0
        model.big.weight.fill_(1e6)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=amp.ab.opt_level("O0"),
                                      verbosity=0)
    for step in range(1, 9):
        x = torch.ones(4, 8)
        loss = model(x).float().pow(2).mean() * 1e-12
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        amp.ab.report(step=step, loss=1.0 / step)
    amp.ab.report(score=1.0)
""")


def test_only_global_rank_zero_reports(tmp_path, monkeypatch):
    # Every rank writing into the one metrics file interleaved their losses, and the runner took
    # the gaps between ranks' lines for steps.
    for name in amp.ab.RANK_ENVS:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "m.jsonl"
    for rank in ("1", "0", None):
        if rank is None:
            monkeypatch.delenv("RANK")
        else:
            monkeypatch.setenv("RANK", rank)
        assert amp.ab.reports_here() == (rank in ("0", None))
        amp.ab.Reporter(str(path)).report(step=1, loss=0.5)
    assert len(path.read_text().splitlines()) == 2, "rank 0 and a program that is not distributed"
    monkeypatch.setenv("PMI_RANK", "2")
    assert not amp.ab.reports_here()


def test_precision_steps_put_each_levels_table_in_the_report(tmp_path):
    """--precision-steps 2: each level's first seed records the per-op report from initialize
    to its step 2; the report names the op and module that first overflowed at O1."""
    program = tmp_path / "probed.py"
    program.write_text(PROBED)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "optamp.ab", "--out", str(out), "--levels",
                           "O0,O1", "--seeds", "2", "--precision-steps", "2", "--no-progress",
                           "--", sys.executable, str(program)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = levels_of(json.loads((out / "summary.json").read_text()))
    o0, o1 = rows["O0"]["precision"], rows["O1"]["precision"]
    assert o0["first_nonfinite"] is None and o0["steps"] == 2
    first = o1["first_nonfinite"]
    assert first["scope"] == "big" and first["phase"] == "forward", first
    assert "| aten::" in o1["table"] and "big" in o1["table"]
    # Only the first seed is probed.
    assert sum('"type": "precision"' in (out / f"O1-s{s}.jsonl").read_text() for s in (0, 1)) == 1
    md = (out / "summary.md").read_text()
    assert "## Where precision is lost" in md and "### O1" in md
    assert "First inf/NaN: " in md and "in big, forward" in md
    assert "already in its inputs" not in md


def test_the_report_says_where_no_op_made_the_first_inf():
    from optamp.ab.summary import describe_nonfinite
    first = {"op": "aten::addmm", "scope": "head", "phase": "forward", "node": ""}
    assert describe_nonfinite(first) == "aten::addmm in head, forward"
    assert describe_nonfinite(dict(first, from_inputs=True)) == (
        "aten::addmm in head, forward (no op made one: already in its inputs)")
