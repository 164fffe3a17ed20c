"""scripts/gpu_check.sh's counts (scripts/runner_counts.sh) from the closing lines the runners
really print: ctest under CMake 3 and 4, pytest passing, failing, erroring and cut short. A GPU
run is rare: a miscount there would go unnoticed until the report was read."""
import os
import subprocess

import pytest

from common_utils import ROOT

LIB = os.path.join(ROOT, "scripts", "runner_counts.sh")

CTEST3 = """\
 1/3 Test #1: A.B ....   Passed    0.1 sec
 2/3 Test #2: A.C_CUDA ....***Skipped   0.1 sec
 3/3 Test #3: A.D ....   Passed    0.1 sec

100% tests passed, 0 tests failed out of 3

Total Test time (real) =   0.31 sec

The following tests did not run:
\t  2 - A.C_CUDA (Skipped)
"""
CTEST4 = CTEST3.replace("100% tests passed, 0 tests failed out of 3", "100% tests passed out of 3")
CTEST_FAILED = """\
67% tests passed, 1 tests failed out of 3

The following tests FAILED:
\t  3 - A.D (Failed)
Errors while running CTest
"""
CTEST_DISABLED = CTEST4.replace("(Skipped)", "(Disabled)")


@pytest.mark.parametrize("log,rc,expected", [
    (CTEST3, 0, (2, 0, 1)),
    (CTEST4, 0, (2, 0, 1)),
    (CTEST_DISABLED, 0, (2, 0, 1)),
    (CTEST_FAILED, 8, (2, 1, 0)),
    ("....s\n4 passed, 1 skipped in 0.31s\n", 0, (4, 0, 1)),
    ("F..\n1 failed, 2 passed, 2 warnings in 1.02s\n", 1, (2, 1, 0)),
    ("E\n1 passed, 2 errors in 0.50s\n", 1, (1, 2, 0)),
    ("====== 7 passed, 3 deselected in 0.20s ======\n", 0, (7, 0, 0)),
    ("!!! KeyboardInterrupt !!!\n12 passed in 30.00s\n", 124, (12, 0, 0)),  # cut at the budget
    ("round 3 of 5\n", 137, (0, 0, 0)),  # killed 15 s after the budget's interrupt: not a failure
    ("no tests ran in 0.00s\nERROR: file or directory not found: or\n", 4, (0, 1, 0)),
    ("[58/58] Linking CXX executable x\n", 0, (1, 0, 0)),  # a phase without a runner
    ("ninja: build stopped: subcommand failed.\n", 1, (0, 1, 0)),
])
def test_runner_counts_read_the_runners_closing_lines(tmp_path, log, rc, expected):
    path = tmp_path / "phase.log"
    path.write_text(log)
    out = subprocess.run(["bash", "-c", f'source "{LIB}" && runner_counts "{path}" {rc}'],
                         capture_output=True, text=True, check=True).stdout
    assert tuple(int(v) for v in out.split()) == expected


def _summary_of_check(tmp_path, env):
    """Runs scripts/gpu_check.sh with `env` (its phases, on the CPU); asserts it passed and
    returns its summary.md."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return (out / "summary.md").read_text()


def test_the_softmax_kernels_phase_puts_its_lines_in_the_summary(tmp_path):
    """The phase the next GPU run adds (benchmarks/bench_softmax_kernels.py), dry-run on the CPU
    at a tiny size: it passes, and each kind's, dtype's and pass's timing line and the values'
    lines reach summary.md (on the CPU the ops run torch's own ops: no difference from native's
    values; the loss's CPU kernels are its formulas in other ops: within rounding)."""
    summary = _summary_of_check(tmp_path, dict(
        os.environ, GPU_CHECK_PHASES="softmax_kernels", GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_SOFTMAX_KERNELS_ARGS="--rows 6 --cols 1100 --attention-rows 5 --keys 1024 "
                                       "--reps 1 --rounds 1"))
    assert "| softmax_kernels | ok |" in summary
    for kind, shape in (("log_softmax", "[6 x 1100]"), ("softmax", "[5 x 1024]")):
        for dtype in ("bf16", "fp16"):
            for pass_ in ("forward", "backward"):
                assert f"- softmax_kernels: {kind} {dtype} {pass_} {shape}: optamp " in summary
            assert (f"- softmax_kernels: {kind} {dtype} values: largest difference from native's "
                    "forward 0.00e+00, backward 0.00e+00") in summary
    for dtype in ("bf16", "fp16"):
        for pass_ in ("forward", "backward"):
            assert f"- softmax_kernels: cross_entropy {dtype} {pass_} [6 x 1100]: optamp " in summary
        line = next(line for line in summary.splitlines()
                    if line.startswith(f"- softmax_kernels: cross_entropy {dtype} values: "))
        forward, backward = (float(v.rstrip(",")) for v in line.split()[-3::2])
        assert forward < 1e-5 and backward < 1e-5, line


NCU_OUTPUT = """\
==PROF== Connected to process 4242
==PROF== Profiling "fused_cross_entropy_kernel" - 0: 0%....50%....100% - 8 passes
[4242] python3@127.0.0.1
  void amp::ops::detail::fused_cross_entropy_kernel<c10::BFloat16, amp::ops::detail::BlockPerRow>\
(const T1 *, const long *, float *, float *, long, long, long) (4096, 1, 1)x(512, 1, 1), Context 1
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         3.20
    Memory Throughput                 %        21.50
    DRAM Throughput                   %        21.50
    Duration                         us       417.31
    Compute (SM) Throughput           %        63.02
    ----------------------- ----------- ------------

    OPT   This kernel exhibits low compute throughput and memory bandwidth utilization relative to
          the peak performance of this device.
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction        cycle        25.10
    Section: Occupancy
    Achieved Occupancy                    %        93.40
==PROF== Disconnected from process 4242
"""


def test_the_kernel_profile_phase_puts_each_kernels_counters_in_the_summary(tmp_path):
    """The kernel profile (Nsight Compute over the softmax kernels' benchmark) on a machine with
    ncu: each kernel's name and its duration, throughputs, occupancy and cycles per issued
    instruction reach summary.md, one line each (an ncu that prints a report in Nsight Compute's
    format, written by hand after its console reports, progress lines and advice included, stands
    in for it here); with too little of the time budget left, or on a machine without ncu, the
    phase says so and passes."""
    fake = tmp_path / "bin"
    fake.mkdir()
    ncu = fake / "ncu"
    ncu.write_text("#!/bin/sh\ncat <<'EOF'\n" + NCU_OUTPUT + "EOF\n")
    ncu.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PHASES="kernel_profile", GPU_CHECK_DEVICE="cpu",
               PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    summary = _summary_of_check(tmp_path, env)
    assert "| kernel_profile | ok |" in summary
    lines = [line for line in summary.splitlines() if line.startswith("- kernel_profile: ")]
    assert lines[0].startswith("- kernel_profile: void amp::ops::detail::fused_cross_entropy_kernel<")
    assert lines[1:] == ["- kernel_profile: " + m for m in (
        "Memory Throughput % 21.50", "DRAM Throughput % 21.50", "Duration us 417.31",
        "Compute (SM) Throughput % 63.02", "Warp Cycles Per Issued Instruction cycle 25.10",
        "Achieved Occupancy % 93.40")]

    # Not past the budget: a call sized to it must not end inside ncu.
    summary = _summary_of_check(tmp_path, dict(env, GPU_CHECK_MINUTES="0"))
    assert "| kernel_profile | not run: " in summary and "s left of the 30s budget |" in summary
    assert "- kernel_profile: " not in summary

    env["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                  if not os.path.exists(os.path.join(p, "ncu")))
    summary = _summary_of_check(tmp_path, env)
    assert "| kernel_profile | not run: no ncu on this machine |" in summary
