"""Local SGD's model averaging (``torch.distributed.algorithms.model_averaging``) under optamp.

``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager`` or ``HierarchicalModelAverager``
averages the parameters across ranks after the optimizer's step, in grad mode. Two things failed:

* torch's ``average_parameters`` flattens ``p.data`` (the master: not substituted), all-reduces
  it and writes each slice back with ``p.data = slice.type_as(p)``. ``type_as`` is an op that
  takes the parameter, so at O2/O5 it read the fp16/bf16 working copy and the masters' data were
  replaced by reduced-precision tensors: the next guard refused the model ("must still be
  torch.float32 as when amp::initialize ran"). In a forward ``x.type_as(weight)`` must see the
  working copy (Apex's fp16 model), so the op stays substituted; averaging runs with optamp's
  rules off instead (``disable_casts``): it reads and writes the parameters themselves.
* The averagers average the parameters that have a gradient (``get_params_to_average``). After
  an overflow optamp's guard sets every gradient to None and the optimizer's step changes
  nothing, so the rank found none to average and ``torch.cat`` failed on the empty list. Past
  the local-SGD start DDP no longer all-reduces gradients, so an overflow is one rank's alone;
  the others' all-reduce would wait for it. On a step whose gradients were all dropped, the
  parameters that require grad are averaged instead: the set the other ranks average when each
  trainable parameter had a gradient, so every rank joins the collective with the same sizes and
  the skipped rank takes the others' progress. (``torch.amp.GradScaler`` skips the wrapper's
  whole ``step``, averaging included, and so leaves the other ranks' collective unmatched:
  pytorch/pytorch#76282.)

The module costs nothing to import once ``torch.distributed`` is (it always is where it is
available), so :func:`install` imports it. The functions are wrapped in the module, where the
averagers look them up; a program that imported one of them by name before ``import optamp``
keeps torch's.
"""
import functools
from typing import Any, Callable, Iterable, List

import torch

from . import _C
from ._wrapping import marked, replace, rules_off


def _trainable_when_all_dropped(function: Callable[..., List[Any]]) -> Callable[..., List[Any]]:
    @functools.wraps(function)
    def run(params: Iterable[Any]) -> List[Any]:
        if not _C.is_initialized():
            return function(params)
        given = list(params)
        chosen = function(given)
        if chosen:
            return chosen
        flat = [p for entry in given
                for p in (entry["params"] if isinstance(entry, dict) else [entry])]
        return [p for p in flat if p.requires_grad]

    return marked(run)


def install() -> None:
    """Idempotent."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.algorithms.model_averaging import utils

    replace(utils, "average_parameters", rules_off)
    replace(utils, "get_params_to_average", _trainable_when_all_dropped)
