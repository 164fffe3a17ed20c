"""Loss scaling: ``optamp.scale_loss`` (Apex's ``amp.scale_loss``) over the compiled core."""
import contextlib

import torch

from . import _C, frontend


def _as_optimizers(optimizers):
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _params_of(optimizers):
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


def _dense(grad):
    """The values of a gradient as a strided tensor (a sparse gradient's values are a view)."""
    return grad._values() if grad.is_sparse else grad


def _agree_on_overflow(params, process_group):
    """Max-reduce "some gradient is non-finite" over ``process_group``; where any rank
    overflowed, poison one local gradient so this rank's scaler skips the step too.

    Everything stays on the gradients' device (NCCL reduces CUDA tensors only) and nothing
    waits for the device: the flag is applied with a masked fill, not read back with .item().
    """
    import torch.distributed as dist

    grads = [_dense(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g.numel() > 0]  # the inf norm of nothing is undefined
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, float("inf")).float() for g in grads])
        flag = torch.logical_not(torch.isfinite(norms).all()).float()
    flag = flag.reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    if grads:
        # Any layout: a 0-dim mask broadcasts to every shape and stride; filling the whole
        # gradient is harmless, a skipped step discards the grads anyway.
        grads[0].masked_fill_(flag.reshape(()) > 0, float("inf"))


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False, process_group=None):
    """Yield ``loss.float() * scale``; on exit unscale the grads of the optimizers' params,
    check them for inf/NaN and update the scale. After an overflow the grads are set to None,
    so the following ``optimizer.step()`` changes nothing.

    ``optimizers`` is an optimizer or a list of them. ``delay_unscale=True`` leaves the grads
    scaled (non-final gradient-accumulation micro-batches). ``model`` and
    ``delay_overflow_check`` are accepted for Apex compatibility and ignored (Apex ignores them
    too). Enter and exit on the same thread.

    ``process_group`` (a ``torch.distributed`` group, e.g. ``torch.distributed.group.WORLD``):
    for model-parallel setups where ranks hold different parameters, the "found inf" flag is
    max-reduced over the group so that every rank skips the same steps (dynamic scaling only;
    one extra pass over the grads and one all_reduce per non-delayed step). Not needed under
    plain DistributedDataParallel, whose gradient averaging already spreads a non-finite value.

    With several guards before one ``optimizer.step()`` (several losses, or accumulation
    without ``delay_unscale``), an overflow in any of them skips that step, as in Apex: the
    guard installs a one-shot step pre-hook that sets the grads to None before the step runs.
    """
    optimizers = _as_optimizers(optimizers)
    params, names = _params_of(optimizers)
    guard = _C._scale_loss(loss, params, loss_id, delay_unscale, names)
    try:
        yield guard.loss
    except BaseException:
        guard.finish(True)
        raise
    if process_group is not None and not delay_unscale and _C.loss_scaler(loss_id).dynamic:
        try:
            with torch.no_grad():
                _agree_on_overflow(params, process_group)
        except BaseException:
            guard.finish(True)
            raise
    guard.finish(False)
    if not delay_unscale and _C.loss_scaler(loss_id).last_step_skipped:
        for opt in optimizers:
            _skip_next_step(opt)


def _skip_next_step(optimizer):
    """Make the next ``optimizer.step()`` change nothing: a later guard's backward refills the
    grads this guard reset, so resetting them alone would not skip the step."""
    if getattr(optimizer, "_optamp_skip_hook", None) is not None:
        return

    def skip(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        opt._optamp_skip_hook.remove()
        opt._optamp_skip_hook = None

    optimizer._optamp_skip_hook = optimizer.register_step_pre_hook(skip)


def loss_scaler(loss_id=0):
    """The :class:`optamp._C.LossScaler` of ``loss_id`` (after configuration)."""
    return _C.loss_scaler(loss_id)


def state_dict():
    """``{"loss_scaler0.scale": tensor, ...}``: every loss scaler's state (CPU tensors)."""
    return _C.state_dict()


def load_state_dict(state_dict):
    """Restore :func:`state_dict` output (validated first; nothing changes on error)."""
    _C.load_state_dict(dict(state_dict))
