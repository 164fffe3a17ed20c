"""torch.compile under optamp.

Dynamo traces Python; the casts happen below it, in the dispatcher, when AOTAutograd traces the
graph's ops. So a compiled graph holds the casts of the state it was traced under, and reusing it
under another state would silently change precision. What keeps that from happening:

* Regions and ``disable_casts`` are carried in the PrivateUse1 autocast dtype slot and the
  dispatch-key TLS (see docs/casting.md), both part of Dynamo's guards: entering a region makes
  Dynamo recompile (``GLOBAL_STATE changed: autocast(privateuseone)_dtype``).
* The level itself is process-wide and not guarded, so ``initialize`` and ``reset`` call
  ``torch._dynamo.reset()``: frames compiled under another level (or none) are traced again.
* AOTAutograd's cache keys a compiled artifact by the Dynamo graph, which holds no casts: an O1
  artifact was served to an O5 run (fp16 instead of bf16). While optamp casts, that cache is
  turned off; ``reset`` restores the previous setting.

O2/O5's working copies need one more piece. Eager ops find them through a dispatch key on the
registered tensors themselves, and the tensors AOTAutograd traces with (fake and functional
tensors made from the parameters) carry no such key: a compiled O2 model ran with fp32
parameters, O1's numerics in an O2 run. So while Dynamo traces an initialized model's forward,
the model boundary enters :class:`WorkingCopies`, a ``TorchFunctionMode`` that Dynamo traces
into the graph: each function the forward calls sees a registered tensor as ``t.to(dtype)``,
on the same terms as eager substitution (where the rules apply, read-only arguments only, not
in the "own data" functions nor in the calls the casting kernel casts to fp32, whose plan it
asks; view functions hand a buffer its own data and mark the view, which later calls read as
the working dtype; a norm's updated running statistics by copy and write-back). The casts are
then ordinary graph nodes, which inductor fuses.
"""
import sys
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from . import _C

_saved_autograd_cache: Optional[bool] = None

_MARK = "_optamp_working_copy"  # "parameter" or "buffer" on every tensor O2/O5 substitutes
_BUFFER_VIEW = "_optamp_buffer_view"  # on a view of a registered buffer, while Dynamo traces
# Keyed by id(): a swap takes one tensor's out in constant time (a dead entry's id may be reused:
# it is then replaced, which is what a dead tensor's entry is worth).
_marked: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_substituting = False  # initialized at O2/O5 (a plain flag: Dynamo reads it as a constant)


def _reset_dynamo() -> None:
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing compiled yet
    if dynamo is not None:
        dynamo.reset()


def on_initialize(casting: bool, working_copy_sources: List[torch.Tensor]) -> None:
    """Called by initialize; ``casting``: the level casts (enabled, not O0);
    ``working_copy_sources``: the tensors ops see as working copies (O2/O5), else empty."""
    global _saved_autograd_cache, _substituting
    _reset_dynamo()
    _substituting = bool(working_copy_sources)
    for t in working_copy_sources:
        setattr(t, _MARK, "parameter" if isinstance(t, torch.nn.Parameter) else "buffer")
        _marked[id(t)] = weakref.ref(t)
    if casting and _saved_autograd_cache is None:
        import torch._functorch.config as functorch_config

        _saved_autograd_cache = functorch_config.enable_autograd_cache
        functorch_config.enable_autograd_cache = False


def take_marks(*tensors: torch.Tensor) -> List[Optional[str]]:
    """Takes the working-copy marks off ``tensors`` (and the weak references to them, which
    ``torch.utils.swap_tensors`` refuses): each one's mark, or None (see _tensor_swap.py)."""
    for t in tensors:
        ref = _marked.get(id(t))
        if ref is not None and ref() is t:
            del _marked[id(t)]
    return [t.__dict__.get(_MARK) for t in tensors]


def put_marks(marks: List[Optional[str]], *tensors: torch.Tensor) -> None:
    """Puts the marks :func:`take_marks` returned back on ``tensors``, in the same order."""
    for t, mark in zip(tensors, marks):
        if mark is None:
            t.__dict__.pop(_MARK, None)  # a swap hands the other tensor's attributes over
        else:
            setattr(t, _MARK, mark)
            _marked[id(t)] = weakref.ref(t)


def on_reset() -> None:
    """Called by reset."""
    global _saved_autograd_cache, _substituting
    _reset_dynamo()
    _substituting = False
    for ref in _marked.values():
        t = ref()
        if t is not None and _MARK in t.__dict__:
            delattr(t, _MARK)
    _marked.clear()
    if _saved_autograd_cache is not None:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = _saved_autograd_cache
        _saved_autograd_cache = None


# The normalizations with running statistics, as torch functions are named.
_NORMS_WITH_STATISTICS: FrozenSet[str] = frozenset({"batch_norm", "instance_norm"})


def _flat(values: Iterable[Any]) -> List[Any]:
    """``values`` with the lists and tuples among them opened, one level (ops take Tensor[])."""
    return [v for value in values
            for v in (value if isinstance(value, (list, tuple)) else (value,))]


# Torch functions a forward calls whose operator has another name (the mode sees the Python
# function, not the operators it calls), and the operators' dunders.
_OPERATOR_NAMES: Dict[str, str] = {
    "cross_entropy": "cross_entropy_loss", "nll_loss": "nll_loss_nd", "grid_sample": "grid_sampler",
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "rsub", "__mul__": "mul",
    "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div", "__matmul__": "matmul",
    "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
}


def _operator_of(func: Any) -> str:
    # A dispatcher op's qualified name, read outside the trace as _written_by_op reads schemas.
    if isinstance(func, torch._ops.OpOverloadPacket):
        return str(func._qualified_op_name)
    schema = func._schema
    return str(schema.name) + ("." + schema.overload_name if schema.overload_name else "")


_operator_of._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _eager_reads_masters(op: str, device: str, tensors: Tuple[Tuple[torch.dtype, bool, bool], ...],
                         self_dtype: Optional[torch.dtype], dtype_given: bool) -> bool:
    # The casting kernel's own plan for such a call (a constant to Dynamo: what it depends on,
    # the level, regions and grad mode, is guarded or resets Dynamo, as _working_dtype_now).
    return _C._call_reads_masters(op, device, tensors, self_dtype, dtype_given)


_eager_reads_masters._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _reads_the_masters(func: Any, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       dtype: torch.dtype, written: Tuple[int, ...],
                       written_names: Tuple[str, ...]) -> bool:
    """Whether eager substitution leaves this call's registered tensors as they are: a call with
    a complex argument (substitution.cpp, has_complex_argument), a batch or instance norm given an
    input wider than the working copies (normalizes_a_wider_input), or a call the casting kernel
    casts to fp32 (an fp32 (always) op; an fp32 rule that applies, such as the fp32 losses'; a
    promotion or a widening of mixed widths to fp32: a layer norm of an fp32 sum; cast_kernel.cpp
    reads the masters past substitution) or runs through the op's own autocast kernel. Until
    2026-12-08 only the fp32 (always) ops were known here: a layer norm given an fp32 input, or a
    cross entropy with a registered class-weight buffer, read the working copies widened compiled
    (gradients rounded through fp16) where eager read the masters."""
    if name in _NORMS_WITH_STATISTICS:
        x = args[0] if args else kwargs.get("input")
        if (isinstance(x, torch.Tensor) and x.is_floating_point()
                and not is_working_copy_source(x) and x.itemsize > dtype.itemsize):
            return True
    if any(isinstance(v, complex) or (isinstance(v, torch.Tensor) and v.is_complex())
           for v in _flat((*args, *kwargs.values()))):
        return True
    read = [a for i, a in enumerate(args) if i not in written]
    read += [v for k, v in kwargs.items() if k != "out" and k not in written_names]
    tensors = [v for v in _flat(read) if isinstance(v, torch.Tensor)]
    if not tensors:
        return False
    floating = tuple((t.dtype, is_working_copy_source(t) or getattr(t, _BUFFER_VIEW, False) is True,
                      t.dim() > 0)
                     for t in tensors if t.is_floating_point() and t.dtype != torch.float64)
    first = args[0] if args else None
    self_dtype = (first.dtype if isinstance(first, torch.Tensor) and first.is_floating_point()
                  else None)
    dtype_given = (kwargs.get("dtype") is not None
                   or any(isinstance(a, torch.dtype) for a in args))
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        op = _operator_of(func)
    else:
        op = "aten::" + _OPERATOR_NAMES.get(name, name)
    return _eager_reads_masters(op, tensors[0].device.type, floating, self_dtype, dtype_given)


def is_working_copy_source(t: torch.Tensor) -> bool:
    """Whether ops see ``t`` as a working copy at O2/O5 (it was registered by initialize)."""
    return getattr(t, _MARK, None) in ("parameter", "buffer")


def is_registered_buffer(t: torch.Tensor) -> bool:
    """Whether ``t`` is a buffer ops see as a working copy at O2/O5."""
    return getattr(t, _MARK, None) == "buffer"


def _is_buffer_or_its_view(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (is_registered_buffer(t)
                                            or getattr(t, _BUFFER_VIEW, False) is True)


def _working_dtype_now() -> Optional[torch.dtype]:
    # The working copies' dtype where ops see them, None elsewhere (docs/casting.md). A constant
    # to Dynamo, as _boundary._dtypes_now is: what it depends on (grad mode, regions,
    # disable_casts, the level) is guarded or resets Dynamo. Until 2026-12-07 this read the
    # boundary's input dtype, which cast_model_inputs=False leaves unset: a compiled O2/O5 model
    # then traced its forward on the fp32 masters (only the lists' casts reduced precision).
    return _C._working_copy_dtype()


_working_dtype_now._dynamo_marked_constant = True  # type: ignore[attr-defined]

# The functions whose job is to hand back the tensor's own data or metadata, as the dispatch
# key's fallthrough ops in eager (docs/casting.md, "O2/O5: what ops see"); property reads
# (``p.dtype``, ``p.grad``) arrive as "__get__".
_OWN_DATA: FrozenSet[str] = frozenset({
    "__get__", "__set__", "detach", "detach_", "alias", "clone", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "cpu", "cuda", "contiguous", "copy_", "set_", "item", "tolist",
    "numpy", "equal", "requires_grad_", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "backward", "data_ptr", "untyped_storage", "size",
    "dim", "ndimension", "stride", "numel", "nelement", "storage_offset", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_pinned", "__len__",
    "__repr__", "__format__", "__hash__", "__bool__", "__reduce_ex__", "__deepcopy__",
    "__array__", "__setstate__", "__getstate__",
})
# In-place dunders: their first argument is written.
_INPLACE_DUNDERS: FrozenSet[str] = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
    "__irshift__",
})
_STATISTICS = ("running_mean", "running_var")
# Functions that return views of their first argument: on a registered buffer they get its own
# data, so that writes through the view reach it (eager: substitution.cpp, returns_a_view); the
# view is marked, and read as the working dtype by the calls that take it.
_VIEWS: FrozenSet[str] = frozenset({
    "__getitem__", "view", "view_as", "reshape", "reshape_as", "t", "transpose", "swapaxes",
    "swapdims", "permute", "movedim", "moveaxis", "unsqueeze", "squeeze", "expand", "expand_as",
    "narrow", "select", "split", "split_with_sizes", "tensor_split", "chunk", "unbind",
    "flatten", "unflatten", "diagonal", "unfold", "as_strided", "view_as_real", "view_as_complex",
})


def _written_in(schemas: List[Any]) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """The positions and names of the arguments any of ``schemas`` marks written
    (``Tensor(a!)``)."""
    written = {(i, a.name) for schema in schemas for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write}
    return tuple(sorted(i for i, _ in written)), tuple(sorted(n for _, n in written))


def _written_by_op(op: Any) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    # Read outside the trace, as a constant: Dynamo can wrap neither a FunctionSchema nor a
    # packet's ``overloads()`` (a bound method). The graph break this made inside the mode
    # failed ``fullgraph=True`` for any custom op and, in a Hugging Face MoE model (its experts
    # call ``torch.ops.transformers.grouped_mm_fallback``), handed the resumed frame a
    # torch.Size for a tensor's device.
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _written_in([getattr(op, overload)._schema for overload in op.overloads()])
    return _written_in([op._schema])


_written_by_op._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _written_arguments(func: Any, name: str) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """The positions and keyword names of the arguments a call writes: an in-place method's (or
    dunder's) self; for a dispatcher op, those its schema marks written (``Tensor(a!)``; any
    overload's, for a packet), as eager substitution reads them (substitution.cpp). A custom op
    that updates a registered buffer (a counter, a cache) then updates the buffer itself, not a
    working copy of it (until 2026-12-06 the update was lost in a compiled O2/O5 model)."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _written_by_op(func)
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        return (0,), ()
    return (), ()


def _updated_statistics(func: Callable[..., Any], args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Tuple[int, ...]:
    """The positions of the running statistics a batch or instance norm call updates in place
    (their schemas do not mark them written); () when it only reads them, or is no such call.
    Keyword statistics are found by name (``_STATISTICS``) where this is not ()."""
    F = torch.nn.functional
    if func is F.batch_norm or func is F.instance_norm:
        positions = (1, 2)
    elif func is torch.batch_norm or func is torch.instance_norm:
        positions = (3, 4)
    else:
        return ()
    instance = func is F.instance_norm or func is torch.instance_norm
    flag = kwargs.get("use_input_stats" if instance else "training", instance)
    if len(args) > 5:
        flag = args[5]
    return positions if flag else ()


def _mark_buffer_views(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        setattr(value, _BUFFER_VIEW, True)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _mark_buffer_views(v)
    return value


def _substituted(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if is_working_copy_source(value) or getattr(value, _BUFFER_VIEW, False) is True:
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_substituted(v, dtype) for v in value)
    return value


def _any_substitutable(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a call has a tensor substitution replaces (most calls have none: activations only;
    Dynamo traces this mode for every call, so those leave at once)."""
    return any(isinstance(v, torch.Tensor)
               and (is_working_copy_source(v) or getattr(v, _BUFFER_VIEW, False) is True)
               for v in _flat((*args, *kwargs.values())))


def _entering(body: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    def body_with_working_copies(*args: Any, **kwargs: Any) -> Any:
        with WorkingCopies(dtype):
            return body(*args, **kwargs)

    return body_with_working_copies


class WorkingCopies(TorchFunctionMode):
    """O2/O5 substitution for a forward Dynamo traces (see the module's docstring). Each call's
    registered tensors (in read-only arguments, lists included) become ``t.to(dtype)``; a tensor
    used twice is cast twice, so each use's gradient reaches the fp32 parameter on its own and
    they are summed in fp32, as in eager."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "tag_activation_checkpoint" and args and callable(args[0]):
            # Dynamo's torch.utils.checkpoint (both variants): the mode sees the call, not the
            # body's ops, so the body enters it itself (eager checkpoints run the body under the
            # state of the call too: docs/casting.md, "Activation checkpointing").
            return func(_entering(args[0], self.dtype), *args[1:], **kwargs)
        if (name in _OWN_DATA or _working_dtype_now() != self.dtype
                or not _any_substitutable(args, kwargs)):
            return func(*args, **kwargs)
        written, written_names = _written_arguments(func, name)
        if _reads_the_masters(func, name, args, kwargs, self.dtype, written, written_names):
            return func(*args, **kwargs)
        if name in _VIEWS and args and _is_buffer_or_its_view(args[0]):
            return _mark_buffer_views(func(*args, **kwargs))
        updated = _updated_statistics(func, args, kwargs)
        # A norm's updated statistics get a copy of their own, copied back after the call, as
        # eager substitution does (csrc/core/dispatch/substitution.cpp).
        write_back: List[Tuple[torch.Tensor, torch.Tensor]] = []

        def sub(value: Any, updated_here: bool) -> Any:
            if updated_here and isinstance(value, torch.Tensor) and is_working_copy_source(value):
                copy = value.to(self.dtype)
                write_back.append((value, copy))
                return copy
            return _substituted(value, self.dtype)

        args = tuple(a if i in written else sub(a, i in updated) for i, a in enumerate(args))
        kwargs = {k: v if k == "out" or k in written_names else
                  sub(v, bool(updated) and k in _STATISTICS) for k, v in kwargs.items()}
        result = func(*args, **kwargs)
        for source, copy in write_back:
            source.copy_(copy)
        return result


def working_copies_for_trace() -> Optional[WorkingCopies]:
    """The mode a model boundary enters around the forward while Dynamo traces it at O2/O5 where
    ops see working copies; None otherwise (eager runs substitute in the dispatcher)."""
    if not _substituting or not torch.compiler.is_compiling():
        return None
    dtype = _working_dtype_now()
    return None if dtype is None else WorkingCopies(dtype)
