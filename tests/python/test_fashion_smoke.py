"""Fashion-MNIST smoke test (issue: initialize; verdict rule: issue 20): scripts/ab_test.sh runs
the example CNN at O0, O1, O2 and O5 on 3 seeds x 600 steps (the same budget for every level,
cosine learning-rate decay) and no mixed level may be "worse" than O0 in test accuracy or final
train loss by the report's paired rule (docs/ab_test.md), nor more than 1 point less accurate on
average. Marked slow (fp16 convolutions run reference kernels on CPUs: 5-30 minutes):
`PYTEST_ARGS=--run-slow`.
"""
import json
import os
import subprocess

import pytest

from common_utils import ROOT, env, needs_data, trainer_binary

STEPS = os.environ.get("OPTAMP_SMOKE_STEPS", "600")
LEVELS = ("O0", "O1", "O2", "O5")


@pytest.mark.slow
@needs_data
def test_mixed_levels_not_worse_than_o0(tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "ab_test.sh"), "--out", str(tmp_path), "--bin",
         trainer_binary(), "--levels", ",".join(LEVELS), "--seeds", "3", "--steps", STEPS,
         "--slow-levels", "none"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for row in summary["levels"][1:]:
        acc = row["vs_baseline"]["test_accuracy"]
        loss = row["vs_baseline"]["final_train_loss"]
        assert acc["n"] == 3 and acc["verdict"] != "worse", (row["level"], acc)
        assert loss["verdict"] != "worse", (row["level"], loss)
        assert acc["mean_diff"] >= -1.0, (row["level"], acc)
