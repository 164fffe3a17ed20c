"""Which optimizer steps: wrappers that subclass ``torch.optim.Optimizer`` without being one; and
the instance ``step`` optamp puts in front of an optimizer's own for a while (the skip after an
overflow, Opacus's uncast step)."""
import types
from typing import Any, Callable

import torch

_NO_STEP_ATTRIBUTE = object()


def replace_step(optimizer: Any, step: Callable[..., Any]) -> Any:
    """Sets ``optimizer.step`` to ``step`` bound to it (a bound method, as an LR scheduler made
    later expects: it wraps ``step.__func__``); returns what the instance held before, for
    :func:`put_back_step`."""
    before = vars(optimizer).get("step", _NO_STEP_ATTRIBUTE)
    optimizer.step = types.MethodType(step, optimizer)
    return before


def put_back_step(optimizer: Any, before: Any) -> None:
    """Undoes :func:`replace_step` with what it returned."""
    if before is _NO_STEP_ATTRIBUTE:
        del optimizer.step
    else:
        optimizer.step = before


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` runs step hooks and reads GradScaler's ``found_inf``. For a
    wrapper, the optimizer it wraps, found as the attribute sharing its ``param_groups`` (the
    wrapper's ``step`` runs that one's): torch's ``PostLocalSGDOptimizer`` and Accelerate's
    ``AcceleratedOptimizer`` subclass ``Optimizer`` without running its ``__init__`` (no hooks of
    their own); Lightning's ``LightningOptimizer`` and Fabric's optimizer copy the wrapped one's
    ``__dict__``, its hooks included, so wrappers are looked through before hooks are looked
    for. Else ``optimizer`` itself. ``initialize`` records this optimizer and ``scale_loss``
    checks it, so a wrapper made after ``initialize`` (``accelerator.prepare``) is the optimizer
    given there; an optimizer optamp cannot skip is refused there and when a guard opens, before
    the backward, not at the first overflow."""
    for value in vars(optimizer).values():
        if (isinstance(value, torch.optim.Optimizer) and value is not optimizer
                and value.param_groups is optimizer.param_groups):
            return stepping_optimizer(value)
    if hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return optimizer
    raise TypeError(
        f"optimizer {type(optimizer).__name__} subclasses torch.optim.Optimizer without running "
        "Optimizer.__init__ (it has no step hooks) and wraps no optimizer that shares its "
        "param_groups: optamp cannot skip its step after an overflow. Pass the optimizer it "
        "wraps to initialize and scale_loss instead")
