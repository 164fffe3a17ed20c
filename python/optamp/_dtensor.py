"""Loss scaling of sharded gradients (DTensors: FSDP2's ``fully_shard``, tensor parallelism).

optamp's unscale ops (``optamp::unscale_check_``, ``optamp::axpby_check_``) take lists of
gradients and one overflow flag. A DTensor gradient reaches DTensor's dispatcher, which knows no
sharding strategy for them ("Operator optamp.unscale_check_.default does not have a sharding
strategy registered"). These handlers run the op on each rank's local shards, as torch's
``found_inf_reduce_handler`` runs ``_amp_foreach_non_finite_check_and_unscale_`` for
``torch.amp.GradScaler``, and then max-reduce the flag over the mesh dimensions that shard or
partially hold a gradient (an all_reduce per dimension): a rank whose shard overflowed makes
every rank skip the step, and the flag stays on the device (a collective, no host read).

Installed by ``initialize`` when ``torch.distributed.tensor`` is in use (imported): DTensor's
handler table is torch's own extension point for such ops (``loss_parallel`` adds to it)."""
import sys
from typing import Any, Callable, Dict, List, Set, Tuple

import torch

from . import _C

_HANDLED = ("unscale_check_", "axpby_check_")  # the ops with a found_inf flag (multi_tensor.cpp)


def _local(arg: Any, meshes: List[Tuple[Any, Tuple[Any, ...]]]) -> Any:
    """``arg`` with every DTensor (alone or in a list) replaced by its local tensor; each one's
    mesh and placements are appended to ``meshes``."""
    from torch.distributed.tensor import DTensor

    if isinstance(arg, DTensor):
        meshes.append((arg.device_mesh, tuple(arg.placements)))
        return arg.to_local()
    if isinstance(arg, (list, tuple)):
        return type(arg)(_local(a, meshes) for a in arg)
    return arg


def _reduce_flag(found_inf: torch.Tensor, meshes: List[Tuple[Any, Tuple[Any, ...]]]) -> None:
    """Max-reduce ``found_inf`` in place over every mesh dimension that some gradient does not
    replicate (each distinct mesh once), with one all_reduce per dimension on its group."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    dims_by_mesh: Dict[int, Tuple[Any, Set[int]]] = {}
    for mesh, placements in meshes:
        _, dims = dims_by_mesh.setdefault(id(mesh), (mesh, set()))
        dims.update(d for d, p in enumerate(placements) if not isinstance(p, Replicate))
    reduced = False
    for mesh, dims in dims_by_mesh.values():
        for dim in sorted(dims):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
            reduced = True
    if reduced:
        # The backend may drop its reference to the flag on its own thread; held here, that is
        # never the last one (bindings/scaler.cpp, last_reduced_flag: an abort at exit otherwise).
        _C._hold_reduced_flag(found_inf)


def _handler(flag_index: int) -> Callable[..., None]:
    """The handler of an op whose overflow flag is its argument ``flag_index``."""
    def handle(op_call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        meshes: List[Tuple[Any, Tuple[Any, ...]]] = []
        with torch.no_grad():
            local_args = _local(args, meshes)
            local_kwargs = {k: _local(v, meshes) for k, v in kwargs.items()}
            op_call(*local_args, **local_kwargs)
            flag = (local_args[flag_index] if flag_index < len(local_args) else
                    local_kwargs["found_inf"])
            _reduce_flag(flag, meshes)

    return handle


def install() -> None:
    """Add the handlers to DTensor's table (idempotent). A no-op where torch.distributed.tensor
    has not been imported: no DTensor can reach the ops then."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for name in _HANDLED:
        op = getattr(torch.ops.optamp, name).default
        if op not in handlers:
            flag_index = [a.name for a in op._schema.arguments].index("found_inf")
            handlers[op] = _handler(flag_index)
