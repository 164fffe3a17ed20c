"""Apex's custom-function registration.

Dispatcher ops (ATen or ``TORCH_LIBRARY`` ops): ``register_half_op("ns::op")`` and friends put a
policy on optamp's dispatch key, so every call, from Python or C++, follows it.

Python-level functions: ``register_half_function(module, "name")`` replaces ``module.name`` by a
wrapper, and the decorators ``half_function`` / ``float_function`` / ``promote_function`` wrap a
function. While optamp's casting is active on the calling thread, the wrapper casts the tensor
arguments (recursively in lists, tuples and dicts; doubles and non-floating tensors untouched)
before calling the function; otherwise it calls the function unchanged. Registration works
before or after ``optamp.initialize`` (the wrapper checks the thread's state at each call).

Which levels apply (the same as the dispatcher's categories): half functions at O1-O5 (O1/O4
only with patch_torch_functions), promote functions at O1/O2/O4/O5, float functions at O1-O5, and
all three in ``optamp.autocast`` regions. A wrapped Python function's inner ops still follow their own
policies (Apex's semantics for composite functions); a wrapped builtin (a C function such as
``torch.nn.functional.gelu``) runs with optamp's rules off so that the registration wins.
"""
import functools
import types
import typing
from typing import Any, Callable, List, Optional, TypeVar

import torch

from . import _C
from ._tree import map_tensors, tensors_in

F = TypeVar("F", bound=Callable[..., Any])

register_half_op = _C.register_half_op
register_float_op = _C.register_float_op
register_promote_op = _C.register_promote_op

# "float" applies at every level that casts, as register_float_op does (a registered loss runs
# in fp32 whatever the level did to the model); "promote" where the promote list applies (O1, O2,
# O4, O5, regions).
_POLICY = {"half": _C.CastPolicy.LOWER, "float": _C.CastPolicy.FP32_ALWAYS,
           "promote": _C.CastPolicy.PROMOTE}


def cast_floating(t: torch.Tensor, target: Optional[torch.dtype]) -> torch.Tensor:
    """``t`` in ``target`` if it is a floating tensor of another dtype (doubles untouched)."""
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != target:
        return t.to(target)
    return t


def _caster(kind: str, tensors: List[torch.Tensor],
            low: Optional[torch.dtype]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    floating = [t for t in tensors if t.is_floating_point() and t.dtype != torch.float64]
    target: Optional[torch.dtype]
    if kind == "half":
        target = low
    elif kind == "float":
        target = torch.float32
    else:  # promote: widest floating width among the (non-double) floating arguments
        dtypes = {t.dtype for t in floating}
        if len(dtypes) < 2:
            return None
        target = torch.float32  # fp16+fp32, bf16+fp32 and fp16+bf16 all widen to fp32

    return lambda t: cast_floating(t, target)


def _wrap(fn: F, kind: str) -> F:
    if not callable(fn):
        raise TypeError(f"{kind}_function expects a callable (a function or a decorated def), "
                        f"got {type(fn).__name__}")
    original = getattr(fn, "__optamp_original__", fn)
    builtin = not isinstance(original, (types.FunctionType, types.MethodType, functools.partial))

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors = tensors_in(kwargs, tensors_in(args, []))
        device = tensors[0].device.type if tensors else "cpu"
        rules, low = _C.cast_rules_now(device)
        if not _C.policy_applies(_POLICY[kind], rules):
            return original(*args, **kwargs)
        cast = _caster(kind, tensors, low)
        if cast is not None:
            args, kwargs = map_tensors(args, cast), map_tensors(kwargs, cast)
        # A builtin is one op: cast once, here. A float function's body runs on its fp32
        # arguments as it is written, uncast, so an op optamp refuses at O1/O4
        # (binary_cross_entropy) runs inside a registered float function, as in Apex.
        if builtin or kind == "float":
            with _C.disable_casts():
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    marked: Any = wrapper
    marked.__optamp_original__ = original
    marked.__optamp_policy__ = kind
    return typing.cast(F, wrapper)


def _register(module: object, name: str, kind: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"function name must be a str, got {type(name).__name__}")
    if not hasattr(module, name):
        module_name = getattr(module, "__name__", repr(module))
        raise ValueError(f"No function named {name} in module {module_name}.")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{getattr(module, '__name__', repr(module))}.{name} must be callable, "
                        f"got {type(fn).__name__}")
    setattr(module, name, _wrap(fn, kind))


def register_half_function(module: object, function_name: str) -> None:
    """Apex: ``module.function_name`` runs with its floating tensor args in the low dtype."""
    _register(module, function_name, "half")


def register_float_function(module: object, function_name: str) -> None:
    """Apex: ``module.function_name`` runs with its floating tensor args in fp32."""
    _register(module, function_name, "float")


def register_promote_function(module: object, function_name: str) -> None:
    """Apex: ``module.function_name`` runs with mixed-width floating args cast to the widest."""
    _register(module, function_name, "promote")


def half_function(fn: F) -> F:
    """Decorator form of :func:`register_half_function`."""
    return _wrap(fn, "half")


def float_function(fn: F) -> F:
    """Decorator form of :func:`register_float_function`."""
    return _wrap(fn, "float")


def promote_function(fn: F) -> F:
    """Decorator form of :func:`register_promote_function`."""
    return _wrap(fn, "promote")
