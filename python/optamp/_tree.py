"""Walking the tensors inside (nested) lists, tuples, named tuples, dicts and dataclasses: what
the model boundary casts and the custom-function wrappers cast."""
import collections
import copy
import dataclasses
from typing import Any, Callable, List

import torch


# Values that are never containers. Asked first, before the dataclass check, which Dynamo cannot
# trace for some of them: a forward returning ``h.dtype`` failed under fullgraph=True at O2/O5
# ("Unsupported hasattr call" on torch.dtype, from dataclasses.is_dataclass).
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
           torch.layout, torch.memory_format)


def _is_dataclass_instance(value: Any) -> bool:
    if isinstance(value, _LEAVES):
        return False
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt with
    their own type (named tuples included); anything else is returned as it is.

    A dataclass instance (a model's output record) is rebuilt with ``dataclasses.replace``
    (fields with ``init=False`` are left to it), also one that is a dict as well (Hugging Face's
    ``ModelOutput``: its fields are its items; ``copy.copy``, which Dynamo does not trace, made
    ``fullgraph=True`` fail at O2/O5). Another dict subclass than ``OrderedDict`` is copied and
    its values replaced (``copy.copy``), so one whose constructor takes no key/value pairs
    (``defaultdict``) keeps its type and attributes."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if _is_dataclass_instance(value):  # before dict: a ModelOutput is both
        changes = {f.name: map_tensors(getattr(value, f.name), fn)
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        items = [(key, map_tensors(item, fn)) for key, item in value.items()]
        if type(value) in (dict, collections.OrderedDict):
            return type(value)(items)
        mapped = copy.copy(value)
        for key, item in items:
            mapped[key] = item
        return mapped
    return value


def tensors_in(value: Any, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """Appends the tensors inside ``value`` to ``out`` in order (dicts: their values;
    dataclasses: their fields); returns ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            tensors_in(v, out)
    elif _is_dataclass_instance(value):
        for f in dataclasses.fields(value):
            tensors_in(getattr(value, f.name), out)
    return out
