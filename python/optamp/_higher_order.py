"""Higher-order operators (``torch.cond``, ``flex_attention``, ``invoke_subgraph``, ...) under
optamp's dispatch keys.

A higher-order operator (HOP) is dispatched in Python, key by key, and fails with "could not find
kernel for HigherOrderOperator ... at dispatch key AutocastPrivateUse1" at a key it has no rule
for. torch makes every HOP fall through its own autocast keys (``AutocastCPU``/``CUDA``/``XPU``,
``torch/_ops.py``): the HOP itself is not cast, the ops inside its subgraphs are, when they run or
are traced under the same thread state. optamp's keys (``AutocastPrivateUse1`` casts,
``AutocastXLA`` finds O2/O5's working copies) were on no such list, so every HOP failed while
optamp was initialized: ``torch.cond`` (eager and compiled), ``flex_attention``, and
``torch.compiler.nested_compile_region`` (``invoke_subgraph``) in a compiled model.

:func:`install` gives every HOP a rule at the casting key that runs it under the state of its
call: where optamp's rules apply at the call, they apply inside it too (``lift_no_grad_gate``),
else it runs as it would without the rule. The subgraph's ops are then cast by optamp's kernels as
any other op, as torch's are by its autocast. The gate needs lifting because HOPs run their
subgraphs inside an ``autograd.Function``'s forward, under no_grad, where optamp's
no_grad gate (docs/casting.md) casts nothing, and trace the same subgraph for the backward with
grad mode on, where it casts: under inductor, a ``nested_compile_region``'s compiled forward
returned bf16 data its caller read as fp32 (outputs of 1e34). The working-copy key falls
through. HOPs defined after ``import optamp`` (a user's own) fall through both keys, as they do
torch's (torch's default list gets optamp's keys). A HOP that already has a rule of its own for
one of the keys keeps it.

``flex_attention`` gets the one rule torch gives it under its own autocast
(``torch/_higher_order_ops/flex_attention.py``): query, key and value go to the low dtype where
optamp's "lower" category applies (as ``scaled_dot_product_attention``: O1-O5 and regions, not
under the no_grad gate), then the op runs with the casting key excluded, so the score and mask
functions run on what they are given, as they do under ``torch.autocast``. Without it a query
left fp32 (by an fp32-list op, a rotary embedding) beside a key from a cast linear ran the whole
attention in fp32.
"""
from typing import Any, Callable, Dict, Tuple

import torch
import torch._ops

from . import _C
from .functions import cast_floating



def _dispatch_key(name: str) -> Any:
    """The dispatcher's key by its C++ name (AutocastXLA has no name in torch's Python enum)."""
    key = torch._C._parse_dispatch_key(name)
    assert key is not None, name
    return key


CAST_KEY = _dispatch_key("AutocastPrivateUse1")  # csrc/core/dispatch/carried_state.h
SUBSTITUTE_KEY = _dispatch_key("AutocastXLA")
_KEYS = (CAST_KEY, SUBSTITUTE_KEY)
_INSTALLED = "_optamp_rules_given"


def _below_cast_key(hop: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The HOP's kernel at the next key, as if it fell through the casting key."""
    keys = torch._ops._compute_keyset(args, kwargs, hop.non_fallthrough_keys.remove(CAST_KEY))
    return hop.dispatch(keys.highestPriorityTypeId(), *args, **kwargs)


def _same_state_rule(hop: Any) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if _C.is_casting_enabled():
            with _C.lift_no_grad_gate():
                return _below_cast_key(hop, args, kwargs)
        return _below_cast_key(hop, args, kwargs)

    return run


def _give_rules(hop: Any, cast_rule: Callable[[Any], Callable[..., Any]]) -> None:
    if getattr(hop, _INSTALLED, False):
        return
    if CAST_KEY not in hop.py_kernels:
        hop.py_impl(CAST_KEY)(cast_rule(hop))
    if SUBSTITUTE_KEY not in hop.py_kernels:
        hop.fallthrough(SUBSTITUTE_KEY)
    setattr(hop, _INSTALLED, True)


def _flex_attention_rule(hop: Any) -> Callable[..., Tuple[torch.Tensor, ...]]:
    def cast_then_run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      score_mod: Callable[..., Any], block_mask: Tuple[Any, ...], scale: float,
                      kernel_options: Any, score_mod_other_buffers: Tuple[Any, ...] = (),
                      mask_mod_other_buffers: Tuple[Any, ...] = ()) -> Tuple[torch.Tensor, ...]:
        rules, low = _C.cast_rules_now(query.device.type)
        if low is not None and _C.policy_applies(_C.CastPolicy.LOWER, rules):
            query, key, value = (cast_floating(t, low) for t in (query, key, value))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(CAST_KEY)):
            out: Tuple[torch.Tensor, ...] = hop(query, key, value, score_mod, block_mask, scale,
                                                kernel_options, score_mod_other_buffers,
                                                mask_mod_other_buffers)
            return out

    return cast_then_run


def install() -> None:
    """Idempotent; called at import."""
    defaults = torch._ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS
    for key in _KEYS:
        if key not in defaults:
            defaults.append(key)
    flex_attention: Any = None
    try:  # defines the HOP; torch imports it with torch.nn.attention
        from torch._higher_order_ops.flex_attention import flex_attention
    except ImportError:  # a torch without flex attention
        pass
    for hop in list(torch._ops._higher_order_ops.values()):
        _give_rules(hop, _flex_attention_rule if hop is flex_attention else _same_state_rule)
