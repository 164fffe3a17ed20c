"""Fashion-MNIST smoke test (issue: initialize): a few hundred steps of the example CNN at O0, O1,
O2 and O5 with the same seed and data; the mixed levels' test accuracy must be within 1 point of
O0's. Marked slow (fp16 convolutions run reference kernels on CPUs): `PYTEST_ARGS=--run-slow`.
"""
import json
import os
import subprocess

import pytest

from test_ab import BIN, DATA, env, trainer_binary  # noqa: F401  (shared paths and skips)

STEPS = int(os.environ.get("OPTAMP_SMOKE_STEPS", "300"))


def run_level(level, tmp_path):
    metrics = tmp_path / f"{level}.jsonl"
    subprocess.run([trainer_binary(), "--opt-level", level, "--steps", str(STEPS),
                    "--batch-size", "64", "--seed", "0", "--data", DATA,
                    "--metrics", str(metrics)], check=True, env=env(), capture_output=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return next(r for r in rows if r.get("type") == "summary")


@pytest.mark.slow
def test_mixed_levels_match_o0_accuracy(tmp_path):
    accuracy = {level: run_level(level, tmp_path)["test_accuracy"]
                for level in ("O0", "O1", "O2", "O5")}
    for level in ("O1", "O2", "O5"):
        assert abs(accuracy[level] - accuracy["O0"]) <= 1.0, accuracy
