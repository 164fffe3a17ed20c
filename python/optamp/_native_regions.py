"""A ``torch.autocast(..., enabled=False)`` region turns optamp's rules off inside it.

Code written for native autocast keeps numerically delicate blocks in fp32 that way: Hugging
Face's rotary embeddings compute their angles under ``torch.autocast(device_type,
enabled=False)``. optamp's casting does not read native autocast's switch, and torch keeps no
record of a region that disabled autocast (it looks like autocast never enabled), so such a
block was cast by the level's lists: at O1 the rotary angles of positions up to 4096 came out of
an fp16 matmul, up to 2.8 radians off. optamp therefore wraps ``torch.amp.autocast`` (the class
``torch.autocast``, ``torch.cuda.amp.autocast`` and ``torch.cpu.amp.autocast`` share): a region
constructed with ``enabled=False`` enters ``optamp.disable_casts()`` for its extent, on the
thread that enters it. ``enabled`` is read as the caller passed it: torch also disables a region
whose device has no autocast (``torch.autocast("cuda")`` on a CPU-only machine), and that is not
a request for fp32.

Where torch itself enters such a region (``torch.utils.checkpoint``'s recompute restores the
forward's native state), optamp's checkpoint wrapper runs the function under the optamp state of
the checkpoint call inside it, so the recompute casts as the forward did (``_checkpoint``).
Under ``torch.compile`` Dynamo traces ``torch.autocast`` regions itself and does not call the
wrapper: there a disabled region keeps optamp's rules (docs/casting.md).
"""
from typing import Any, List, Optional

import torch
from torch.amp.autocast_mode import autocast

from . import _C

_FRAMES = "_optamp_disable_frames"  # the disable_casts frames this region entered (a stack)
_DISABLES = "_optamp_disables"  # constructed with enabled=False
_native: Optional[List[Any]] = None  # autocast's own __init__, __enter__, __exit__


def _init(self: autocast, device_type: str, dtype: Optional[torch.dtype] = None,
          enabled: bool = True, cache_enabled: Optional[bool] = None) -> None:
    assert _native is not None
    _native[0](self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    self.__dict__[_DISABLES] = enabled is False


def _enter(self: autocast) -> Any:
    assert _native is not None
    result = _native[1](self)
    if self.__dict__.get(_DISABLES, False) and _C.is_initialized():
        frame = _C.disable_casts()
        frame.__enter__()
        self.__dict__.setdefault(_FRAMES, []).append(frame)
    return result


def _exit(self: autocast, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
    assert _native is not None
    frames = self.__dict__.get(_FRAMES)
    if frames:
        frames.pop().__exit__(exc_type, exc_val, exc_tb)
    return _native[2](self, exc_type, exc_val, exc_tb)


def install() -> None:
    """Wraps torch.amp.autocast's __init__/__enter__/__exit__ (once; idempotent)."""
    global _native
    if _native is None:
        _native = [autocast.__init__, autocast.__enter__, autocast.__exit__]
        autocast.__init__ = _init  # type: ignore[method-assign]
        autocast.__enter__ = _enter  # type: ignore[method-assign]
        autocast.__exit__ = _exit  # type: ignore[method-assign]


def uninstall() -> None:
    """Back to torch's own (tests)."""
    global _native
    if _native is not None:
        autocast.__init__, autocast.__enter__, autocast.__exit__ = _native  # type: ignore
        _native = None
