"""optamp: Apex-style opt-level mixed precision on a compiled LibTorch core.

    import optamp as amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Casting is per thread: initialize turns it on for the calling thread (see docs/python.md).
"""
import warnings
from typing import Any, Union

import torch  # loads libtorch before the extension that links it

from ._torch_check import load_core

load_core()  # checks the torch release first: a clear ImportError instead of a symbol error
from . import _C
from ._C import (
    CastPolicy,
    LossScaler,
    OptLevel,
    Properties,
    ThreadState,
    autocast,
    cache_size,
    cast_count,
    clear_cache,
    disable_casts,
    is_casting_enabled,
    is_initialized,
    parse_opt_level,
    policy_report,
    policy_rows,
    PolicyList,
    RuleSet,
    cast_rules_now,
    policy_applies,
    lift_no_grad_gate,
    thread_state_guard,
)
from .frontend import ModelCast, initialize, keep_in_fp32, master_params, properties, reset
from .functions import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_float_op,
    register_half_function,
    register_half_op,
    register_promote_function,
    register_promote_op,
)
from .scaler import load_state_dict, loss_scaler, scale_loss, state_dict
from .precision import compare_with_fp32, precision_report
from . import (_autocast_flag, _averaging, _checkpoint, _custom_functions, _data_loading,
               _higher_order, _module_conversion, _native_regions, _pipelining, _tensor_swap, ab)


def rules_under_no_grad() -> lift_no_grad_gate:
    """Deprecated: renamed ``optamp.lift_no_grad_gate`` (``rules_under_no_grad`` is the option)."""
    warnings.warn(
        "optamp.rules_under_no_grad() is renamed optamp.lift_no_grad_gate(); "
        "rules_under_no_grad is the name of the process-wide option",
        DeprecationWarning,
        stacklevel=2,
    )
    return lift_no_grad_gate()


_checkpoint.install()  # forward and recompute of torch.utils.checkpoint under the same rules
_custom_functions.install()  # a custom autograd.Function's forward: the rules of its call
_autocast_flag.install()  # torch._C._is_any_autocast_enabled(): True only where ops are cast
_native_regions.install()  # torch.autocast(..., enabled=False): optamp's rules off inside
_higher_order.install()  # torch.cond, flex_attention, ...: run under the optamp state of their call
_pipelining.install()  # pipeline stages: the same dtypes with grad mode on or off
_averaging.install()  # local SGD's model averaging writes the fp32 masters at O2/O5
_data_loading.install()  # a DataLoader's batches are fetched without optamp's rules, any process
_module_conversion.install()  # model.to()/.float() hand the registered tensors back, as plain torch
_tensor_swap.install()  # swap_tensors (conversions, loads under the swap flag) keeps the records

from ._build_info import version as __version__  # set once: project() in CMakeLists.txt


def resolve(opt_level: Union[str, OptLevel] = "O1", **overrides: Any) -> Properties:
    """Return the validated :class:`Properties` for ``opt_level`` with Apex-style overrides.

    ``None`` means "not overridden", as in ``apex.amp.initialize``.
    """
    return _C.resolve(opt_level, **overrides)


__all__ = [
    "CastPolicy",
    "ab",
    "LossScaler",
    "OptLevel",
    "Properties",
    "ThreadState",
    "autocast",
    "cache_size",
    "cast_count",
    "clear_cache",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "is_casting_enabled",
    "is_initialized",
    "keep_in_fp32",
    "load_state_dict",
    "loss_scaler",
    "master_params",
    "parse_opt_level",
    "policy_report",
    "policy_rows",
    "precision_report", "compare_with_fp32",
    "promote_function",
    "properties",
    "register_float_function",
    "register_float_op",
    "register_half_function",
    "register_half_op",
    "register_promote_function",
    "register_promote_op",
    "reset",
    "resolve",
    "PolicyList",
    "RuleSet",
    "cast_rules_now",
    "policy_applies",
    "lift_no_grad_gate",
    "ModelCast",
    "rules_under_no_grad",
    "scale_loss",
    "state_dict",
    "thread_state_guard",
    "__version__",
]
