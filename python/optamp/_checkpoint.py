"""Activation checkpointing under optamp: forward and recompute run under the same rules.

``torch.utils.checkpoint`` runs the checkpointed function twice: in the forward and again in
the backward. optamp's casting depends on per-thread state, so the two runs need the same state:

* the reentrant variant runs the forward under ``no_grad``, where optamp's gate would turn the
  level's rules off (fp32 forward, fp16/bf16 recompute: the gradient of another function);
* both variants recompute during backward, usually after the ``amp.autocast(...)`` or
  ``amp.disable_casts()`` region around the forward has ended.

optamp wraps the checkpointed function at the point where both variants take it: it captures the
thread's optamp state at the checkpoint call and runs the function under that state both times,
lifting the no_grad gate when autograd was recording at the call (as it was for the forward the
function stands in for). Native ``torch.autocast`` state is restored by torch itself.
"""
import functools
from typing import Any, Callable, TypeVar

import torch
import torch.utils.checkpoint as _ckpt

from . import _C
from ._wrapping import marked, replace

F = TypeVar("F", bound=Callable[..., Any])


def _same_state(function: F) -> F:
    """``function`` run under the optamp state of this moment (a no-op wrapper when optamp is off
    on this thread)."""
    state = _C.ThreadState.capture()
    if not state.key_on:
        return function
    ungate = torch.is_grad_enabled()

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _C.thread_state_guard(state):
            if not ungate:
                return function(*args, **kwargs)
            with _C.lift_no_grad_gate():
                return function(*args, **kwargs)

    return run  # type: ignore[return-value]  # the same signature, wrapped


def install() -> None:
    """Wraps the two entry points of torch.utils.checkpoint (once; idempotent). They are looked up
    at call time, so code that imported ``checkpoint`` before optamp is covered too."""
    # Any: torch's private entry points, replaced (and marked) below.
    fn_class: Any = _ckpt.CheckpointFunction
    if not getattr(fn_class, "_optamp_wrapped", False):
        original_apply = fn_class.apply

        def apply(cls: type, function: Callable[..., Any], preserve_rng_state: bool,
                  *args: Any) -> Any:
            return original_apply(_same_state(function), preserve_rng_state, *args)

        fn_class.apply = classmethod(apply)
        fn_class._optamp_wrapped = True
    replace(_ckpt, "_checkpoint_without_reentrant_generator", _function_in_same_state)


def _function_in_same_state(generator: Callable[..., Any]) -> Callable[..., Any]:
    """The non-reentrant checkpoint's generator, given its function under the state of the
    checkpoint call."""

    @functools.wraps(generator)
    def wrapped_generator(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return generator(_same_state(fn), *args, **kwargs)

    return marked(wrapped_generator)
