"""Walking the tensors inside (nested) lists, tuples, named tuples and dicts: what the forward
wrapper of ``cast_model_outputs`` and the custom-function wrappers cast."""
from typing import Any, Callable, List

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)``, containers rebuilt with
    their own type (named tuples included); anything else is returned as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    return value


def tensors_in(value: Any, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """Appends the tensors inside ``value`` to ``out`` in order (dicts: their values); returns
    ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            tensors_in(v, out)
    return out
