"""Where a run loses precision (docs/precision.md).

``precision_report`` records, for a few steps, every ATen op call forward and backward through
the compiled ``PrecisionProbe``: the dtypes each op ran in, the largest |value|, how many output
values would overflow or flush to zero in float16 / bfloat16, and which op produced the first
inf/NaN, named by module path (in backward too). ``compare_with_fp32`` runs a model's forward as
the current opt level runs it and in fp32, and reports each submodule's error.

    with amp.precision_report(model) as rep:
        for x, y in batches[:3]:
            ...                            # a few ordinary training steps
    print(rep.table())
    print(rep.first_nonfinite)     # {'op': 'aten::addmm', 'phase': 'forward', 'scope': 'fc2', ...}
"""
import itertools
import json
import math
import threading
from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch

from . import _C
from .frontend import properties

__all__ = ["PrecisionReport", "Fp32Comparison", "precision_report", "compare_with_fp32"]

Models = Union[None, torch.nn.Module, Sequence[torch.nn.Module]]
_NOT_STARTED = "precision_report: nothing recorded yet; use it as `with ... as rep:`"


def _model_list(model: Models, what: str) -> List[torch.nn.Module]:
    if model is None:
        return []
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    for i, m in enumerate(models):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"{what}: model must be a torch.nn.Module, a list of them or None; "
                f"item {i} is a {type(m).__name__}"
            )
    return models


def _module_paths(models: List[torch.nn.Module]) -> Iterator[Tuple[str, torch.nn.Module]]:
    """Each (sub)module with the path rows name it by: named_modules() paths ("encoder.fc1"), the
    root by its class name; with several models, "<index>." in front (as a ModuleList names)."""
    for i, model in enumerate(models):
        prefix = f"{i}." if len(models) > 1 else ""
        for name, module in model.named_modules():
            if name:
                yield prefix + name, module
            else:
                yield (str(i) if len(models) > 1 else type(model).__name__), module


class _ScopeHooks:
    """Forward pre/post hooks that open a PrecisionScope named by the module path around each
    submodule's forward (a per-thread stack: forwards may run on several threads)."""

    def __init__(self, models: List[torch.nn.Module]) -> None:
        self._local = threading.local()
        self._handles: List[torch.utils.hooks.RemovableHandle] = []
        for path, module in _module_paths(models):
            self._handles.append(module.register_forward_pre_hook(self._pre(path)))
            # always_call: a forward that raises still closes its scope.
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _stack(self) -> List[_C.PrecisionScope]:
        stack: Optional[List[_C.PrecisionScope]] = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack().append(_C.PrecisionScope(path))

        return hook

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop().close()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        stack = self._stack()
        while stack:
            stack.pop().close()


class PrecisionReport:
    """Context manager: records while inside, then holds the report. ``rows`` (list of dicts, in
    first-call order), ``first_nonfinite`` (dict or None), ``table(max_rows)`` (markdown),
    ``to_dict()`` (JSON-serialisable), ``str(rep)`` (the table). Readable while recording too
    (a snapshot)."""

    def __init__(self, models: List[torch.nn.Module], label: str) -> None:
        self._models = models
        self._label = label
        self._probe: Optional[_C.PrecisionProbe] = None
        self._hooks: Optional[_ScopeHooks] = None
        self._data: Optional[Dict[str, Any]] = None

    def __enter__(self) -> "PrecisionReport":
        if self._probe is not None:
            raise RuntimeError("precision_report: this report has already recorded; make a new one")
        self._probe = _C.PrecisionProbe(self._label)  # raises if another probe records
        try:
            self._hooks = _ScopeHooks(self._models)
        except BaseException:
            self._probe.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Ends recording (as leaving the ``with`` block does); idempotent."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._probe is not None and self._probe.recording:
            self._probe.stop()
            self._data = json.loads(self._probe.json())

    @property
    def recording(self) -> bool:
        return self._probe is not None and self._probe.recording

    def to_dict(self) -> Dict[str, Any]:
        """``{"calls", "unmeasured", "rows": [...], "first_nonfinite": {...} | None}``."""
        if self._probe is None:
            raise RuntimeError(_NOT_STARTED)
        if self._data is not None:
            return self._data
        data: Dict[str, Any] = json.loads(self._probe.json())
        return data

    @property
    def rows(self) -> List[Dict[str, Any]]:
        rows: List[Dict[str, Any]] = self.to_dict()["rows"]
        return rows

    @property
    def first_nonfinite(self) -> Optional[Dict[str, Any]]:
        first: Optional[Dict[str, Any]] = self.to_dict()["first_nonfinite"]
        return first

    def table(self, max_rows: int = 40) -> str:
        if self._probe is None:
            raise RuntimeError(_NOT_STARTED)
        return self._probe.table(max_rows)

    def __str__(self) -> str:
        return self.table() if self._probe is not None else "<precision_report: not started>"


_reports = itertools.count(1)


def precision_report(model: Models = None, label: Optional[str] = None) -> PrecisionReport:
    """Record every op's precision statistics inside the ``with`` block.

    ``model``: a module or a list of modules (or None): each submodule's forward names its ops
    (and, through autograd's sequence numbers, its backward ops) by module path. A probe makes
    every op measure its outputs (one device->host read per op on a GPU): use it for a few
    steps. Only one report records at a time (RuntimeError naming the one recording).
    """
    models = _model_list(model, "precision_report")
    return PrecisionReport(models, label or f"optamp.precision_report #{next(_reports)}")


# ---- fp32 comparison -----------------------------------------------------------------------


class Fp32Comparison:
    """Per-module error of the opt level's forward against the fp32 forward, in forward order.
    ``rows``: dicts with ``module``, ``call`` (1 = the module's first call in the forward),
    ``dtype`` (of its output at the level), ``rel_error`` (||y - y_ref|| / ||y_ref||, in fp32),
    ``max_abs_error``, ``elements``; ``table()`` (markdown), ``to_dict()``, ``str()``."""

    def __init__(self, rows: List[Dict[str, Any]], opt_level: str) -> None:
        self.rows = rows
        self.opt_level = opt_level

    def to_dict(self) -> Dict[str, Any]:
        return {"opt_level": self.opt_level, "rows": self.rows}

    def table(self, max_rows: int = 40) -> str:
        if max_rows < 1:
            raise ValueError(f"compare_with_fp32: max_rows must be >= 1, got {max_rows}")
        lines = [
            f"| module | call | dtype at {self.opt_level} | rel. error | max abs error "
            "| elements |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for r in self.rows[:max_rows]:
            lines.append(
                f"| {r['module']} | {r['call']} | {r['dtype']} | {r['rel_error']:.3g} | "
                f"{r['max_abs_error']:.3g} | {r['elements']} |"
            )
        if len(self.rows) > max_rows:
            lines.append(f"\n{len(self.rows) - max_rows} more rows (to_dict() holds them all)")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.table()


def _floating_tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floating_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floating_tensors(v)]
    return []


def _capture(model: torch.nn.Module, inputs: Tuple[Any, ...], kwargs: Dict[str, Any]
             ) -> List[Tuple[str, int, List[torch.Tensor]]]:
    """One forward; each module call's floating outputs (detached) in the order calls end...
    sorted back to the order they start (forward order)."""
    calls: List[Tuple[int, str, int, List[torch.Tensor]]] = []
    started: Dict[int, List[int]] = {}
    counts: Dict[str, int] = {}
    order = [0]
    handles: List[torch.utils.hooks.RemovableHandle] = []

    def pre(path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            started.setdefault(id(module), []).append(order[0])
            order[0] += 1

        return hook

    def post(path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            counts[path] = counts.get(path, 0) + 1
            outs = [t.detach() for t in _floating_tensors(output)]
            calls.append((started[id(module)].pop(), path, counts[path], outs))

        return hook

    for path, module in _module_paths([model]):
        handles.append(module.register_forward_pre_hook(pre(path)))
        handles.append(module.register_forward_hook(post(path)))
    try:
        model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return [(path, n, outs) for _, path, n, outs in sorted(calls, key=lambda c: c[0])]


def _error_row(path: str, call: int, outs: List[torch.Tensor], refs: List[torch.Tensor]
               ) -> Dict[str, Any]:
    diff_sq = ref_sq = 0.0
    max_abs = 0.0
    elements = 0
    for y, r in zip(outs, refs):
        y32, r32 = y.float(), r.float().to(y.device)
        d = y32 - r32
        diff_sq += float(d.pow(2).sum())
        ref_sq += float(r32.pow(2).sum())
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
        elements += y.numel()
    if ref_sq > 0:
        rel = math.sqrt(diff_sq) / math.sqrt(ref_sq)
    else:
        rel = 0.0 if diff_sq == 0 else math.inf
    dtype = str(outs[0].dtype).replace("torch.", "") if outs else "-"
    return {"module": path, "call": call, "dtype": dtype, "rel_error": rel,
            "max_abs_error": max_abs, "elements": elements}


def _check_fp32_reference(model: torch.nn.Module) -> str:
    props = properties()
    level = props.opt_level if props is not None and props.enabled else "O0"
    low = [n for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]
    if level == "O3" or low:
        raise RuntimeError(
            f"compare_with_fp32: there is no fp32 reference at {level}: the model's own "
            f"parameters are {', '.join(low[:3]) or 'cast'} in reduced precision (O3, or a level "
            "with master_weights=False, casts the model in place and keeps no fp32 weights). "
            "Compare an fp32 copy of the model made before initialize instead."
        )
    return level


class _SameStateTwice:
    """Both forwards start from the same RNG state (dropout) and buffers (batch-norm running
    statistics); afterwards both are as they were before the first."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._devices = sorted({b.device.index for b in self._tensors() if b.is_cuda})
        self._cpu = torch.get_rng_state()
        self._cuda = [torch.cuda.get_rng_state(d) for d in self._devices]

    def _tensors(self) -> List[torch.Tensor]:
        return [*self._model.parameters(), *self._model.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self._cpu)
        for d, state in zip(self._devices, self._cuda):
            torch.cuda.set_rng_state(state, d)


def compare_with_fp32(model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Fp32Comparison:
    """Run ``model(*inputs, **kwargs)`` once as the current opt level runs it in training and once
    in fp32 (optamp's casts and the O2/O5 working copies off: ``disable_casts``), and report each
    submodule's output error against the fp32 run, in forward order.

    The level's forward runs with grad mode on (optamp applies O1/O2/O4/O5 only while autograd
    records, see docs/casting.md) but no backward: parameters get no grads. Both runs start from
    the same RNG state and buffers, which are restored afterwards, and the cast cache the
    level's run filled is dropped (the next step re-casts). At O3 (a model cast in place) there
    is no fp32 reference: RuntimeError.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"compare_with_fp32: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    level = _check_fp32_reference(model)
    state = _SameStateTwice(model)
    try:
        with torch.enable_grad():
            at_level = _capture(model, inputs, kwargs)
            state.restore()
            with _C.disable_casts():
                reference = _capture(model, inputs, kwargs)
    finally:
        state.restore()
        _C.clear_cache()
    rows = []
    for (path, call, outs), (ref_path, ref_call, refs) in zip(at_level, reference):
        if (path, call) != (ref_path, ref_call) or len(outs) != len(refs):
            raise RuntimeError(
                f"compare_with_fp32: the fp32 forward called other modules than the {level} one "
                f"({path} call {call} vs {ref_path} call {ref_call}); the model's control flow "
                "depends on the dtype"
            )
        rows.append(_error_row(path, call, outs, refs))
    return Fp32Comparison(rows, level)
