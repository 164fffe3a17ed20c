"""A custom ``autograd.Function`` called while autograd records runs its forward under the
level's rules.

torch runs a Function's ``forward`` with grad mode off, so optamp's no_grad gate (docs/casting.md)
cast nothing inside it, although the forward is part of the training forward that called it:
native autocast and Apex cast there. Reversible networks (Reformer, RevNets), which compute their
blocks inside a Function and recompute them in its backward under ``enable_grad``, then ran their
whole body in fp32, and recomputed it in fp16; an adjoint ODE solver's forward integrated in
fp32. :func:`install` wraps ``torch.autograd.Function.apply`` (the classmethod every Function
inherits) so that a call made where optamp's rules apply with grad mode on runs inside
``lift_no_grad_gate``: the forward casts as the code around the call does. A region in effect at
the call (``disable_casts``, ``torch.autocast(enabled=False)``, ``custom_fwd``'s fp32 forward)
stays in effect. Calls under no_grad (optimizer steps, validation) and calls during backward are
not touched, nor is AOTAutograd's runtime wrapper of a compiled graph (below). Under
``torch.compile`` the forward is traced through torch's ``ApplyTemplate`` Function, which this
wrapper lifts like any other, so the compiled forward casts as the eager one (docs/design.md).
"""
import functools
from typing import Any

import torch

from . import _C
from ._wrapping import _MARK, marked

# AOTAutograd runs a compiled graph inside a Function of its own (``CompiledFunction``), with the
# casts already traced into the graph: it runs as traced. (The Function that traces a custom
# Function's forward for ``torch.compile``, ``torch._functorch.autograd_function.ApplyTemplate``,
# is lifted like any other, which is what makes the traced forward cast as the eager one.)
_COMPILED_GRAPHS = "torch._functorch._aot_autograd."


def install() -> None:
    """Wraps ``torch.autograd.Function.apply`` (once; idempotent)."""
    inherited: Any = torch.autograd.Function.__dict__["apply"]  # a classmethod object
    if getattr(inherited.__func__, _MARK, False):
        return
    original = inherited.__func__

    @functools.wraps(original)
    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if (torch.is_grad_enabled() and not cls.__module__.startswith(_COMPILED_GRAPHS)
                and _C.is_casting_enabled()):
            with _C.lift_no_grad_gate():
                return original(cls, *args, **kwargs)
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(marked(apply))  # type: ignore[assignment]
