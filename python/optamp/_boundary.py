"""Apex's model boundary: the forward of each model ``initialize`` is given casts floating inputs
to the model's dtype and floating outputs to fp32 (or ``cast_model_outputs``), "so the user never
needs to call .half()". The dtypes come from the compiled core (``_C._model_boundary``), which
C++'s ``amp::forward`` asks too, so both fronts cast the same tensors.

The boundary belongs to the models ``initialize`` was given, as in C++ (``amp::forward`` casts
nothing for any other module). The wrapper is a method bound to the model (``types.MethodType``:
torch reads ``forward.__func__`` and ``forward.__code__``), not a closure over it, so that
``copy.deepcopy(model)`` (an EMA copy, say) gets a forward bound to the copy, not one that still
runs the original's; the copy is not an initialized model, so its forward is a plain one (its
``_Owner`` mark deep-copies to None). The forward it wraps, if the model had its own instance
``forward``, is kept on the model as well, for the same reason.

Its function is made for each model from ``_boundary_forward``'s code, named ``forward``: a bound
method pickles as ``getattr(model, its function's name)``, so ``torch.save(model)`` stores
``getattr(model, "forward")``, which at load time (before the model's attributes are restored)
is the class's forward, and the owner mark pickles as None: a model saved whole loads as a plain
module, without optamp. (Named ``_boundary_forward``, it saved and then failed to load.) The
function's ``__signature__`` is the wrapped forward's, so ``inspect.signature(model.forward)``
shows the model's parameters rather than ``(*args, **kwargs)``.
"""
import inspect
import sys
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _C, _compile
from ._tree import map_tensors

_INNER = "_optamp_inner_forward"  # the model's own instance forward, if it had one
_OWNER = "_optamp_boundary"  # an _Owner on a model initialize was given


class _Owner:
    """Marks a model initialize was given; a deep copy of the model is not one."""

    def __deepcopy__(self, memo: Any) -> None:
        return None

    def __reduce__(self) -> Tuple[Any, Tuple[()]]:
        return type(None), ()  # loads as None: a model loaded from a pickle is not initialized


_lock = threading.Lock()
_wrapped: List["weakref.ref[torch.nn.Module]"] = []


def _dtypes_now() -> Tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    return _C._model_boundary()


# A constant to Dynamo (torch.compiler.assume_constant_result, which would import Dynamo at
# ``import optamp``; this is all it does): what the answer depends on is guarded already (grad
# mode and disable_casts are global state Dynamo guards; initialize and reset clear its caches).
# test_model_boundary.py's compile test holds it to one graph.
_dtypes_now._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _caster(dtype: Optional[torch.dtype]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    if dtype is None:
        return None

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast


def _output_caster(
        dtype: Optional[torch.dtype]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The outputs' cast: the core's (at O2/O5 the reduced output stays with its fp32 cast, so
    that cross_entropy of the fp32 logits reads the reduced ones, as at O1), or a plain .to while
    Dynamo traces (a call into the extension would break the graph)."""
    if dtype is None or torch.compiler.is_compiling():
        return _caster(dtype)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return _C._cast_model_output(t, dtype)  # non-floating tensors come back as they are

    return cast


def _inner_forward(self: torch.nn.Module, inner: Optional[Callable[..., Any]],
                   args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if inner is not None:
        return inner(*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _boundary_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    owned = self.__dict__.get(_OWNER) is not None
    inputs, outputs = _dtypes_now() if owned else (None, None)
    cast_in, cast_out = _caster(inputs), _output_caster(outputs)
    if cast_in is not None:
        args, kwargs = map_tensors(args, cast_in), map_tensors(kwargs, cast_in)
    inner = self.__dict__.get(_INNER)
    working_copies = _compile.working_copies_for_trace() if owned else None
    if working_copies is not None:
        with working_copies:
            output = _inner_forward(self, inner, args, kwargs)
    else:
        output = _inner_forward(self, inner, args, kwargs)
    return output if cast_out is None else map_tensors(output, cast_out)


def _is_wrapper(value: object) -> bool:
    return (isinstance(value, types.MethodType)
            and getattr(value.__func__, "__code__", None) is _boundary_forward.__code__)


def _signature_with_self(forward: Callable[..., Any]) -> Optional[inspect.Signature]:
    """``forward``'s signature as a function's (a leading ``self``, which binding drops)."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # a callable inspect cannot read: the wrapper's own then
        return None
    this = inspect.Parameter("_optamp_self", inspect.Parameter.POSITIONAL_ONLY)
    return signature.replace(parameters=[this, *signature.parameters.values()])


def _bound_boundary_forward(model: torch.nn.Module,
                            own: Optional[Callable[..., Any]]) -> types.MethodType:
    """The wrapper for ``model`` (see the module's docstring for its name and signature)."""
    function = types.FunctionType(_boundary_forward.__code__, _boundary_forward.__globals__,
                                  "forward")
    function.__qualname__ = _boundary_forward.__qualname__
    wrapped = own if own is not None else types.MethodType(type(model).forward, model)
    function.__signature__ = _signature_with_self(wrapped)  # type: ignore[attr-defined]
    return types.MethodType(function, model)


def _compiled_module_inside(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(model)`` wrapper (``OptimizedModule``) runs, else ``model``.
    Its forward is Dynamo's frame around the inner module's call, so a boundary on the wrapper
    would run outside the graph, and the forward it traces (the inner module's) would never
    enter the working copies' mode: at O2/O5 a model compiled before ``initialize`` ran with
    fp32 parameters."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing compiled
    optimized = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def wrap(model: torch.nn.Module) -> None:
    """Gives ``model`` the boundary (once; ``unwrap_all`` takes it off again); a model compiled
    with ``torch.compile`` gets it on the module it compiled."""
    model = _compiled_module_inside(model)
    with _lock:
        own = model.__dict__.get("forward")
        if _is_wrapper(own):
            if model.__dict__.get(_OWNER) is None:  # a deep copy of an initialized model
                model.__dict__[_OWNER] = _Owner()
                _wrapped.append(weakref.ref(model))
            return
        if own is not None:
            model.__dict__[_INNER] = own
        model.__dict__["forward"] = _bound_boundary_forward(model, own)
        model.__dict__[_OWNER] = _Owner()
        _wrapped.append(weakref.ref(model))


def unwrap_all() -> None:
    """Restores the forward of every wrapped model still alive (what ``reset`` does)."""
    with _lock:
        for ref in reversed(_wrapped):
            model = ref()
            if model is None or not _is_wrapper(model.__dict__.get("forward")):
                continue
            model.__dict__.pop(_OWNER, None)
            inner = model.__dict__.pop(_INNER, None)
            if inner is None:
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = inner
        _wrapped.clear()
