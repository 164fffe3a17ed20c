"""benchmarks/unscale_model.py finds the loops it models: torch's AVX2 unscale loop and optamp's
AVX2 and AVX-512 ones, each with the number of values one iteration handles, and llvm-mca runs
on each of them (a smoke test of the tool; its cycle counts are a benchmark's, not asserted),
and the loop torch itself runs on AVX-512 CPUs."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from common_utils import BUILD, ROOT, env, load_script

SCRIPT = os.path.join(ROOT, "benchmarks", "unscale_model.py")
LIB = os.path.join(BUILD, "csrc", "liboptamp.so")
MCA = [n for n in ("llvm-mca", "llvm-mca-14", "llvm-mca-15", "llvm-mca-16") if shutil.which(n)]


@pytest.mark.skipif(not MCA or not shutil.which("objdump") or not shutil.which("nm"),
                    reason="needs llvm-mca (Debian: llvm) and binutils")
@pytest.mark.skipif(not os.path.exists(LIB), reason=f"no optamp build at {LIB}")
def test_finds_and_models_every_loop():
    proc = subprocess.run([sys.executable, SCRIPT, "--mcpu", "skylake-avx512", "--show"], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = dict(re.findall(r"## (\w+ \w+ \w+): (\d+) values per iteration", proc.stdout))
    assert found == {
        "float32 torch avx2": "16", "float16 torch avx2": "32", "bfloat16 torch avx2": "32",
        "float32 optamp avx2": "8", "float16 optamp avx2": "8", "bfloat16 optamp avx2": "16",
        "float32 optamp avx512": "16", "float16 optamp avx512": "16",
        "bfloat16 optamp avx512": "16",
    }, proc.stdout
    rows = re.findall(r"^(\w+)\s+skylake-avx512\s+([\d.]+)\s+([\d.]+) \(.*\)\s+([\d.]+) \(",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["float32", "float16", "bfloat16"], proc.stdout
    assert all(float(c) > 0 for r in rows for c in r[1:]), proc.stdout


def test_torch_runs_its_avx2_unscale_loop_on_avx512_cpus(monkeypatch):
    """What benchmarks/bench_unscale.py prints as torch's unscale kernel, and what
    docs/benchmarks.md compares the AVX-512 path against: torch 2.11 registers no AVX-512 variant
    of _amp_foreach_non_finite_check_and_unscale_, so DispatchStub runs the AVX2 one there. Fails
    if a torch upgrade adds one (then the docs' comparison changes)."""
    import torch

    bench_unscale = load_script("benchmarks/bench_unscale.py")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert bench_unscale.torch_unscale_kernel() == "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert bench_unscale.torch_unscale_kernel() == "AVX2"
