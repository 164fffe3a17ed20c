"""Apex's model boundary: the forward of each model ``initialize`` is given casts floating inputs
to the model's dtype and floating outputs to fp32 (or ``cast_model_outputs``), "so the user never
needs to call .half()". The dtypes come from the compiled core (``_C._model_boundary``), which
C++'s ``amp::forward`` asks too, so both fronts cast the same tensors.

The boundary belongs to the models ``initialize`` was given, as in C++ (``amp::forward`` casts
nothing for any other module). The wrapper (``BoundaryForward``) holds the model it was put on and
the forward it wraps, if the model had its own instance ``forward``; it is not a closure over the
model, so that ``copy.deepcopy(model)`` (an EMA copy, say) gets a forward that runs the copy, not
one that still runs the original's. The copy is not an initialized model, so its forward is a
plain one (its ``_Owner`` mark deep-copies to None). A pickled model (``torch.save(model)``)
stores the forward it had before ``initialize``, so it loads without optamp, as a plain module.
"""
import copy
import sys
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _C, _compile
from ._tree import map_tensors

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


def _boundary_forward(self: torch.nn.Module, inner: Optional[Callable[..., Any]],
                      args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    inputs, outputs = _dtypes_now() if self.__dict__.get(_OWNER) is not None else (None, None)
    cast_in, cast_out = _caster(inputs), _output_caster(outputs)
    if cast_in is not None:
        args, kwargs = map_tensors(args, cast_in), map_tensors(kwargs, cast_in)
    working_copies = _compile.working_copies_for_trace() if cast_in is not None else None
    if working_copies is not None:
        with working_copies:
            output = _inner_forward(self, inner, args, kwargs)
    else:
        output = _inner_forward(self, inner, args, kwargs)
    return output if cast_out is None else map_tensors(output, cast_out)


class BoundaryForward:
    """``model.forward`` of a model with the boundary: calls the model's own forward (``inner``,
    an instance attribute it had, else its class's) between the boundary's casts.

    Where the wrapper should not show, it stands for the forward it wraps: ``__wrapped__`` is
    that forward (``inspect.signature(model.forward)`` gives its parameters, which libraries
    that map inputs onto them read), and pickling stores it instead of the wrapper, so a model
    saved whole by ``torch.save(model)`` loads as the plain module it was (a bound method
    pickles as ``getattr(model, name)``, which fails at load for a function the class lacks).
    A deep copy gets a wrapper of its own (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, inner: Optional[Callable[..., Any]]) -> None:
        self.__self__ = model
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _boundary_forward(self.__self__, self.inner, args, kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        model = self.__self__
        if self.inner is not None:
            return self.inner
        return types.MethodType(type(model).forward, model)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        if self.inner is not None:
            return copy.copy, (self.inner,)  # pickles as the forward the model had
        # Called while the loaded model's attributes are still empty: its class's forward.
        return getattr, (self.__self__, "forward")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "BoundaryForward":
        return BoundaryForward(copy.deepcopy(self.__self__, memo), copy.deepcopy(self.inner, memo))

    def __repr__(self) -> str:
        inner = "its class's forward" if self.inner is None else repr(self.inner)
        return f"<optamp model boundary of a {type(self.__self__).__name__} around {inner}>"


def _is_wrapper(value: object) -> bool:
    return isinstance(value, BoundaryForward)


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
        if not _is_wrapper(own):
            model.__dict__["forward"] = BoundaryForward(model, own)
        elif model.__dict__.get(_OWNER) is not None:
            return
        # else a deep copy of an initialized model: its wrapper was a plain forward until now
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
            inner = model.__dict__["forward"].inner
            if inner is None:
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = inner
        _wrapped.clear()
