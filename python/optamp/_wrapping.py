"""How optamp wraps other libraries' functions (activation checkpointing, pipelining, model
averaging, data loading): once, recognisably, and (``inside``) as a no-op while optamp is not
initialized."""
import functools
from typing import Any, Callable, ContextManager

from . import _C

_MARK = "_optamp_wrapped"

Function = Callable[..., Any]


def marked(run: Function) -> Function:
    """``run``, marked as optamp's wrapper (see :func:`replace`)."""
    setattr(run, _MARK, True)
    return run


def inside(context: Callable[[], ContextManager[Any]], function: Function) -> Function:
    """``function`` run inside ``context()`` (``_C.disable_casts``, ``_C.lift_no_grad_gate``)
    while optamp is initialized, as it is otherwise."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not _C.is_initialized():
            return function(*args, **kwargs)
        with context():
            return function(*args, **kwargs)

    return marked(run)


def rules_off(function: Function) -> Function:
    """``function`` run with optamp's rules off (inside ``disable_casts``) while optamp is
    initialized: code of torch's that must see fp32 (model averaging, data loading)."""
    return inside(_C.disable_casts, function)


def replace(owner: Any, name: str, wrap: Callable[[Function], Function]) -> None:
    """Sets ``owner.name`` to ``wrap`` of it, unless it is optamp's wrapper already (installs run
    at import and again at ``initialize``)."""
    function = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if function is not None and not getattr(function, _MARK, False):
        setattr(owner, name, wrap(function))
