"""Load optamp._C only under the torch it was built against, with an error that says so.

A C++ extension links torch's C++ ABI, which changes between torch releases: under another
torch the load fails with an "undefined symbol" naming a mangled function, or, worse, loads and
crashes later. Comparing versions first turns both into one clear ImportError.
"""
import importlib
import types
from typing import Optional, Tuple

import torch


def _release(version: str) -> Tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the local tag (CUDA variant) does not change the C++ ABI."""
    numbers = version.split("+")[0].split(".")[:3]
    return tuple(int("".join(ch for ch in n if ch.isdigit()) or 0) for n in numbers)


def _built_with() -> Optional[str]:
    try:
        from ._build_info import torch_version
    except ImportError:  # a tree that was never built: importing _C reports that
        return None
    return torch_version


def check(running: str, built: Optional[str]) -> None:
    """Raise ImportError when torch ``running`` cannot load a _C built against ``built``."""
    if built is not None and _release(running) != _release(built):
        raise ImportError(
            f"optamp was built against torch {built} but torch {running} is imported; a C++ "
            "extension only loads under the torch release it was compiled with. Rebuild optamp "
            "(pip install . , or scripts/test.sh for the in-tree build) with this torch, or "
            f"install torch=={'.'.join(map(str, _release(built)))}.")


def load_core() -> types.ModuleType:
    built = _built_with()
    check(torch.__version__, built)
    try:
        return importlib.import_module("optamp._C")
    except ImportError as error:
        raise ImportError(
            f"optamp's compiled core (optamp._C) failed to load under torch {torch.__version__}"
            f" (built against torch {built or 'unknown'}): {error}. Build it first "
            "(pip install . , or scripts/test.sh for the in-tree build).") from error
