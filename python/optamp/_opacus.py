"""Opacus (DP-SGD) under optamp.

Opacus's ``DPOptimizer`` clips the per-sample gradients (``p.grad_sample``) its module hooks
compute from the gradients flowing back from the loss, then sums them into ``p.grad``:

* With a loss scale those are the scaled loss's gradients, which no loss scaler unscales
  (GradScaler neither: its runs turn NaN), so the clipping would see gradients 65536 times too
  large, and fp16 ones overflow. :func:`refuse_scaled_losses` refuses an Opacus optimizer at a
  level that scales the loss, before anything changes; the bf16 levels and O3 scale by 1.
* Its clipping runs in ``step()`` with grad mode on, where O1/O4 would cast its ``einsum`` and
  the clipped sum would come out fp16/bf16 ("attempting to assign a gradient with dtype
  'c10::BFloat16' to a tensor with grad_dtype 'Float'"). Native autocast does not reach a step
  outside its region; :func:`run_steps_uncast` gives each Opacus optimizer an instance ``step``
  that runs its own inside ``disable_casts``, removed again by :func:`restore_steps`.

An Opacus optimizer is told by the module its class comes from; optamp does not import Opacus.
"""
import weakref
from typing import Any, List

import torch

from . import _C
from ._optimizers import put_back_step, replace_step

_UNCAST = "_optamp_step_uncast"  # (the instance's step attribute before the wrapper, the wrapper)
_wrapped: "weakref.WeakSet[Any]" = weakref.WeakSet()


def is_opacus_optimizer(optimizer: object) -> bool:
    return type(optimizer).__module__.split(".")[0] == "opacus"


def refuse_scaled_losses(optimizers: List[torch.optim.Optimizer], preview: Any) -> None:
    """ValueError naming the optimizer and the remedy where ``preview`` scales the loss."""
    if not preview.enabled or preview.loss_scale == 1.0:
        return
    for index, opt in enumerate(optimizers):
        if is_opacus_optimizer(opt):
            raise ValueError(
                f"optimizers[{index}] is Opacus's {type(opt).__name__}, which clips per-sample "
                "gradients computed from the scaled loss; optamp unscales p.grad only, so it "
                f"needs a loss scale of 1 (opt_level {preview.opt_level} has loss_scale="
                f"{preview.loss_scale!r}). Use opt_level='O4' or 'O5' (bfloat16, loss scale 1) "
                "or loss_scale=1.0")


def run_steps_uncast(optimizers: List[torch.optim.Optimizer]) -> None:
    """Each Opacus optimizer's ``step`` runs with optamp's rules off (once per optimizer)."""
    for opt in optimizers:
        holder: Any = opt
        if not is_opacus_optimizer(opt) or opt in _wrapped:
            continue
        own_step = holder.step

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _C.disable_casts():
                return own_step(*args, **kwargs)

        before = replace_step(holder, step)
        setattr(holder, _UNCAST, (before, holder.step))
        _wrapped.add(opt)


def restore_steps() -> None:
    """``reset()``: the Opacus optimizers get back the ``step`` they had."""
    for opt in list(_wrapped):
        holder: Any = opt
        before, ours = getattr(holder, _UNCAST)
        delattr(holder, _UNCAST)
        if vars(holder).get("step") is ours:  # else wrapped since (an LR scheduler): ours stays
            put_back_step(holder, before)
    _wrapped.clear()
