"""``torch.distributed.pipelining`` stages cast the same with grad mode on or off.

A pipeline fixes the dtypes that cross between stages when it starts: ``PipelineStage`` runs its
module once under ``torch.no_grad()`` (``_shape_inference``) and every later forward is checked
against that (``PipeliningShapeError``), and the next stage's receive buffers are allocated from
it. optamp's no_grad gate casts nothing under no_grad (docs/casting.md), so at O1/O4 the
inference saw fp32 outputs and the first training forward fp16 ones: "Stage 1 forward outputs:
value 0 has a dtype mismatch: expected torch.float32 actual torch.float16". ``schedule.eval()``
under ``torch.no_grad()`` after training would fail the same way the other way round. Native
autocast casts under no_grad too, so its stages agree with themselves.

So a stage's forward (``forward_one_chunk``, which ``step`` and ``eval`` run) and its shape
inference run with the gate lifted (``lift_no_grad_gate``): inside a pipeline stage optamp's
rules apply as with ``rules_under_no_grad=True``; a region or ``disable_casts`` around the call
still holds. Backward is untouched.

A received activation arrives in a buffer the stage allocated once per micro-batch and reuses
every step: a leaf that requires grad, which optamp's cast cache takes for a parameter (at
O1/O4 an fp32 activation from the previous stage is cast to fp16/bf16 through the cache), and
which the receive overwrites without bumping its version counter. The cache then served the
first step's activations to every later step (gradients 100% off from the second step on). So
the buffers' versions are bumped when the stage takes them for a forward
(``_retrieve_recv_activations``): a write the cache sees, as an in-place op's would be.

A stage built by the tracer front end (``pipeline(model, ...).build_stage``) takes its
dtypes from the graph ``torch.export`` traced, before ``initialize``: fp32. At O1/O4 its forward
gives fp16/bf16 and failed the same check, and the next stage's receive buffers were fp32. So a
stage's floating outputs are cast to the dtypes the pipeline recorded for them (the wrapper of
``forward_maybe_with_nosync``, the call of the stage's module): a cast recorded by autograd, as
the model boundary's at O2/O5; where the records came from running the stage (shape inference,
above) they already agree and nothing is cast.

torch.distributed.pipelining takes 0.9 s to import, so optamp does not import it for every
program: :func:`install` wraps it when it is imported already (at ``import optamp`` and at
``initialize``), and ``initialize`` imports it when a default process group exists (pipelines
need one). A program that imports it only after both, with no process group at ``initialize``,
is not covered.
"""
import functools
import sys
from typing import Any, Callable

import torch

from . import _C
from ._wrapping import inside, marked, replace

_MODULE = "torch.distributed.pipelining.stage"


def _versions_bumped(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        received = method(self, *args, **kwargs)
        tensors = [t for t in received if isinstance(t, torch.Tensor)]
        if tensors:
            torch.autograd.graph.increment_version(tensors)
        return received

    return marked(run)


def _as_recorded(value: Any, recorded: Any) -> Any:
    if (isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor)
            and value.is_floating_point() and recorded.is_floating_point()
            and value.dtype != recorded.dtype):
        return value.to(recorded.dtype)
    return value


def _outputs_as_recorded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = method(self, *args, **kwargs)
        recorded = getattr(self, "_outputs_meta", None)
        if not _C.is_initialized() or recorded is None:
            return output
        if isinstance(output, torch.Tensor):
            return _as_recorded(output, recorded[0]) if len(recorded) == 1 else output
        if isinstance(output, (tuple, list)) and len(output) == len(recorded):
            return type(output)(_as_recorded(v, r) for v, r in zip(output, recorded))
        return output

    return marked(run)


def _wrap(stage: Any) -> None:
    def gate_lifted(method: Callable[..., Any]) -> Callable[..., Any]:
        return inside(_C.lift_no_grad_gate, method)

    for cls, name, wrap in (
            (stage._PipelineStageBase, "forward_one_chunk", gate_lifted),
            (stage.PipelineStage, "_shape_inference", gate_lifted),
            (stage._PipelineStageBase, "forward_maybe_with_nosync", _outputs_as_recorded),
            (stage._PipelineStageBase, "_retrieve_recv_activations", _versions_bumped)):
        replace(cls, name, wrap)


def install(import_if_distributed: bool = False) -> None:
    """Idempotent. ``import_if_distributed``: import the module if a default process group
    exists (``initialize``)."""
    stage = sys.modules.get(_MODULE)
    if stage is None and import_if_distributed:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            import torch.distributed.pipelining.stage as stage
    if stage is not None:
        _wrap(stage)
