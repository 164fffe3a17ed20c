"""benchmarks/bench_train.py end to end on a tiny model: a subset of configurations runs, and the
summary prints the targets whose configurations ran (and only those); benchmarks/step_icount.py's
step trains in every mode."""
import inspect
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import optamp

from common_utils import BUILD, ROOT, env, load_script

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")


def test_subset_of_configs_prints_its_targets_only(tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "gpt2", "--device", "cpu", "--small",
                           "--configs", "native_bf16,O4_torch", "--rounds", "2", "--warmup", "0",
                           "--steps", "1", "--json", str(out)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target O4_torch throughput / native_bf16" in proc.stdout
    # O2, O1 and native did not run: no line about them, and no crash looking for them.
    assert "target O2" not in proc.stdout and "target O1" not in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["round"], r["config"]) for r in rows) == [
        (1, "O4_torch"), (1, "native_bf16"), (2, "O4_torch"), (2, "native_bf16")]
    assert all(r["median_ms"] > 0 for r in rows)


def test_o3_configuration_trains_instead_of_skipping(tmp_path):
    """The first GPU run's "O3 1.82x native" timed NaN steps that were skipped (AdamW eps=1e-8 on
    fp16 parameters): the benchmark now gives O3 an fp16-safe eps, and reports skipped steps."""
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "gpt2", "--device", "cpu", "--small",
                           "--configs", "O3", "--rounds", "1", "--warmup", "1", "--steps", "3",
                           "--json", str(out)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["config"] for r in rows] == ["O3"]
    assert rows[0]["skipped_steps"] == 0, rows


def test_noise_row_and_ratio_ranges(tmp_path):
    """native_again is native measured twice in one run: its ratio to native is printed as the
    run's noise, and every ratio cell carries its range over the rounds."""
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "gpt2", "--device", "cpu", "--small",
                           "--configs", "native,native_again", "--rounds", "2", "--warmup", "0",
                           "--steps", "1"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    noise = [line for line in proc.stdout.splitlines() if line.startswith("noise")]
    assert len(noise) == 1 and "native_again / native" in noise[0], proc.stdout
    assert "| native | " in proc.stdout and "1.000 (1.000-1.000)" in proc.stdout


CPP_GPT2 = os.path.join(BUILD, "benchmarks", "training", "bench_train_gpt2")


@pytest.mark.parametrize("program", ["python", "cpp"])
def test_json_lines_carry_every_timed_step(program, tmp_path):
    """Each JSON line holds every timed step's time beside their median, so a round whose median
    moved can be read step by step (uniformly slower, or a few slow steps)."""
    out = tmp_path / "runs.json"
    flags = ["--device", "cpu", "--small", "--configs", "native,O1", "--rounds", "1", "--warmup",
             "0", "--steps", "3", "--json", str(out)]
    if program == "cpp":
        if not os.access(CPP_GPT2, os.X_OK):
            pytest.skip(f"{CPP_GPT2} is not built (OPTAMP_BUILD_BENCHMARKS=ON)")
        cmd = [CPP_GPT2, *flags]
    else:
        cmd = [sys.executable, SCRIPT, "--model", "gpt2", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["config"] for r in rows) == ["O1", "native"]
    for r in rows:
        assert len(r["step_ms"]) == 3 and all(t > 0 for t in r["step_ms"]), r
        assert sorted(r["step_ms"])[1] == pytest.approx(r["median_ms"], abs=1e-3), r


@pytest.mark.parametrize("program", ["python", "cpp"])
def test_an_interrupt_reports_the_complete_rounds(program):
    """SIGINT (gpu_check's time budget) stops a run after the configuration it is in: the report
    (table, noise, targets) covers the complete rounds, and the program exits with 130. It used to
    lose the whole run's report, which is printed only after the last round."""
    flags = ["--device", "cpu", "--small", "--configs", "native,native_again", "--rounds", "100000",
             "--warmup", "0", "--steps", "1"]
    if program == "cpp":
        if not os.access(CPP_GPT2, os.X_OK):
            pytest.skip(f"{CPP_GPT2} is not built (OPTAMP_BUILD_BENCHMARKS=ON)")
        cmd = [CPP_GPT2, *flags, "--kernel-time"]
    else:
        cmd = [sys.executable, SCRIPT, "--model", "gpt2", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # interrupt once a round is complete and the next has begun
        lines.append(line)
        if line.startswith("round 2 "):
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    done = [line for line in out.splitlines() if line.startswith("interrupted:")]
    assert len(done) == 1 and " of 100000" in done[0], out
    rounds = int(done[0].split("the report covers the ")[1].split()[0])
    assert rounds >= 1
    assert "| native | " in out and "noise  native_again / native" in out, out
    assert "profiled" not in out  # --kernel-time's pass is skipped once interrupted
    # Complete rounds only: both configurations ran in each, and the round cut short is left out.
    ran = [line.split()[1] for line in out.splitlines() if line.startswith("round ")]
    assert all(ran.count(str(r)) == 2 for r in range(1, rounds + 1)), out
    assert ran.count(str(rounds + 1)) <= 1, out


@pytest.mark.parametrize("config,checks", [("O4", True), ("O5_nocheck", False)])
def test_nocheck_configuration_turns_the_fixed_scale_check_off(fresh, config, checks):
    """O4_nocheck / O5_nocheck: overflow_check=False, what native bf16 (and Apex) do: no inf/NaN
    check, so no host wait per step; plain O4/O5 checks and, with AdamW as it comes, waits once
    per step (the sync the GPU run's O4/O5-vs-bf16 ratio pays)."""
    import argparse
    bench_train = load_script("benchmarks/bench_train.py", siblings=("bench_models",))
    args = argparse.Namespace(model="gpt2", small=True, fused=False)
    model, opt, loss_fn = bench_train.Workload(args, torch.device("cpu")).build()
    step = bench_train.make_step(config, model, opt, loss_fn, torch.device("cpu"))
    for _ in range(2):
        step()
    scaler = optamp.loss_scaler()
    assert scaler.checks_overflow is checks
    assert scaler.host_waits == (2 if checks else 0)


def test_profile_differences_name_what_differs(capsys):
    """--kernel-time's differences: per optamp level, against native (fp16) or native_bf16 (O4,
    O5), largest first, and nothing for the native configurations themselves."""
    bench_train = load_script("benchmarks/bench_train.py", siblings=("bench_models",))
    profiles = {"native": {"gemm": 1.0, "cast": 0.1}, "O1": {"gemm": 1.0, "cast": 0.6, "gelu": 0.2},
                "native_bf16": {"gemm": 2.0}, "O4": {"gemm": 2.5}}
    bench_train.print_profile_differences(list(profiles), profiles, "kernels", top=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["kernels O1 vs native: +0.70 ms in all; +0.50 ms cast; +0.20 ms gelu",
                     "kernels O4 vs native_bf16: +0.50 ms in all; +0.50 ms gemm"]


@pytest.mark.parametrize("model_name", ["gpt2", "resnet50"])
@pytest.mark.parametrize("mode", ["fp32", "native_fp16", "native_bf16", "O1", "O2", "O4", "O5"])
def test_step_icount_steps_run_and_train(fresh, mode, model_name):
    """benchmarks/step_icount.py's step (what benchmarks/step_icount.sh counts under callgrind)
    runs in every mode, for both models (STEP_ICOUNT_MODEL), and trains the model; where fp16
    gradients overflow (the width-2 ResNet's, on the CPU's fp16 kernels, natively too) the steps
    are skipped and the scale backs off instead, which costs the host the same work: the fused
    optimizer skips on the device either way."""
    step_icount = load_script("benchmarks/step_icount.py", siblings=("bench_models",))
    step = step_icount.make_step(mode, model_name)
    scope = inspect.getclosurevars(step).nonlocals
    model = scope["model"]
    before = [p.detach().clone() for p in model.parameters()]
    step()
    step()
    if any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)):
        return
    assert model_name == "resnet50" and mode in ("native_fp16", "O1", "O2"), "nothing trained"
    scale = scope["scaler"].get_scale() if "scaler" in scope else optamp.loss_scaler().loss_scale()
    assert scale == 2.0**14  # two skipped steps from 2**16, as GradScaler's default start
