"""Loss scaling: ``optamp.scale_loss`` (Apex's ``amp.scale_loss``) over the compiled core."""
import contextlib

import torch

from . import _C, frontend


def _params_of(optimizers):
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    params, names = [], []
    known = frontend._param_names
    for k, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "optimizers must be a torch.optim.Optimizer or a list of them, got "
                f"{type(opt).__name__}"
            )
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                params.append(p)
                name = known.get(id(p))
                names.append(name or f"optimizer {k} param_groups[{g}].params[{i}]")
    return params, names


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Yield ``loss.float() * scale``; on exit unscale the grads of the optimizers' params,
    check them for inf/NaN and update the scale. After an overflow the grads are set to None,
    so the following ``optimizer.step()`` changes nothing.

    ``optimizers`` is an optimizer or a list of them. ``delay_unscale=True`` leaves the grads
    scaled (non-final gradient-accumulation micro-batches). ``model`` and
    ``delay_overflow_check`` are accepted for Apex compatibility and ignored (Apex ignores them
    too). Enter and exit on the same thread.
    """
    params, names = _params_of(optimizers)
    guard = _C._scale_loss(loss, params, loss_id, delay_unscale, names)
    try:
        yield guard.loss
    except BaseException:
        guard.finish(True)
        raise
    guard.finish(False)


def loss_scaler(loss_id=0):
    """The :class:`optamp._C.LossScaler` of ``loss_id`` (after configuration)."""
    return _C.loss_scaler(loss_id)


def state_dict():
    """``{"loss_scaler0.scale": tensor, ...}``: every loss scaler's state (CPU tensors)."""
    return _C.state_dict()


def load_state_dict(state_dict):
    """Restore :func:`state_dict` output (validated first; nothing changes on error)."""
    _C.load_state_dict(dict(state_dict))
