"""A dynamic-metadata provider (pyproject.toml's [[tool.dynamic-metadata]]) for the wheel's
dependencies: exactly the torch release the build compiles against.

optamp._C links torch's C++ ABI, so it loads only under the torch release it was compiled
against (python/optamp/_torch_check.py refuses any other). The wheel therefore depends on that
release, read from the build environment, the way torchvision's wheels pin theirs: torch==2.11.0
for `pip install .` ([build-system] requires it), the installed torch's release for
`pip install --no-build-isolation .`.
"""
from importlib.metadata import version
from typing import Any, Dict, List, Mapping


def torch_requirement() -> str:
    """'torch==2.11.0' for torch 2.11.0 or 2.11.0+cpu: a local tag (the CUDA variant) keeps the
    C++ ABI, and a pin with one would refuse the other variants of the same release."""
    return "torch==" + version("torch").split("+")[0]


def dynamic_metadata(settings: Mapping[str, Any],
                     project: Mapping[str, Any]) -> Dict[str, List[str]]:
    if settings:
        raise ValueError(f"torch_pin takes no settings, got {sorted(settings)}")
    return {"dependencies": [torch_requirement()]}


def dynamic_wheel(settings: Mapping[str, Any]) -> Dict[str, bool]:
    """An sdist's wheels may be built against other torch releases: its dependencies are
    marked Dynamic."""
    return {"dependencies": True}
