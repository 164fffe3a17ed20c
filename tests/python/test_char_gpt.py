"""The char-GPT A/B workload (docs/char_gpt.md): both trainers at O0/O1/O2/O4/O5 for a few steps
of the `test` preset, their A/B JSON lines, OPTAMP_OPT_LEVEL/OPTAMP_SEED, determinism, the twins'
agreement (bit-identical losses and val_bpc on the CPU), bad arguments, a missing stdlib file, the
gpu preset's model on the CPU and the file lists of the two trainers.

The C++ trainer is looked up in OPTAMP_BUILD_DIR (default ./build) as
examples/cpp/train_char_gpt; its tests are skipped when it is not built. Both trainers read the
stdlib of the Python running the tests (the same bytes for both). 46-70 s on 2 busy cores.
"""
import json
import math
import os
import re
import subprocess
import sys
import sysconfig

import pytest

from common_utils import BUILD, ROOT, load_script

BIN = os.path.join(BUILD, "examples", "cpp", "train_char_gpt")
PY_TRAINER = os.path.join(ROOT, "examples", "python", "train_char_gpt.py")
HEADER = os.path.join(ROOT, "examples", "cpp", "char_gpt.h")
STDLIB = sysconfig.get_paths()["stdlib"]
LEVELS = ["O0", "O1", "O2", "O4", "O5"]
STEPS = 3
SMALL = ["--preset", "test", "--steps", str(STEPS), "--eval-every", "2", "--eval-bytes", "1024",
         "--data", STDLIB]
FINAL_KEYS = {"val_bpc", "train_bpc", "tokens_per_s", "device", "batch_size", "seq_len", "params",
              "train_bytes", "val_bytes", "preset", "torch", "opt_level", "seed", "t"}
ENV_KEYS = ("OPTAMP_OPT_LEVEL", "OPTAMP_SEED", "OPTAMP_AB_METRICS")

py_gpt = load_script(PY_TRAINER, siblings=["trainer_common"])

needs_binary = pytest.mark.skipif(
    not os.access(BIN, os.X_OK),
    reason=f"C++ trainer not built: {BIN} (cmake --build <build> --target train_char_gpt)")


def command(kind):
    return [BIN] if kind == "cpp" else [sys.executable, PY_TRAINER]


def train(kind, tmp_path, *args, env=None, name="m"):
    """Runs a trainer with OPTAMP_AB_METRICS set; returns (process, JSON lines)."""
    metrics = tmp_path / f"{kind}-{name}.jsonl"
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    full_env.update(env or {}, OPTAMP_AB_METRICS=str(metrics), OPTAMP_PROGRESS="0")
    full_env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python"), full_env.get("PYTHONPATH", "")])
    proc = subprocess.run(command(kind) + list(args), env=full_env, capture_output=True,
                          text=True, timeout=120)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    return proc, lines


def split(lines):
    """(step lines, eval lines, final line) of a run's JSON lines."""
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "step" in r and "val_bpc" in r and "loss" not in r]
    finals = [r for r in lines if "step" not in r]
    assert len(finals) == 1, lines
    assert len(steps) + len(evals) + 1 == len(lines), lines
    return steps, evals, finals[0]


def check_run(proc, lines, level, steps=STEPS, seed=0):
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"summary: {level} cpu test seed {seed} | val bpc "), proc.stdout
    rows, evals, final = split(lines)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert isinstance(r["skipped"], bool) and not r["skipped"]
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 6  # ln 256 = 5.55 at the start
        assert r["step_ms"] > 0 and r["loss_scale"] > 0 and r["lr"] > 0
        assert r["loss_scale"] == (65536 if level in ("O1", "O2") else 1)
    assert [e["step"] for e in evals] == [s for s in range(1, steps + 1)
                                          if s % 2 == 0 or s == steps]
    assert all(math.isfinite(e["val_bpc"]) and 0 < e["val_bpc"] < 9 for e in evals)
    assert set(final) >= FINAL_KEYS
    assert final["val_bpc"] == evals[-1]["val_bpc"]
    tail = [r["loss"] for r in rows][-20:]
    assert final["train_bpc"] == pytest.approx(sum(tail) / len(tail) / math.log(2), rel=1e-12)
    assert final["opt_level"] == level and final["seed"] == seed and final["steps"] == steps
    assert final["preset"] == "test" and final["device"] == "cpu"
    assert (final["batch_size"], final["seq_len"], final["d_model"]) == (4, 32, 32)
    assert final["tokens_per_s"] > 0 and final["params"] > 0
    assert final["train_bytes"] > 1_000_000 and 100_000 < final["val_bytes"] < final["train_bytes"]
    assert final["eval_windows"] == 1024 // 32
    return rows, evals, final


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every (kind, level) run once: the A/B lines of each."""
    tmp = tmp_path_factory.mktemp("char_gpt")
    out = {}
    for kind in ("cpp", "python"):
        if kind == "cpp" and not os.access(BIN, os.X_OK):
            continue
        for level in LEVELS:
            out[kind, level] = train(kind, tmp, "--opt-level", level, *SMALL, name=level)
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", [pytest.param("cpp", marks=needs_binary), "python"])
def test_level_runs(runs, kind, level):
    rows, _, final = check_run(*runs[kind, level], level)
    assert final["language"] == ("c++" if kind == "cpp" else "python")


@needs_binary
@pytest.mark.parametrize("level", LEVELS)
def test_twins_agree(runs, level):
    """Same model, init order, batches, schedule and ops: on the CPU the twins give bit-identical
    losses and held-out bpc at every level tested (docs/char_gpt.md)."""
    cpp_rows, cpp_evals, cpp_final = split(runs["cpp", level][1])
    py_rows, py_evals, py_final = split(runs["python", level][1])
    assert [r["loss"] for r in py_rows] == [r["loss"] for r in cpp_rows]
    assert [r["lr"] for r in py_rows] == [r["lr"] for r in cpp_rows]
    assert [e["val_bpc"] for e in py_evals] == [e["val_bpc"] for e in cpp_evals]
    for key in ("params", "train_bytes", "val_bytes", "train_bpc"):
        assert py_final[key] == cpp_final[key], key


@pytest.mark.parametrize("kind", [pytest.param("cpp", marks=needs_binary), "python"])
def test_environment_and_determinism(runs, kind, tmp_path):
    """No --opt-level/--seed: OPTAMP_OPT_LEVEL and OPTAMP_SEED decide; the same seed gives the
    same losses as the flag run, another seed other losses; a flag beats the environment."""
    args = [a for a in SMALL]
    proc, lines = train(kind, tmp_path, *args, env={"OPTAMP_OPT_LEVEL": "O4", "OPTAMP_SEED": "0"},
                        name="env0")
    rows, evals, _ = check_run(proc, lines, "O4")
    ref_rows, ref_evals, _ = split(runs[kind, "O4"][1])
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # deterministic
    assert [e["val_bpc"] for e in evals] == [e["val_bpc"] for e in ref_evals]

    proc, lines = train(kind, tmp_path, "--opt-level", "O0", *args,
                        env={"OPTAMP_OPT_LEVEL": "O4", "OPTAMP_SEED": "3"}, name="env3")
    rows, _, _ = check_run(proc, lines, "O0", seed=3)
    ref_rows, _, _ = split(runs[kind, "O0"][1])
    assert rows[0]["loss"] != ref_rows[0]["loss"]  # other weights and batches


@pytest.mark.parametrize("kind", [pytest.param("cpp", marks=needs_binary), "python"])
def test_gpu_preset_builds_and_steps_on_cpu(kind, tmp_path):
    proc, lines = train(kind, tmp_path, "--preset", "gpu", "--steps", "1", "--batch-size", "2",
                        "--seq-len", "16", "--eval-bytes", "16", "--data", STDLIB)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, evals, final = split(lines)
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"]) and len(evals) == 1
    assert (final["d_model"], final["layers"], final["heads"]) == (512, 8, 8)
    model = py_gpt.GPT(512, 8, 8, 16)
    assert final["params"] == sum(p.numel() for p in model.parameters())


BAD_ARGS = [
    (["--steps", "x"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--preset", "huge"], "--preset"),
    (["--device", "tpu"], "--device"),
    (["--opt-level", "O9"], "--opt-level"),
    (["--lr", "-1"], "--lr"),
    (["--d-model", "30", "--heads", "4"], "--d-model"),
    (["--frobnicate", "1"], "--frobnicate"),
]


@needs_binary
@pytest.mark.parametrize("args,flag", BAD_ARGS)
def test_cpp_bad_arguments_exit_2(args, flag, tmp_path):
    proc, lines = train("cpp", tmp_path, *args)
    assert proc.returncode == 2 and flag in proc.stderr and "usage:" in proc.stderr, proc.stderr
    assert lines == []


@pytest.mark.parametrize("args,flag", BAD_ARGS)
def test_python_bad_arguments_exit_2(args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        py_gpt.parse_args(args)
    assert e.value.code == 2 and flag in capsys.readouterr().err


@needs_binary
def test_cpp_bad_environment_exits_2(tmp_path):
    proc, _ = train("cpp", tmp_path, *SMALL, env={"OPTAMP_OPT_LEVEL": "O9"})
    assert proc.returncode == 2 and "OPTAMP_OPT_LEVEL" in proc.stderr, proc.stderr


@pytest.mark.parametrize("var,value", [("OPTAMP_OPT_LEVEL", "O9"), ("OPTAMP_SEED", "-1")])
def test_python_bad_environment_exits_2(var, value, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        py_gpt.parse_args(["--preset", "test"])
    assert e.value.code == 2 and var in capsys.readouterr().err


@pytest.mark.parametrize("kind", [pytest.param("cpp", marks=needs_binary), "python"])
def test_missing_stdlib_file_names_file_and_directory(kind, tmp_path, capsys):
    data = tmp_path / "stdlib"
    data.mkdir()
    (data / "argparse.py").write_text("# only one file\n")
    args = ["--preset", "test", "--steps", "1", "--data", str(data)]
    if kind == "cpp":
        proc, lines = train(kind, tmp_path, *args)
        code, err = proc.returncode, proc.stderr
        assert lines == []
    else:  # main() in this process: it stops before initialize
        code, err = py_gpt.main(args), capsys.readouterr().err
    assert code == 1, err
    assert f"stdlib file ast.py not found in {data}" in err


def header_list(function):
    text = open(HEADER).read()
    body = re.search(function + r"\(\) \{\s*static const std::vector<std::string> files = \{"
                     r"(.*?)\};", text, re.S)
    assert body, function
    return tuple(re.findall(r'"([^"]+)"', body.group(1)))


def test_file_lists_identical_in_both_trainers():
    assert header_list("train_files") == py_gpt.TRAIN_FILES
    assert header_list("val_files") == py_gpt.VAL_FILES
    assert not set(py_gpt.TRAIN_FILES) & set(py_gpt.VAL_FILES)
    assert len(set(py_gpt.TRAIN_FILES)) == len(py_gpt.TRAIN_FILES)


def test_file_lists_exist_in_this_stdlib():
    for name in py_gpt.TRAIN_FILES + py_gpt.VAL_FILES:
        assert os.path.isfile(os.path.join(STDLIB, name)), name
    train = py_gpt.load_text(STDLIB, py_gpt.TRAIN_FILES)
    val = py_gpt.load_text(STDLIB, py_gpt.VAL_FILES)
    assert 1_000_000 < train.numel() < 2_500_000 and 100_000 < val.numel() < 250_000


def test_presets_identical_in_both_trainers():
    """The C++ presets (char_gpt.h) hold the same numbers as the Python PRESETS."""
    text = open(HEADER).read()
    for name, p in py_gpt.PRESETS.items():
        m = re.search(r'name == "%s"\)\s*\*out = \{([^}]*)\}' % name, text)
        assert m, name
        values = [float(v) for v in m.group(1).split(",")]
        assert values == [p["d_model"], p["n_layer"], p["n_head"], p["seq_len"],
                          p["batch_size"], p["lr"]], name
    steps = re.search(r'return name == "gpu" \? (\d+) : name == "test" \? (\d+) : (\d+);', text)
    assert steps and [int(v) for v in steps.groups()] == [
        py_gpt.PRESETS[n]["steps"] for n in ("gpu", "test", "tiny")]


def test_eval_windows_evenly_spaced():
    starts = py_gpt.eval_starts(10_000, 100, 1000)
    assert len(starts) == 10 and starts[0] == 0 and starts[-1] == 10_000 - 101
    assert py_gpt.eval_starts(10_000, 100, 0) == py_gpt.eval_starts(10_000, 100, 10**9)
    assert len(py_gpt.eval_starts(10_000, 100, 0)) == 99
    assert py_gpt.eval_starts(500, 100, 50) == [0]


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_under_the_ab_runner(kind, tmp_path):
    """The workload as an A/B program: python -m optamp.ab runs it per level and seed and
    compares held-out bits per character (lower is better), train bpc and throughput; model
    sizes it reports are descriptions, not metrics; the per-op precision table per level."""
    if kind == "cpp" and not os.access(BIN, os.X_OK):
        pytest.skip(f"C++ trainer not built: {BIN}")
    out = tmp_path / "ab"
    run_env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep
                   + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "optamp.ab", "--levels", "O0,O4", "--seeds", "2", "--out",
         str(out), "--no-progress", "--precision-steps", "2", "--", *command(kind),
         "--preset", "test", "--steps", "12", "--data", STDLIB, "--threads", "1"],
        env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    metrics = {m["name"]: m["higher_is_better"] for m in summary["metrics"]}
    assert metrics["val_bpc"] is False and metrics["train_bpc"] is False
    assert metrics["tokens_per_s"] is True and metrics["final_train_loss"] is False
    assert not {"params", "d_model", "seq_len", "train_bytes"} & set(metrics)
    rows = {r["level"]: r for r in summary["levels"]}
    assert rows["O0"]["status"] == rows["O4"]["status"] == "ok"
    assert rows["O4"]["vs_baseline"]["val_bpc"]["n"] == 2
    assert rows["O4"]["vs_baseline"]["val_bpc"]["verdict"] in (
        "better", "worse", "indistinguishable")
    assert "character-level GPT" in (out / "summary.md").read_text()
    # --precision-steps through amp::ab (C++) and optamp.ab (Python): O4 ran ops in bf16.
    table = rows["O4"]["precision"]["table"]
    assert "| aten::" in table and "bfloat16" in table, table
    assert rows["O0"]["precision"]["first_nonfinite"] is None
