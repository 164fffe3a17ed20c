"""Process-group reducers: the loss scalers' "found inf" flag max-reduced over a
``torch.distributed`` group (``initialize(process_group=)`` and ``scale_loss(process_group=)``),
so every rank of a model-parallel run skips the same steps and keeps the same scale.

The reducers live on the compiled scalers (``LossScaler.set_found_inf_reducer``); this module
only builds them, remembers the group initialize gave, and drops them at interpreter exit."""
import atexit
import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from . import _C

if TYPE_CHECKING:  # torch.distributed is imported only when a process group is used
    from torch.distributed import ProcessGroup

FoundInfReducer = Callable[[torch.Tensor], None]


def check_process_group(process_group: Optional["ProcessGroup"]) -> None:
    """TypeError unless ``process_group`` is None or a torch.distributed ProcessGroup."""
    if process_group is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError("process_group must be a torch.distributed.ProcessGroup (e.g. "
                        "torch.distributed.group.WORLD) or None, got "
                        f"{type(process_group).__name__}")


def max_reducer(process_group: Optional["ProcessGroup"]) -> FoundInfReducer:
    """A found-inf reducer (see ``LossScaler.set_found_inf_reducer``) that max-reduces the
    overflow flag over ``process_group`` with ``torch.distributed.all_reduce``. The flag lives on
    the scale's device (a CUDA tensor under NCCL) and nothing is read back: the step keeps its
    one device->host copy."""
    import torch.distributed as dist

    def reduce(found_inf: torch.Tensor) -> None:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group)

    return reduce


# The process group initialize(process_group=...) gave every loss scaler (None: none).
_initialize_group: Optional["ProcessGroup"] = None


def set_process_group(process_group: Optional["ProcessGroup"], num_losses: int) -> None:
    """Called by initialize (and reset, with None): every loss scaler max-reduces its overflow
    flag over the group."""
    global _initialize_group
    _initialize_group = process_group
    if process_group is None:
        _C._release_reduced_flag()
        return
    for loss_id in range(num_losses):
        _C.loss_scaler(loss_id).set_found_inf_reducer(max_reducer(process_group))


@contextlib.contextmanager
def reducing_over(process_group: "ProcessGroup", loss_id: int) -> Iterator[None]:
    """Within the block, the scaler of ``loss_id`` max-reduces over ``process_group`` (one step
    of ``scale_loss(process_group=)``); afterwards it reduces over initialize's group again, or
    over none."""
    scaler = _C.loss_scaler(loss_id)
    scaler.set_found_inf_reducer(max_reducer(process_group))
    try:
        yield
    finally:
        scaler.set_found_inf_reducer(
            None if _initialize_group is None else max_reducer(_initialize_group))


@atexit.register
def _drop_reducers() -> None:
    """A reducer holds its process group, and the scalers live in a C++ static that outlives the
    interpreter: left there, the group (and its backend's threads) would outlive Python too,
    still running while the process tears down. Drop them while Python is fully alive."""
    global _initialize_group
    _initialize_group = None
    for loss_id in range(_C.num_loss_scalers()):
        _C.loss_scaler(loss_id).set_found_inf_reducer(None)
    # The last flag a reducer was handed stays held (not released here): a backend's worker thread
    # may still hold the finished collective that read it (gloo's run loop drops it after the
    # collective has returned), and if the flag were released now that thread's drop would be
    # the last, freeing the tensor's Python object while the interpreter shuts down: std::terminate
    # (bindings/scaler.cpp). One small tensor is left to the process's exit.
