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
Under ``torch.compile`` Dynamo records the region as ``torch.amp._enter_autocast`` /
``_exit_autocast`` calls in its graph, and those construct and enter this same class while
AOTAutograd (or the eager backend) runs the graph to trace it: the compiled graph keeps the block
in fp32 as well.

``torch.amp.custom_fwd`` / ``custom_bwd``, torch's decorators for custom autograd Functions, ask
native autocast's state at call time, and optamp's casting is not native autocast, so:

* ``custom_fwd(cast_inputs=torch.float32)`` (a Function that needs fp32, often a kernel with fp32
  support only) decides by ``torch.is_autocast_enabled(device_type)``: False under optamp, so its
  fp16 inputs went in unchanged. ``torch.is_autocast_enabled`` is wrapped to answer that one
  question (asked from custom_fwd's frame, with ``cast_inputs`` set) with whether optamp casts at
  the Function's call site; custom_fwd then casts the inputs and runs the forward in a disabled
  region, as under native autocast. Anyone else gets torch's answer.
* ``custom_bwd`` runs the backward in ``torch.autocast(enabled=<forward used autocast>)``: a
  disabled region under optamp, which made it ``disable_casts`` and switched off the no_grad
  gate's widening of mixed widths that the backward of a forward optamp had widened relies on.
  That region disables optamp's rules only when custom_fwd cast the inputs to fp32 under optamp
  (the backward then stays fp32 as the forward was); otherwise the backward runs under optamp's
  state, as any backward does.
"""
import sys
import types
from typing import Any, Callable, List, Optional

import torch
from torch.amp.autocast_mode import autocast, custom_bwd, custom_fwd

from . import _C

_FRAMES = "_optamp_disable_frames"  # the disable_casts frames this region entered (a stack)
_DISABLES = "_optamp_disables"  # constructed with enabled=False
_native: Optional[List[Any]] = None  # autocast's own __init__, __enter__, __exit__
_CAST_INPUTS = "_optamp_cast_inputs"  # on a Function's ctx: custom_fwd cast its inputs for optamp


def _placeholder(*args: Any, **kwargs: Any) -> None:
    return None


# The code of the functions custom_fwd / custom_bwd return (one code object for all of them).
_CUSTOM_FWD_CODE = custom_fwd(_placeholder, device_type="cpu").__code__
_CUSTOM_BWD_CODE = custom_bwd(_placeholder, device_type="cpu").__code__
_torch_is_autocast_enabled: Optional[Callable[..., bool]] = None


def _custom_fwd_ctx(frame: Optional[types.FrameType], code: types.CodeType) -> Any:
    """The autograd ctx of the custom_fwd/custom_bwd call ``frame`` is (None if it is none)."""
    if frame is None or frame.f_code is not code:
        return None
    args = frame.f_locals.get("args")
    return args[0] if isinstance(args, tuple) and args else None


def _casts_at_call_site(ctx: Any) -> bool:
    """Whether optamp casts where the Function was applied. Its forward runs with grad mode off,
    where the no_grad gate answers no; a Function applied while autograd recorded has an input
    that needs a gradient, and the answer is the one grad mode would give."""
    if _C.is_casting_enabled():
        return True
    if not any(getattr(ctx, "needs_input_grad", ())):
        return False
    with torch.enable_grad():
        return bool(_C.is_casting_enabled())


def _is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
    assert _torch_is_autocast_enabled is not None
    if _torch_is_autocast_enabled(*args, **kwargs):
        return True
    frame = sys._getframe(1)
    ctx = _custom_fwd_ctx(frame, _CUSTOM_FWD_CODE)
    if ctx is None or frame.f_locals.get("cast_inputs") is None or not _casts_at_call_site(ctx):
        return False
    setattr(ctx, _CAST_INPUTS, True)  # its backward stays fp32 too (see _init)
    return True


# Constant-folded by Dynamo while it traces, as torch's own (see _autocast_flag).
setattr(_is_autocast_enabled, "_dynamo_marked_constant", True)


def _init(self: autocast, device_type: str, dtype: Optional[torch.dtype] = None,
          enabled: bool = True, cache_enabled: Optional[bool] = None) -> None:
    assert _native is not None
    _native[0](self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    disables = enabled is False
    if disables:
        ctx = _custom_fwd_ctx(sys._getframe(1), _CUSTOM_BWD_CODE)
        disables = ctx is None or getattr(ctx, _CAST_INPUTS, False)
    self.__dict__[_DISABLES] = disables


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
    """Wraps torch.amp.autocast's __init__/__enter__/__exit__ and torch.is_autocast_enabled
    (once; idempotent)."""
    global _native, _torch_is_autocast_enabled
    if _native is None:
        _native = [autocast.__init__, autocast.__enter__, autocast.__exit__]
        autocast.__init__ = _init  # type: ignore[method-assign]
        autocast.__enter__ = _enter  # type: ignore[method-assign]
        autocast.__exit__ = _exit  # type: ignore[method-assign]
    if _torch_is_autocast_enabled is None:
        _torch_is_autocast_enabled = torch.is_autocast_enabled
        torch.is_autocast_enabled = _is_autocast_enabled


def uninstall() -> None:
    """Back to torch's own (tests)."""
    global _native, _torch_is_autocast_enabled
    if _native is not None:
        autocast.__init__, autocast.__enter__, autocast.__exit__ = _native  # type: ignore
        _native = None
    if _torch_is_autocast_enabled is not None:
        torch.is_autocast_enabled = _torch_is_autocast_enabled
        _torch_is_autocast_enabled = None
