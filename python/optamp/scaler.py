"""Loss scaling: ``optamp.scale_loss`` (Apex's ``amp.scale_loss``) over the compiled core, the
scalers' state dicts, and ``loss_scaler``.

Two jobs live beside it: the process-group reducers of the overflow flag (``_distributed.py``)
and Apex's state-dict layout (``_apex_layout.py``). Imports go one way: ``frontend.py`` ->
``scaler.py`` -> those two -> ``_C``. The reducer helpers are re-exported here, where they were
defined before, so ``optamp.scaler.check_process_group`` and the others still import."""
import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Mapping, MutableMapping
from typing import (TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple,
                    TypeVar, Union, cast)

import torch

from . import _C, _apex_layout
from ._optimizers import put_back_step, replace_step, stepping_optimizer
from ._distributed import (
    FoundInfReducer,
    check_process_group,
    max_reducer,
    reducing_over,
    set_process_group,
)

if TYPE_CHECKING:  # torch.distributed is imported only when a process group is used
    from torch.distributed import ProcessGroup

OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

__all__ = [
    "FoundInfReducer",
    "OptimizerArg",
    "check_process_group",
    "load_state_dict",
    "loss_scaler",
    "max_reducer",
    "scale_loss",
    "set_process_group",
    "state_dict",
]


def _check_int(value: object, name: str) -> None:
    """TypeError/ValueError naming ``name`` unless ``value`` is an int that fits a C++ int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name} must be an int within [-2147483648, 2147483647], got {value}")


def _as_optimizers(optimizers: object) -> List[Any]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    raise TypeError("optimizers must be a torch.optim.Optimizer or a list of them, got "
                    f"{type(optimizers).__name__}")


def _params_of(optimizers: List[Any]) -> Tuple[List[torch.Tensor], List[List[int]]]:
    """The optimizers' parameters and the size of each param group: the core labels a parameter
    from these ("optimizer 0 param_groups[1].params[2]", plus the model's name initialize gave it)
    only when an error message needs it."""
    params: List[torch.Tensor] = []
    group_sizes: List[List[int]] = []
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "optimizers must be a torch.optim.Optimizer or a list of them, got "
                f"{type(opt).__name__}"
            )
        sizes = []
        for group in opt.param_groups:
            group_params = group["params"]
            params.extend(group_params)
            sizes.append(len(group_params))
        group_sizes.append(sizes)
    return params, group_sizes


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: OptimizerArg, loss_id: int = 0,
               model: object = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False,
               process_group: Optional["ProcessGroup"] = None) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale``; on exit unscale the grads of the optimizers' params,
    check them for inf/NaN and update the scale. After an overflow the grads are set to None,
    so the following ``optimizer.step()`` changes nothing.

    ``optimizers`` is an optimizer or a list of them. ``delay_unscale=True`` leaves the grads
    scaled (non-final gradient-accumulation micro-batches). ``model`` and
    ``delay_overflow_check`` are accepted for Apex compatibility and ignored (Apex ignores them
    too). Enter and exit on the same thread.

    ``process_group`` (a ``torch.distributed`` group, e.g. ``torch.distributed.group.WORLD``):
    for model-parallel setups where ranks hold different parameters, the scaler's "found inf"
    flag is max-reduced over the group before the scale update, so every rank skips the same
    steps and keeps the same scale (dynamic scaling only; one all_reduce of one element per
    non-delayed step). Given here it applies to this call; ``initialize(..., process_group=)``
    sets it for every step. Not needed under plain DistributedDataParallel, whose gradient
    averaging already spreads a non-finite value.

    With several guards before one ``optimizer.step()`` (several losses, or accumulation
    without ``delay_unscale``), an overflow in any of them skips that step, as in Apex: the
    guard installs a one-shot step pre-hook that sets the grads to None before the step runs.

    Optimizers that skip on the device (torch's ``fused=True`` Adam, AdamW and SGD, and any
    optimizer with ``_step_supports_amp_scaling``, the protocol ``torch.amp.GradScaler`` uses):
    when every optimizer given is one, the guard waits for nothing. It leaves the grads as they
    are and hands the overflow flag to the optimizers as ``optimizer.found_inf`` (with
    ``grad_scale=None``: the grads are unscaled already), and their kernels skip the update on
    the device; the flag is dropped after the step. The scaler's ``last_step_skipped`` and
    counters then wait for the device only when they are read.

    Optimizer wrappers that step another optimizer sharing their ``param_groups`` without
    being initialized as optimizers themselves (``PostLocalSGDOptimizer``, Accelerate's
    ``AcceleratedOptimizer``) are taken as the optimizer they wrap, made before or after
    ``initialize``.
    """
    guard, opts = _open_guard(loss, optimizers, loss_id, delay_unscale, process_group)
    try:
        yield guard.loss
    except BaseException:
        _unwind_guard(guard, opts, delay_unscale)
        raise
    _close_guard(guard, opts, loss_id, delay_unscale, process_group)


# What torch.compiler.disable's wrapper does (torch 2.11, torch/_dynamo/eval_frame.py,
# DisableContext), without importing torch._dynamo, which took 1.7 s of `import optamp`:
# Dynamo graph-breaks at a callable carrying the mark instead of tracing into it; the call then
# runs eagerly, its own frame never compiled (as torch's wrapper, whose file Dynamo skips) and
# with Dynamo's frame callback off, so the frames it calls are not compiled either.
# tests/python/test_compose.py holds these to torch's.
DYNAMO_DISABLE_MARK = "_torchdynamo_disable"
_frames = torch._C._dynamo.eval_frame


def _eager(fn: _Fn) -> _Fn:
    """``fn``, run outside torch.compile's tracing. The guard's two halves and its step hooks
    are: a compiled training step (``torch.compile(train_step)`` with the ``with scale_loss(...)``
    block inside, or a compiled ``optimizer.step``) then breaks its graph at them and runs them
    eagerly, instead of tracing into pybind calls Dynamo cannot trace (a warning per call) and
    into attribute writes on the optimizer (``found_inf``, the hooks' handles), which Dynamo
    refuses. Eager calls go around the wrapper: Dynamo reads ``is_compiling()`` as True while it
    traces."""

    def outside(*args: Any) -> Any:
        prior = _frames.set_eval_frame(None)
        try:
            return fn(*args)
        finally:
            _frames.set_eval_frame(prior)

    setattr(outside, DYNAMO_DISABLE_MARK, True)
    skip = _frames._FrameExecStrategy(_frames._FrameAction.SKIP, _frames._FrameAction.DEFAULT)
    _frames.set_code_exec_strategy(outside.__code__, skip)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return outside(*args)
        return fn(*args)

    return cast(_Fn, call)


@_eager
def _open_guard(loss: torch.Tensor, optimizers: OptimizerArg, loss_id: int, delay_unscale: bool,
                process_group: Optional["ProcessGroup"]) -> Tuple[Any, List[Any]]:
    check_process_group(process_group)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a torch.Tensor (the loss of this step), got "
                        f"{type(loss).__name__}")
    _check_int(loss_id, "loss_id")
    if not isinstance(delay_unscale, bool):
        raise TypeError(f"delay_unscale must be a bool, got {type(delay_unscale).__name__}")
    opts = _as_optimizers(optimizers)
    params, group_sizes = _params_of(opts)
    steppers = [stepping_optimizer(opt) for opt in opts]
    device_skip = all(getattr(opt, "_step_supports_amp_scaling", False) for opt in steppers)
    guard = _C._scale_loss(loss, params, loss_id, delay_unscale, group_sizes,
                           [id(opt) for opt in steppers], device_skip)
    _mark_open(steppers, 1)
    return guard, steppers


def _mark_open(optimizers: List[Any], change: int) -> None:
    """Count the guards open over each optimizer (one at most: the core refuses a second), and
    give each, once, the step pre-hook that refuses a step with scaled gradients."""
    for opt in optimizers:
        holder: Any = opt
        if getattr(holder, "_optamp_step_check", None) is None:
            holder._optamp_step_check = opt.register_step_pre_hook(_refuse_scaled_step)
        holder._optamp_open_guards = getattr(holder, "_optamp_open_guards", 0) + change


def _mark_closed(optimizers: List[Any], delay_unscale: bool, unwinding: bool) -> None:
    """A guard ended: its optimizers' grads stay scaled after ``delay_unscale`` (also when it
    unwound); after any other guard they are unscaled, or reset by an unwinding one."""
    _mark_open(optimizers, -1)
    if not (unwinding and delay_unscale):
        for opt in optimizers:
            holder: Any = opt
            holder._optamp_scaled_grads = delay_unscale


def _refuse_scaled_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A step with gradients still multiplied by the loss scale and not yet checked for inf/NaN
    (Apex stepped so, and an overflow then reached the weights): ``optimizer.step()`` inside the
    ``with scale_loss(...)`` block, or after a ``delay_unscale=True`` block with no block
    without it since (as ``amp::step`` refuses in C++). Raised before the step changes anything;
    inside the block the guard then unwinds (gradients reset, scale unchanged)."""
    name = type(optimizer).__name__
    if getattr(optimizer, "_optamp_open_guards", 0):
        raise RuntimeError(
            f"{name}.step() inside a scale_loss block: its gradients are still scaled by the "
            "loss scale and not yet checked for inf/NaN; call optimizer.step() after the block "
            "(`with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()`, then "
            "`optimizer.step()`)")
    if getattr(optimizer, "_optamp_scaled_grads", False) and any(
            p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            f"{name}.step() after scale_loss(..., delay_unscale=True): its gradients are still "
            "scaled by the loss scale and not yet checked for inf/NaN; end the accumulation "
            "with a scale_loss block without delay_unscale before stepping")


@_eager
def _unwind_guard(guard: Any, opts: List[Any], delay_unscale: bool) -> None:
    _mark_closed(opts, delay_unscale, unwinding=True)
    guard.finish(True)


@_eager
def _close_guard(guard: Any, opts: List[Any], loss_id: int, delay_unscale: bool,
                 process_group: Optional["ProcessGroup"]) -> None:
    _mark_closed(opts, delay_unscale, unwinding=False)
    if process_group is None or delay_unscale:
        skipped = guard.finish(False)
    else:
        with reducing_over(process_group, loss_id):  # for this step only
            skipped = guard.finish(False)
    if skipped:
        for opt in opts:
            if not _inside_step_of(opt):
                _skip_next_step(opt)
    found_inf = guard.found_inf
    if found_inf is not None:
        for opt in opts:
            if _fresh_fused_sgd_buffers(opt, found_inf):
                _skip_next_step(opt)
            _hand_found_inf(opt, found_inf)


def _fresh_fused_sgd_buffers(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> bool:
    """torch's ``SGD(fused=True)`` makes a momentum buffer with ``empty_like`` on its first step
    and keeps it when ``found_inf`` skips that step, so the next step starts from uninitialized
    memory (torch 2.11; GradScaler has the same hole). Buffers are made here as zeros instead:
    torch then steps them as a later step would, ``0 * momentum + grad``, which with dampening 0
    is its first step exactly, and a skipped step leaves zeros. With dampening != 0 that is not
    the first step, so the flag is read once (the step that would create buffers) and True is
    returned when that step must be skipped on the host (no buffers made)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    groups = [g for g in optimizer.param_groups if g.get("fused") and g["momentum"] != 0]
    total = sum(len(g["params"]) for g in groups)
    holder: Any = optimizer
    # Every buffer made at the last look, and no state dropped since (a load_state_dict that
    # brought fewer entries): nothing to do, without a Python loop over the parameters.
    if getattr(holder, "_optamp_sgd_buffers", -1) == total and len(optimizer.state) >= total:
        return False
    damped_fresh, ready = False, 0
    for group in groups:
        for p in group["params"]:
            state = optimizer.state.get(p)  # .get: no empty state entries for grad-less params
            if state is not None and state.get("momentum_buffer") is not None:
                ready += 1
            elif p.grad is None:
                continue
            elif group["dampening"] == 0:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format)
                ready += 1
            else:
                damped_fresh = True
    holder._optamp_sgd_buffers = ready
    return damped_fresh and bool(found_inf.item())


def _hand_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Give the next ``optimizer.step()`` the overflow flag, as torch.amp.GradScaler does for
    optimizers with ``_step_supports_amp_scaling``: the fused kernel skips on the device. Flags
    of several guards before one step combine (any overflow skips); a one-shot post hook drops
    them after the step."""
    holder: Any = optimizer  # carries the attributes GradScaler's protocol reads
    earlier = getattr(holder, "_optamp_found_inf", None)
    combined = found_inf if earlier is None else torch.maximum(earlier, found_inf)
    holder._optamp_found_inf = combined
    holder.found_inf = combined
    holder.grad_scale = None  # the guard has unscaled the grads already

    def drop(opt: Any) -> None:
        for name in ("found_inf", "grad_scale"):
            if hasattr(opt, name):
                delattr(opt, name)
        opt._optamp_found_inf = None

    _at_next_step(optimizer, "_optamp_found_inf_hook", optimizer.register_step_post_hook, drop)


def _skip_next_step(optimizer: torch.optim.Optimizer) -> None:
    """Make the next ``optimizer.step()`` change nothing, as ``GradScaler.step`` and Apex do: the
    call does not reach the optimizer's own ``step`` at all (:func:`_install_skipped_step`), so
    state an optimizer keeps beside its parameters' (a group's step count, Prodigy's ``d``,
    ASGD's norms) stays as it was, and an optimizer that refuses a step without gradients is not
    called. A one-shot step pre-hook clears the grads as well, for a ``step`` reached without the
    attribute lookup (a bound method taken earlier, ``torch.compile(optimizer.step)``); a later
    guard's backward refills the grads this guard reset, so resetting them alone would not skip
    the step."""

    def skip(opt: Any) -> None:
        _uninstall_skipped_step(opt)  # reached through a bound method: that was the skip
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None

    _at_next_step(optimizer, "_optamp_skip_hook", optimizer.register_step_pre_hook, skip)
    _install_skipped_step(optimizer)


def _inside_step_of(optimizer: Any) -> bool:
    """Whether this guard closed inside ``optimizer.step(closure)`` (Lightning's automatic
    optimization, SAM-style optimizers run the forward and backward in the step's closure): the
    grads the guard set to None skip that step, which is already running, and a skip left for
    the next call would drop the next step's closure. Read on overflow only: a walk up the
    stack for the optimizer's ``step`` frame."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step" and frame.f_locals.get("self") is optimizer:
            return True
        frame = frame.f_back
    return False


# Optimizers a skip or a handed overflow flag may be waiting on (their next step).
_waiting: "weakref.WeakSet[Any]" = weakref.WeakSet()


def drop_waiting_steps() -> None:
    """``reset()``: what guards left for optimizers' next steps goes with the loss scalers (a
    skip, a handed ``found_inf``), so a step after ``reset`` and a new ``initialize`` runs as
    the new state says."""
    for optimizer in list(_waiting):
        _uninstall_skipped_step(optimizer)
        _run_pending(optimizer, "_optamp_found_inf_hook")  # drops the flag
        if getattr(optimizer, "_optamp_skip_hook", None) is not None:
            _forget(optimizer, "_optamp_skip_hook")  # not run: it would clear the grads
    _waiting.clear()


def _install_skipped_step(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` an instance attribute ``step`` that skips one call: it refuses a step
    with scaled grads as the permanent pre-hook does, runs the one-shot actions the skipped call
    would have run (clearing the grads, dropping a handed ``found_inf``), and puts back what the
    instance had before (an LR scheduler's wrapper, marking the call for the scheduler as that
    wrapper would, so no "``lr_scheduler.step()`` before ``optimizer.step()``" warning comes)."""
    holder: Any = optimizer
    if getattr(holder, "_optamp_step_before", None) is not None:
        return

    def skipped_step(opt: Any, *args: Any, **kwargs: Any) -> None:
        _skip_call(opt, args, kwargs)

    holder._optamp_step_before = replace_step(holder, skipped_step)
    _waiting.add(optimizer)


@_eager  # attribute writes on the optimizer, which Dynamo refuses to trace
def _skip_call(optimizer: Any, args: Any, kwargs: Any) -> None:
    _refuse_scaled_step(optimizer, args, kwargs)
    before = _uninstall_skipped_step(optimizer)
    for handle_name in ("_optamp_skip_hook", "_optamp_found_inf_hook"):
        _run_pending(optimizer, handle_name)
    if hasattr(before, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True


def _uninstall_skipped_step(optimizer: Any) -> Any:
    """Put back the ``step`` attribute the skip replaced; returns it (None if no skip waits)."""
    before = getattr(optimizer, "_optamp_step_before", None)
    if before is None:
        return None
    optimizer._optamp_step_before = None
    put_back_step(optimizer, before)
    return before


def _at_next_step(optimizer: torch.optim.Optimizer, handle_name: str,
                  register: Callable[[Any], Any], action: Callable[[Any], None]) -> None:
    """Run ``action(optimizer)`` once, in the step hook ``register`` installs (a step pre- or
    post-hook), unless the hook named ``handle_name`` is already waiting for that step."""
    holder: Any = optimizer  # carries the hook's handle
    if getattr(holder, handle_name, None) is not None:
        return

    def once(opt: Any, args: Any, kwargs: Any) -> None:
        _run_once(opt, handle_name, action)

    setattr(holder, handle_name, register(once))
    setattr(holder, handle_name + "_action", action)
    _waiting.add(optimizer)


def _run_pending(optimizer: Any, handle_name: str) -> None:
    """Run now the one-shot action waiting in the hook ``handle_name``, if any (a skipped call
    of ``step`` runs no hooks)."""
    if getattr(optimizer, handle_name, None) is not None:
        _run_once(optimizer, handle_name, getattr(optimizer, handle_name + "_action"))


@_eager  # a compiled optimizer.step traces its hooks
def _run_once(optimizer: Any, handle_name: str, action: Callable[[Any], None]) -> None:
    action(optimizer)
    _forget(optimizer, handle_name)


def _forget(optimizer: Any, handle_name: str) -> None:
    """Removes the one-shot hook ``handle_name`` and its action."""
    getattr(optimizer, handle_name).remove()
    setattr(optimizer, handle_name, None)
    setattr(optimizer, handle_name + "_action", None)


def loss_scaler(loss_id: int = 0) -> _C.LossScaler:
    """The :class:`optamp._C.LossScaler` of ``loss_id`` (after configuration)."""
    _check_int(loss_id, "loss_id")
    return _C.loss_scaler(loss_id)


def state_dict(
    destination: Optional[MutableMapping[str, torch.Tensor]] = None,
) -> MutableMapping[str, torch.Tensor]:
    """``{"loss_scaler0.scale": tensor, ...}``: every loss scaler's state (CPU tensors).

    ``destination`` (Apex's argument): a mapping to fill and return instead of a new dict."""
    state = _C.state_dict()
    if destination is None:
        return state
    if not isinstance(destination, MutableMapping):
        raise TypeError("destination must be a mutable mapping (a dict) or None, got "
                        f"{type(destination).__name__}")
    destination.update(state)
    return destination


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Restore :func:`state_dict` output (validated first; nothing changes on error).

    Also takes Apex's layout, ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}}``, so a
    run trained with Apex resumes here (see docs/loss_scaling.md)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError("state_dict must be a mapping such as optamp.state_dict() returns, got "
                        f"{type(state_dict).__name__}")
    if state_dict and _apex_layout.is_apex_layout(state_dict):
        _apex_layout.load(state_dict)
    else:
        _C.load_state_dict(dict(state_dict))
