"""The A/B main job: trainer binary per level, report files, determinism, Python twin.

Every level must finish with status "ok" on the CPU: none may fail or report itself
unsupported.

The C++ trainer (examples/cpp/train_fashion_mnist) is looked up in OPTAMP_BUILD_DIR (default
./build), where the project's build puts it (OPTAMP_BUILD_EXAMPLES, on by default); its tests
fail when it is missing.
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("OPTAMP_BUILD_DIR", os.path.join(ROOT, "build"))
BIN = os.path.join(BUILD, "examples", "cpp", "train_fashion_mnist")
PY_TRAINER = os.path.join(ROOT, "examples", "python", "train_fashion_mnist.py")
DATA = "/usr/share/datasets/fashion-mnist"
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
STATIC_SCALE_LEVELS = {"O0", "O3", "O4", "O5"}  # ARCHITECTURE §3: loss scale 1.0, never skips
SMALL = ["--steps", "20", "--subset", "512", "--test-subset", "1000", "--seed", "0"]
SUMMARY_FIELDS = ["test_accuracy", "peak_memory_mb", "peak_memory_kind", "median_step_ms",
                  "samples_per_s", "final_train_loss", "skipped_steps", "final_loss_scale"]

if not os.path.isfile(os.path.join(DATA, "train-images-idx3-ubyte.gz")):
    pytest.skip(f"Fashion-MNIST not in {DATA}: sudo apt-get install dataset-fashion-mnist",
                allow_module_level=True)


def trainer_binary():
    if not os.access(BIN, os.X_OK):
        pytest.fail(f"{BIN} is missing: build the project with its examples "
                    "(OPTAMP_BUILD_EXAMPLES=ON, the default) or set OPTAMP_BUILD_DIR")
    return BIN


def env():
    e = dict(os.environ, OPTAMP_PYTHON=sys.executable, OPTAMP_PROGRESS="0")
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def read_metrics(path):
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    by_type = {}
    for o in objs:
        by_type.setdefault(o["type"], []).append(o)
    return by_type


def check_metrics(m, level, steps=20, batch=64, tiny=False):
    """``tiny``: a run of a few steps, too short to check learning (accuracy, falling loss)."""
    assert len(m["config"]) == 1 and m["config"][0]["opt_level"] == level
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
    assert s["peak_memory_mb"] > 0 and s["peak_memory_kind"] == "cpu_peak_rss"
    assert s["median_step_ms"] > 0 and s["samples_per_s"] > 0
    assert math.isclose(s["samples_per_s"], batch / (s["median_step_ms"] / 1000), rel_tol=1e-3)
    first = next(r["loss"] for r in rows if r["loss"] is not None)
    assert 0 < s["final_train_loss"] < (10 if tiny else first)
    assert 0 <= s["skipped_steps"] <= steps // 2
    assert s["skipped_steps"] == sum(r["skipped"] for r in rows)
    assert 0 < s["final_loss_scale"] <= 2.0**24
    if level in STATIC_SCALE_LEVELS:
        assert s["final_loss_scale"] == 1 and s["skipped_steps"] == 0


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    """One scripts/ab_test.sh run over every level: 20 steps on 512 images each."""
    binary = trainer_binary()
    out = tmp_path_factory.mktemp("ab")
    cmd = ["bash", os.path.join(ROOT, "scripts", "ab_test.sh"), "--bin", binary, "--out",
           str(out), "--levels", ",".join(LEVELS), *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    return out, proc


@pytest.mark.parametrize("level", LEVELS)
def test_trainer_level(ab_run, level):
    out, proc = ab_run
    with open(out / f"{level}.status") as f:
        status = json.load(f)
    # No level may be unsupported or fail on the CPU.
    assert status["status"] == "ok", (status, proc.stdout[-3000:], proc.stderr[-3000:])
    check_metrics(read_metrics(out / f"{level}.jsonl"), level)


def test_report_files(ab_run):
    out, proc = ab_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary.md" in proc.stdout
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["baseline"] == "O0"
    assert summary["equal_accuracy_points"] == 1.0
    assert summary["verdict"].startswith("Verdict: ")
    assert summary["fastest_at_equal_accuracy"] in LEVELS
    assert [r["level"] for r in summary["levels"]] == LEVELS
    for row in summary["levels"]:
        assert row["status"] == "ok", row
        for k in SUMMARY_FIELDS + ["step_time_ratio", "peak_memory_ratio", "accuracy_delta"]:
            assert row.get(k) is not None, (row["level"], k)
        assert row["step_time_ratio"] > 0 and row["peak_memory_ratio"] > 0
        assert 0 <= row["test_accuracy"] <= 100
    o0 = summary["levels"][0]
    assert o0["step_time_ratio"] == 1.0 and o0["accuracy_delta"] == 0.0
    md = (out / "summary.md").read_text()
    assert "| level |" in md and "Verdict:" in md and "| O0 (baseline) |" in md
    assert "step time vs O0" in md  # headers name the baseline
    for level in LEVELS[1:]:
        assert f"| {level} |" in md
    # An ok level's last stderr line (progress, warnings) is not reported as its message.
    assert all("message" not in row for row in summary["levels"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # e.g. a GPU machine's bare python3: the report says so, no plot
        assert "install matplotlib" in proc.stderr
        assert "No plot: matplotlib is not installed." in md
        return
    assert "Plot: ab.png." in md
    with open(out / "ab.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "ab.png") > 10_000


PY_AB_LEVELS = ["O0", "O1"]  # fp32 baseline, fp16 with dynamic scaling (one process a level)
PY_AB_TINY = ["--steps", "3", "--batch-size", "8", "--subset", "64", "--test-subset", "100",
              "--seed", "0"]


def test_ab_python_trainer(tmp_path):
    """scripts/ab_test.sh --python: the Python trainer through the whole A/B (bootstrap, every
    level ok, report), on a tiny run (about 15 s on 2 cores, mostly process start-up)."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "ab_test.sh"), "--python", "--no-build",
           "--out", str(tmp_path), "--levels", ",".join(PY_AB_LEVELS), *PY_AB_TINY]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bootstrap: python " in proc.stdout  # ab_test.sh bootstraps on every run
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["baseline"] == "O0"
    assert summary["config"]["program"] == "train_fashion_mnist.py"
    assert summary["config"]["language"] == "python"
    assert [r["level"] for r in summary["levels"]] == PY_AB_LEVELS
    for row in summary["levels"]:
        assert row["status"] == "ok", row
        assert "message" not in row, row
        with open(tmp_path / f"{row['level']}.status") as f:
            assert json.load(f)["status"] == "ok"
        check_metrics(read_metrics(tmp_path / f"{row['level']}.jsonl"), row["level"], steps=3,
                      batch=8, tiny=True)
    assert summary["levels"][1]["final_loss_scale"] > 1  # O1: dynamic scaling (O0: static 1)


def test_trainer_deterministic(tmp_path):
    binary = trainer_binary()
    losses = []
    for i in range(2):
        path = tmp_path / f"run{i}.jsonl"
        subprocess.run([binary, "--opt-level", "O0", *SMALL, "--metrics", str(path)],
                       check=True, capture_output=True, env=env(), timeout=300)
        m = read_metrics(path)
        losses.append([r["loss"] for r in m["step"]] + [m["summary"][0]["test_accuracy"]])
    assert losses[0] == losses[1]


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


def test_python_twin_o0(tmp_path):
    """The Python twin writes the same metrics; at O0 it reproduces the C++ losses."""
    path = tmp_path / "py.jsonl"
    proc = subprocess.run([sys.executable, PY_TRAINER, "--opt-level", "O0", *SMALL,
                           "--metrics", str(path)], capture_output=True, text=True, env=env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("summary: O0 cpu")
    py = read_metrics(path)
    check_metrics(py, "O0")
    import optamp
    assert py["config"][0]["optamp"] == optamp.__version__
    if os.access(BIN, os.X_OK):
        cpp_path = tmp_path / "cpp.jsonl"
        subprocess.run([BIN, "--opt-level", "O0", *SMALL, "--metrics", str(cpp_path)],
                       check=True, capture_output=True, env=env(), timeout=300)
        cpp = read_metrics(cpp_path)
        assert [r["loss"] for r in py["step"]] == pytest.approx(
            [r["loss"] for r in cpp["step"]], rel=1e-4, abs=1e-5)


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
