"""The shared per-dtype tolerance table (tests/tolerances.txt), for torch.testing.assert_close."""
import os

import torch

_TABLE_PATH = os.path.join(os.path.dirname(__file__), "..", "tolerances.txt")


def _load():
    table = {}
    with open(_TABLE_PATH) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and not parts[0].startswith("#"):
                table[parts[0]] = {"rtol": float(parts[1]), "atol": float(parts[2])}
    return table


TABLE = _load()
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def tol(key):
    """Tolerance kwargs for a dtype or a row name such as "train_float16"."""
    return dict(TABLE[_NAMES.get(key, key) if not isinstance(key, str) else key])
