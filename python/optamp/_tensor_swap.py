"""``torch.utils.swap_tensors`` with optamp's records kept.

``swap_tensors(t1, t2)`` gives ``t1`` the content of ``t2`` (and the other way round) by
exchanging their TensorImpls, each Python object keeping its identity. ``Module.to()``,
``.half()``, ``.cpu()`` and ``load_state_dict()`` call it for every parameter under
``torch.__future__.set_swap_module_params_on_conversion(True)`` (announced as a future default),
and always for tensor-subclass parameters (DTensor); ``register_parametrization`` and FSDP2's
device move call it too. It refuses while anything holds a weak reference to either tensor, and
optamp keeps its per-tensor records by weak references (C++) and, at O2/O5, marks the tensors
ops see as working copies (Python). Until 2026-12-07 every such conversion or checkpoint load
after ``initialize`` therefore failed ("Expected no weakrefs to t1's Tensor object"), at every
level. The wrapper takes the records off both tensors, swaps, and puts them back on the
TensorImpl each tensor holds then: the records follow the tensor the model and the optimizer
hold, as torch.optim's state does.
"""
import functools
from typing import Any, List, Optional

import torch

from . import _C, _compile
from ._wrapping import Function, marked, replace


def _keeping_records(swap: Function) -> Function:
    @functools.wraps(swap)
    def swap_tensors(t1: Any, t2: Any) -> Any:
        if not (isinstance(t1, torch.Tensor) and isinstance(t2, torch.Tensor)):
            return swap(t1, t2)  # torch's own error
        hold = _C._hold_records_for_swap(t1, t2)
        marks: List[Optional[str]] = _compile.take_marks(t1, t2)
        try:
            return swap(t1, t2)
        finally:
            _C._restore_records_after_swap(hold, t1, t2)
            _compile.put_marks(marks, t1, t2)

    return marked(swap_tensors)


def install() -> None:
    """Idempotent."""
    replace(torch.utils, "swap_tensors", _keeping_records)
