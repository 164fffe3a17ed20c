"""The A/B main job: both trainers at every level, report files, determinism, progress line,
--epochs, --seeds end to end, evaluation on each level's own trained weights, --eval-at, and
(with a GPU) --device cuda. The report's statistics on synthetic data: test_ab_stats.py.

Every level must finish with status "ok" on the CPU: none may fail or report itself
unsupported. Tests that train need Fashion-MNIST and are skipped without it; the argument and
missing-data tests run anyway.

The C++ trainer (examples/cpp/train_fashion_mnist) is looked up in OPTAMP_BUILD_DIR (default
./build), where the project's build puts it (OPTAMP_BUILD_EXAMPLES, on by default); its tests
fail when it is missing.
"""
import json
import math
import os
import pty
import re
import subprocess
import sys

import pytest

from common_utils import (BIN, DATA, PY_TRAINER, ROOT, env, load_script, needs_data,
                          trainer_binary)

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
STATIC_SCALE_LEVELS = {"O0", "O3", "O4", "O5"}  # loss scale 1.0, never skips (docs/opt_levels.md)
# Batches of 16, not the trainers' 64: the fp16 levels' convolution weight gradient is the
# suite's most expensive op on a CPU with AVX512-FP16, where torch hands it to oneDNN's reference
# code (this CNN's second convolution: 0.4 s at batch 64, bf16 0.5 ms; O1 took 13 s for 20 steps,
# O0 1.5 s, on an Intel Xeon with AMX). It scales with the batch; 20 steps of 16 still learn
# (test accuracy near 49% at every level) and overflow once at O1/O2.
BATCH = 16
SMALL = ["--steps", "20", "--subset", "512", "--test-subset", "1000", "--seed", "0",
         "--batch-size", str(BATCH)]
SUMMARY_FIELDS = ["test_accuracy", "test_loss", "peak_memory_mb", "peak_memory_kind",
                  "median_step_ms", "samples_per_s", "final_train_loss", "skipped_steps",
                  "final_loss_scale"]
VERDICTS = {"better", "worse", "indistinguishable", "n/a"}

REPORT_HEADER = "Selected optimization level"  # Apex's properties report, first line
OVERFLOW = "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to "


def trainer(kind):
    """The command that starts the C++ trainer or its Python twin."""
    return [trainer_binary()] if kind == "cpp" else [sys.executable, PY_TRAINER]


def read_metrics(path):
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    by_type = {}
    for o in objs:
        by_type.setdefault(o["type"], []).append(o)
    return by_type


def check_metrics(m, level, steps=20, batch=64, tiny=False, memory_kind="cpu_peak_rss"):
    """``tiny``: a run of a few steps, too short to check learning (accuracy, falling loss).
    ``memory_kind``: cpu_peak_rss on the CPU, cuda_peak_allocated with --device cuda."""
    assert len(m["config"]) == 1 and m["config"][0]["opt_level"] == level
    assert m["config"][0]["steps"] == steps
    rows = m["step"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert set(r) >= {"step", "loss", "loss_scale", "skipped", "step_ms"}
        assert isinstance(r["skipped"], bool)
        assert r["step_ms"] > 0 and r["loss_scale"] > 0
        assert r["skipped"] or (r["loss"] is not None and 0 < r["loss"] < 10)
    (s,) = m["summary"]
    for k in SUMMARY_FIELDS:
        assert s.get(k) is not None, k
    assert s["steps"] == steps and s["batch_size"] == batch
    assert 0 <= s["test_accuracy"] <= 100
    if not tiny:
        assert s["test_accuracy"] >= 15  # 20 steps reach well above chance (10%)
    assert s["peak_memory_mb"] > 0 and s["peak_memory_kind"] == memory_kind
    assert s["median_step_ms"] > 0 and s["samples_per_s"] > 0
    assert math.isclose(s["samples_per_s"], batch / (s["median_step_ms"] / 1000), rel_tol=1e-3)
    first = next(r["loss"] for r in rows if r["loss"] is not None)
    assert 0 < s["final_train_loss"] < (10 if tiny else first)
    assert 0 <= s["skipped_steps"] <= steps // 2
    assert s["skipped_steps"] == sum(r["skipped"] for r in rows)
    assert 0 < s["final_loss_scale"] <= 2.0**24
    if level in STATIC_SCALE_LEVELS:
        assert s["final_loss_scale"] == 1 and s["skipped_steps"] == 0


def run_ab(out, *extra, levels=LEVELS, budget=SMALL):
    """scripts/ab_test.sh; SMALL's --seed 0 is one seed (20 steps for every level: the slow
    budget's 100 steps are capped by --steps)."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "ab_test.sh"), "--out", str(out), "--levels",
           ",".join(levels), *extra, *budget]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    """One scripts/ab_test.sh run of the C++ trainer over every level: 20 steps of 16 images."""
    binary = trainer_binary()
    out = tmp_path_factory.mktemp("ab")
    return out, run_ab(out, "--bin", binary)


@pytest.fixture(scope="module")
def py_ab_run(tmp_path_factory):
    """The same with the Python twin (ab_test.sh --python): every level, 20 steps of 16."""
    out = tmp_path_factory.mktemp("ab_py")
    return out, run_ab(out, "--python", "--no-build")


def check_level(out, proc, level, seed=0):
    """One level of an ab_test.sh run: status ok, metrics, logs."""
    with open(out / f"{level}-s{seed}.status") as f:
        status = json.load(f)
    # No level may be unsupported or fail on the CPU.
    assert status["status"] == "ok", (status, proc.stdout[-3000:], proc.stderr[-3000:])
    m = read_metrics(out / f"{level}-s{seed}.jsonl")
    check_metrics(m, level, batch=BATCH)
    assert m["config"][0]["seed"] == seed
    log = (out / f"{level}-s{seed}.log").read_text()
    assert log.count(REPORT_HEADER) == 1, log  # Apex's report, printed once (by initialize)
    assert f"opt_level                  : {level}" in log
    assert log.splitlines()[-1].startswith(f"summary: {level} cpu | test accuracy ")
    # stderr (no terminal: no progress line) has Apex's line for every skipped step, no other.
    err = (out / f"{level}-s{seed}.err").read_text()
    assert "it/s" not in err and "\r" not in err
    overflows = [line for line in err.splitlines() if line.startswith(OVERFLOW)]
    assert len(overflows) == m["summary"][0]["skipped_steps"], err
    return m


@needs_data
@pytest.mark.parametrize("level", LEVELS)
def test_trainer_level(ab_run, level):
    check_level(*ab_run, level)


@needs_data
@pytest.mark.parametrize("level", LEVELS)
def test_python_twin_level(py_ab_run, level):
    m = check_level(*py_ab_run, level)
    import optamp
    assert m["config"][0]["program"] == "train_fashion_mnist.py"
    assert m["config"][0]["optamp"] == optamp.__version__


def check_report(out, proc, levels=LEVELS, seeds=(0,)):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary.md" in proc.stdout
    assert "bootstrap: python " in proc.stdout  # ab_test.sh bootstraps on every run
    # Before training: the CPU's bf16/fp16 instructions and every level's budget.
    assert "bf16: avx512_bf16 " in proc.stdout and ", amx_bf16 " in proc.stdout
    assert "Budget per level" in proc.stdout  # printed before the runs (the runner's lines on
    assert "[1/" in proc.stderr and "O0 seed 0: ok" in proc.stderr  # stderr, one per run)
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["baseline"] == "O0"
    assert summary["rule"].startswith("paired by seed")
    assert summary["verdict"].startswith("Verdict: ")
    assert summary["fastest_not_worse"] in levels
    assert summary["cpu"]["bf16"] in ("amx", "avx512_bf16", "emulated")
    assert set(summary["cpu"]["flags"]) >= {"avx512_bf16", "amx_bf16", "amx_tile"}
    assert [r["level"] for r in summary["levels"]] == list(levels)
    for row in summary["levels"]:
        assert row["status"] == "ok", row
        assert row["seeds_ok"] == row["seeds"] and set(row["seeds"]) <= set(seeds)
        assert len(row["per_seed"]) == len(row["seeds"])
        for s in row["per_seed"]:
            for k in ("test_accuracy", "test_loss", "final_train_loss", "median_step_ms",
                      "baseline_test_accuracy", "baseline_median_step_ms", "divergence",
                      "skipped_steps", "final_loss_scale", "peak_memory_mb"):
                assert s.get(k) is not None, (row["level"], s["seed"], k)
            assert 0 <= s["test_accuracy"] <= 100
        for k in ("test_accuracy", "final_train_loss", "step_time"):
            assert row["vs_baseline"][k]["verdict"] in VERDICTS | {"faster", "slower"}
        assert row["vs_baseline"]["step_time"]["ratio"] > 0 and row["peak_memory_ratio"] > 0
        assert row["divergence"]["mean"] >= 0
        # The runner's default --precision-steps 2: every level's per-op table. An inf/NaN only
        # where a dynamic loss scale overflows the scaled backward (and that step is skipped).
        assert "| aten::" in row["precision"]["table"], row["level"]
        first = row["precision"]["first_nonfinite"]
        assert first is None or (row["level"] not in STATIC_SCALE_LEVELS
                                 and first["phase"] == "backward"), (row["level"], first)
    o0 = summary["levels"][0]
    assert o0["baseline"] and o0["vs_baseline"]["step_time"]["ratio"] == 1.0
    assert o0["vs_baseline"]["test_accuracy"]["mean_diff"] == 0.0
    assert o0["divergence"]["mean"] == 0.0
    levels_by_name = {r["level"]: r for r in summary["levels"]}
    for level in levels:  # dynamic scaling at O1/O2 only; the others keep the static 1.0
        for s in levels_by_name[level]["per_seed"]:
            assert (s["final_loss_scale"] > 1) == (level not in STATIC_SCALE_LEVELS)
    md = (out / "summary.md").read_text()
    assert "| level |" in md and "Verdict:" in md and "| O0 (baseline) |" in md
    assert "step time vs O0" in md and "Verdict rule: paired by seed" in md  # names the baseline
    assert "## Per seed" in md and "bf16: avx512_bf16" in md
    assert "## Where precision is lost" in md
    for level in levels[1:]:
        assert f"| {level} |" in md or f"| {level} (slow) |" in md
    # An ok run's last stderr line (progress, warnings) is not reported as its message.
    assert all("message" not in row for row in summary["levels"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # e.g. a GPU machine's bare python3: the report says so, no plot
        assert "install matplotlib" in proc.stderr
        assert "No plot: matplotlib is not installed." in md
        return summary
    assert "Plot: ab.png." in md
    with open(out / "ab.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "ab.png") > 10_000
    return summary


@needs_data
def test_report_files(ab_run):
    summary = check_report(*ab_run)
    assert summary["config"]["program"] == "train_fashion_mnist"
    assert summary["config"]["language"] == "c++"


@needs_data
def test_ab_python_trainer(py_ab_run):
    """scripts/ab_test.sh --python: the Python twin through the whole A/B (bootstrap, every level
    ok, report)."""
    summary = check_report(*py_ab_run)
    assert summary["config"]["program"] == "train_fashion_mnist.py"
    assert summary["config"]["language"] == "python"


@needs_data
@pytest.mark.parametrize("level", LEVELS)
def test_python_twin_reproduces_the_cpp_losses(py_ab_run, request, level):
    """Same init order, shuffling and ops: the twins give the same losses and skipped steps.
    O3 steps fp16 weights, where the two SGD implementations (torch.optim's, torch::optim's) do
    not round alike: close, not equal (measured: at most 0.15% apart over the 20 steps)."""
    if not os.access(BIN, os.X_OK):
        pytest.skip(f"no C++ trainer at {BIN}")
    cpp_out, _ = request.getfixturevalue("ab_run")
    py = read_metrics(py_ab_run[0] / f"{level}-s0.jsonl")
    cpp = read_metrics(cpp_out / f"{level}-s0.jsonl")
    rel = 5e-2 if level == "O3" else 1e-4
    assert [r["loss"] for r in py["step"]] == pytest.approx(
        [r["loss"] for r in cpp["step"]], rel=rel, abs=1e-5)
    assert [r["skipped"] for r in py["step"]] == [r["skipped"] for r in cpp["step"]]
    assert [r["loss_scale"] for r in py["step"]] == [r["loss_scale"] for r in cpp["step"]]


@needs_data
def test_trainer_deterministic(ab_run, tmp_path):
    """A second O0 run gives bit-identical losses and accuracy (ab_test.sh's cosine decay)."""
    path = tmp_path / "again.jsonl"
    subprocess.run([trainer_binary(), "--opt-level", "O0", *SMALL, "--lr-schedule", "cosine",
                    "--metrics", str(path)],
                   check=True, capture_output=True, env=env(), timeout=300)
    runs = [read_metrics(ab_run[0] / "O0-s0.jsonl"), read_metrics(path)]
    losses = [[r["loss"] for r in m["step"]] + [m["summary"][0]["test_accuracy"]] for m in runs]
    assert losses[0] == losses[1]


# ---- --seeds end to end (both trainers) ------------------------------------------------------
TINY = ["--subset", "256", "--test-subset", "200", "--batch-size", str(BATCH)]


@pytest.fixture(scope="module", params=["cpp", "python"])
def seeds_run(request, tmp_path_factory):
    """ab_test.sh --seeds 2 on a tiny subset: O0 (baseline) and O4 for 8 steps, O1 made a slow
    level (4 steps), with each trainer. A few seconds of training."""
    out = tmp_path_factory.mktemp(f"ab_seeds_{request.param}")
    extra = ["--bin", trainer_binary()] if request.param == "cpp" else ["--python", "--no-build"]
    proc = run_ab(out, *extra, levels=["O0", "O1", "O4"],
                  budget=["--seeds", "2", "--steps", "8", "--slow-steps", "4", "--slow-levels",
                          "O1", *TINY])
    return request.param, out, proc


@needs_data
def test_seeds_end_to_end(seeds_run):
    """Every level on each of its seeds (same seed: same init and data order); the slow level
    is compared with the baseline's runs of its own step count; verdicts on 2 seeds."""
    kind, out, proc = seeds_run
    summary = check_report(out, proc, levels=["O0", "O1", "O4"], seeds=(0, 1))
    assert summary["config"]["language"] == ("c++" if kind == "cpp" else "python")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["lr_schedule"] == "cosine"
    budget = {r["level"]: (r["steps"], r["seeds"]) for r in plan["levels"]}
    assert budget == {"O0": (8, [0, 1]), "O1": (4, [0, 1]), "O4": (8, [0, 1])}
    assert plan["levels"][0]["extra"] == [{"steps": 4, "seeds": [0, 1]}]
    rows = {r["level"]: r for r in summary["levels"]}
    (short,) = summary["baseline_budgets"]  # the baseline's 4-step runs, for O1
    assert short["level"] == "O0" and short["steps"] == 4 and short["seeds_ok"] == [0, 1]
    for seed in (0, 1):
        base = read_metrics(out / f"O0-s{seed}.jsonl")
        base4 = read_metrics(out / f"O0-s{seed}-n4.jsonl")
        assert base4["config"][0]["steps"] == 4 and base4["config"][0]["lr_schedule"] == "cosine"
        o1 = next(s for s in rows["O1"]["per_seed"] if s["seed"] == seed)
        assert o1["steps"] == 4
        assert o1["baseline_test_accuracy"] == base4["summary"][0]["test_accuracy"]
        o4 = next(s for s in rows["O4"]["per_seed"] if s["seed"] == seed)
        assert o4["baseline_test_accuracy"] == base["summary"][0]["test_accuracy"]
        for level in ("O1", "O4"):
            m = read_metrics(out / f"{level}-s{seed}.jsonl")
            assert m["config"][0]["seed"] == seed
            # Same seed, same initial weights and data: the first losses nearly agree.
            assert m["step"][0]["loss"] == pytest.approx(base["step"][0]["loss"], rel=2e-2)
    for row in summary["levels"]:  # two seeds: a floor and an interval, so a verdict
        for k in ("test_accuracy", "final_train_loss", "step_time"):
            assert row["vs_baseline"][k]["verdict"] != "n/a", (row["level"], k)
            assert row["vs_baseline"][k]["n"] == 2
    md = (out / "summary.md").read_text()
    assert "| O1 (slow) | 4 x 2 |" in md and "| O4 | 8 x 2 |" in md
    assert "| O0 (baseline) | 8 x 2 |" in md and "| O0 (baseline) | 4 x 2 |" in md


# ---- the test pass sees each level's own trained weights ---------------------------------------
def load_saved_weights(path):
    """The trainers' --save-weights file: torch.save (Python) or torch::jit::pickle_save (C++,
    whose typed dict needs one allow-listed global to load with weights_only)."""
    import torch
    import torch.jit._pickle
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(path)


@needs_data
@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_evaluation_uses_each_levels_trained_weights(kind, tmp_path):
    """Issue 20: four levels once reported the same test accuracy while their training losses
    differed. Each level's reported accuracy and test loss are reproduced exactly by evaluating
    the weights it saved in a plain fp32 model (no amp), and those weights and their test
    logits differ from level to level, even where two accuracies coincide."""
    import torch
    twin = load_script(PY_TRAINER, siblings=["trainer_common"])
    test_x, test_y = twin.load(DATA, False, 1000)
    logits, weights = {}, {}
    for level in ("O0", "O1", "O2", "O4", "O5"):
        path, metrics = tmp_path / f"{level}.pt", tmp_path / f"{level}.jsonl"
        subprocess.run([*trainer(kind), "--opt-level", level, *SMALL, "--metrics", str(metrics),
                        "--save-weights", str(path)], check=True, capture_output=True,
                       env=env(), timeout=600)
        summary = read_metrics(metrics)["summary"][0]
        model = twin.Net()
        weights[level] = load_saved_weights(path)
        model.load_state_dict(weights[level])
        accuracy, test_loss = twin.evaluate(model, test_x, test_y, "cpu")
        assert accuracy == summary["test_accuracy"], level
        assert test_loss == pytest.approx(summary["test_loss"], rel=1e-5), level
        model.eval()
        with torch.no_grad():
            logits[level] = model(twin.to_input(test_x, "cpu"))
    for a, b in (("O0", "O1"), ("O0", "O4"), ("O1", "O4"), ("O2", "O5"), ("O1", "O5")):
        assert any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a]), (a, b)
        assert (logits[a] - logits[b]).abs().max() > 1e-4, (a, b)


@needs_data
@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_eval_at_leaves_training_unchanged(kind, tmp_path):
    """--eval-at: a mid-run test pass changes nothing in training (O2: working copies and
    dynamic loss scaling), and with a constant learning rate it equals the final test pass of a
    run that stops there (optamp.ab.summary relies on that when the baseline has no run of a shorter
    budget; ab_test.sh --epochs uses it for the accuracy after each epoch)."""
    def run(name, *extra):
        path = tmp_path / f"{name}.jsonl"
        subprocess.run([*trainer(kind), "--opt-level", "O2", "--seed", "1", *TINY, *extra,
                        "--metrics", str(path)], check=True, capture_output=True, env=env(),
                       timeout=600)
        return read_metrics(path)
    with_evals = run("evals", "--steps", "12", "--eval-at", "6,12")
    plain = run("plain", "--steps", "12")
    short = run("short", "--steps", "6")
    losses = [r["loss"] for r in with_evals["step"]]
    assert losses == [r["loss"] for r in plain["step"]]
    assert losses[:6] == [r["loss"] for r in short["step"]]
    assert [r["loss_scale"] for r in with_evals["step"]] == [r["loss_scale"] for r in plain["step"]]
    at6, at12 = with_evals["eval"]
    assert (at6["step"], at12["step"]) == (6, 12)
    for mid, end in ((at6, short["summary"][0]), (at12, plain["summary"][0])):
        assert mid["test_accuracy"] == end["test_accuracy"]
        assert mid["test_loss"] == end["test_loss"]


@needs_data
def test_cosine_schedule(tmp_path):
    """--lr-schedule cosine (what ab_test.sh --epochs uses): the twins agree step by step; the
    first step is the constant schedule's (lr at step 0 is the full lr), later ones differ."""
    runs = {}
    for kind, schedule in (("cpp", "cosine"), ("python", "cosine"), ("cpp", "constant")):
        path = tmp_path / f"{kind}-{schedule}.jsonl"
        subprocess.run([*trainer(kind), "--opt-level", "O0", "--epochs", "2", "--subset", "256",
                        "--test-subset", "100", "--lr-schedule", schedule, "--metrics", str(path)],
                       check=True, capture_output=True, env=env(), timeout=300)
        m = read_metrics(path)
        assert m["config"][0]["lr_schedule"] == schedule
        runs[kind, schedule] = [r["loss"] for r in m["step"]]
    cos, const = runs["cpp", "cosine"], runs["cpp", "constant"]
    assert runs["python", "cosine"] == pytest.approx(cos, rel=1e-4, abs=1e-5)
    assert len(cos) == 8 and cos[:2] == const[:2] and cos[2:] != const[2:]


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_trainers_reject_bad_lr_schedule(kind):
    proc = subprocess.run([*trainer(kind), "--lr-schedule", "linear"], capture_output=True,
                          text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and "--lr-schedule" in proc.stderr and "linear" in proc.stderr


@pytest.mark.parametrize("kind", ["cpp", "python"])
@pytest.mark.parametrize("value", ["0", "3,x", ""])
def test_trainers_reject_bad_eval_at(kind, value):
    proc = subprocess.run([*trainer(kind), "--eval-at", value], capture_output=True, text=True,
                          env=env(), timeout=120)
    assert proc.returncode == 2
    assert "--eval-at" in proc.stderr and f'got "{value}"' in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--seeds", "x"], '--seeds takes a count >= 1 or distinct seeds >= 0 separated by commas, '
                       'got "x"'),
    (["--device", "tpu"], '--device must be cpu or cuda, got "tpu"'),
    (["--steps", "-3"], "--steps must be >= 0, got -3"),
    (["--bogus"], "unknown option --bogus"),
])
def test_ab_test_rejects_bad_options(tmp_path, args, message):
    """Bad options stop ab_test.sh before any build or training, naming the option."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ab_test.sh"), "--out",
                           str(tmp_path), "--no-build", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert "[1/" not in proc.stderr  # no run started


# ---- progress line and --epochs (both trainers) ---------------------------------------------
# The trainers print the progress line when OPTAMP_PROGRESS is "1", never when it is "0", and
# when it is unset only if stderr is a terminal (isatty); each line is "\r[LEVEL] step i/N  loss
# L  scale S  R it/s  ETA m:ss   ", the last one followed by a newline.
PROGRESS = re.compile(r"\r\[O0\] step (\d+)/(\d+)  loss (\d+\.\d{4})  scale 1  (\d+\.\d) it/s  "
                      r"ETA (\d+):(\d\d)   ")
KINDS = ["cpp", "python"]


def run_trainer(kind, tmp_path, args, progress, tty=False):
    """Runs one trainer at O0, which must succeed; returns (proc, stderr text, metrics)."""
    metrics = tmp_path / f"{kind}.jsonl"
    cmd = [*trainer(kind), "--opt-level", "O0", *args, "--test-subset", "100", "--seed", "0",
           "--metrics", str(metrics)]
    if not tty:
        # Bytes: text mode would turn the progress line's "\r" into "\n".
        proc = subprocess.run(cmd, capture_output=True, env=env(progress), timeout=300)
        proc.stdout, err = proc.stdout.decode(), proc.stderr.decode()
        assert proc.returncode == 0, err[-3000:]
        return proc, err, read_metrics(metrics)
    master, slave = pty.openpty()  # stderr on a terminal (the output fits the pty's buffer)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True,
                              env=env(progress), timeout=300)  # stdout only: no "\r" there
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child's end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    err = b"".join(chunks).decode()
    assert proc.returncode == 0, err[-3000:]
    return proc, err, read_metrics(metrics)


def check_progress(err, steps):
    lines = PROGRESS.findall(err)
    assert lines, repr(err)
    for step, total, loss, rate, minutes, seconds in lines:
        assert int(total) == steps and 1 <= int(step) <= steps
        assert 0 < float(loss) < 10 and float(rate) > 0
        assert int(minutes) >= 0 and 0 <= int(seconds) < 60
    step, _, _, _, minutes, seconds = lines[-1]
    assert int(step) == steps and (minutes, seconds) == ("0", "00")  # done: nothing left
    last = err.rindex("\r[O0] step")
    assert err[last:].rstrip(" \r\n").endswith("ETA 0:00") and err.endswith("\n")


@needs_data
@pytest.mark.parametrize("kind", KINDS)
def test_progress_forced_on_and_one_epoch(kind, tmp_path):
    """OPTAMP_PROGRESS=1: a progress line with rate and ETA on stderr (not stdout);
    --epochs 1 --subset 256 --batch-size 64: exactly 4 steps."""
    proc, err, m = run_trainer(kind, tmp_path, ["--epochs", "1", "--subset", "256",
                                                "--batch-size", "64"], "1")
    check_progress(err, 4)
    assert "it/s" not in proc.stdout
    check_metrics(m, "O0", steps=4, tiny=True)


@needs_data
@pytest.mark.parametrize("progress", ["0", None], ids=["forced_off", "unset_not_a_tty"])
@pytest.mark.parametrize("kind", KINDS)
def test_no_progress_off_a_terminal_and_two_epochs(kind, progress, tmp_path):
    """OPTAMP_PROGRESS=0, or unset with stderr a pipe: no progress line. --epochs 2 --subset 200
    --batch-size 64: 3 full batches an epoch (the partial one is dropped), 6 steps."""
    proc, err, m = run_trainer(kind, tmp_path, ["--epochs", "2", "--subset", "200",
                                                "--batch-size", "64"], progress)
    assert "it/s" not in err and "\r" not in err and "ETA" not in err, err
    check_metrics(m, "O0", steps=6, tiny=True)
    assert m["config"][0]["train_images"] == 200


@needs_data
@pytest.mark.parametrize("progress", [None, "0"], ids=["unset", "forced_off"])
@pytest.mark.parametrize("kind", KINDS)
def test_progress_on_a_terminal(kind, progress, tmp_path):
    """OPTAMP_PROGRESS unset and stderr a terminal: the progress line (the default for a person
    at a terminal); OPTAMP_PROGRESS=0 turns it off there too."""
    proc, err, m = run_trainer(kind, tmp_path, ["--steps", "3", "--subset", "256"], progress,
                               tty=True)
    err = err.replace("\r\n", "\n")  # the terminal's output processing
    if progress is None:
        check_progress(err, 3)
    else:
        assert "it/s" not in err and "\r" not in err, err
    check_metrics(m, "O0", steps=3, tiny=True)


# ---- GPU: --device cuda (skipped without a visible CUDA device) ------------------------------
@pytest.mark.needs_cuda
@needs_data
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
@pytest.mark.parametrize("kind", KINDS)
def test_trainers_on_cuda(kind, level, tmp_path):
    path = tmp_path / "cuda.jsonl"
    proc = subprocess.run([*trainer(kind), "--device", "cuda", "--opt-level", level, "--steps",
                           "5", "--subset", "512", "--test-subset", "1000", "--seed", "0",
                           "--metrics", str(path)], capture_output=True, text=True, env=env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(REPORT_HEADER) == 1
    assert proc.stdout.splitlines()[-1].startswith(f"summary: {level} cuda | ")
    m = read_metrics(path)
    check_metrics(m, level, steps=5, tiny=True, memory_kind="cuda_peak_allocated")
    assert m["config"][0]["device"] == "cuda" and m["summary"][0]["device"] == "cuda"
    # The caching allocator's peak for this small CNN (batch 64) is a few MB; a process's RSS
    # with a CUDA context is far above this bound, so the number is the allocator's.
    assert m["summary"][0]["peak_memory_mb"] < 256
    if level == "O0":
        assert all(r["loss_scale"] == 1 and not r["skipped"] for r in m["step"])


# ---- no data needed ------------------------------------------------------------------------
def test_trainer_missing_data_names_package(tmp_path):
    binary = trainer_binary()
    proc = subprocess.run([binary, "--data", str(tmp_path / "nowhere"), "--steps", "1"],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 1
    assert "dataset-fashion-mnist" in proc.stderr and "apt-get install" in proc.stderr


def test_trainer_rejects_bad_level():
    proc = subprocess.run([trainer_binary(), "--opt-level", "O9"], capture_output=True,
                          text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and 'got "O9"' in proc.stderr and "usage:" in proc.stderr
    assert "Exception raised from" not in proc.stderr and "frame #" not in proc.stderr


def test_python_twin_requires_optamp(tmp_path):
    """No silent fallback: when optamp cannot be imported the trainer fails, even at O0."""
    fake = tmp_path / "optamp"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('optamp deliberately broken')\n")
    e = env()
    e["PYTHONPATH"] = str(tmp_path) + os.pathsep + e["PYTHONPATH"]
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, PY_TRAINER, "--opt-level", "O0", *SMALL,
                           "--metrics", str(metrics)], capture_output=True, text=True, env=e,
                          timeout=120)
    assert proc.returncode != 0 and proc.returncode != 3, proc.stdout[-2000:]
    assert "optamp deliberately broken" in proc.stderr
    assert not metrics.exists()


def test_python_twin_missing_data_names_package(tmp_path):
    proc = subprocess.run([sys.executable, PY_TRAINER, "--data", str(tmp_path), "--steps", "1"],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 1
    assert "dataset-fashion-mnist" in proc.stderr and "apt-get install" in proc.stderr
