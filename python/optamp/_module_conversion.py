"""A module-wide conversion (``model.to(device)``, ``model.float()``, ``model.cpu()``,
``model.to(memory_format=...)``, all through ``torch.nn.Module._apply``) after ``initialize``
leaves the model's registered tensors registered, as ``Module::to`` does in C++; so does a
parametrization registered after ``initialize`` (``register_parametrization``, with optamp's
rules off: its checks compare the parametrized tensor's dtype with the original's).

Until the ninth session of 2026-12-06 two things lost them:

* ``_apply`` stores what each conversion returns back into the module. At O2/O5 a ``to`` that
  needs no conversion hands back a copy of a registered buffer's values (and of a parameter's,
  where it names only a dtype), so that a forward's ``inv_freq.to(x.device)`` or
  ``A_log.float()`` reads fp32 rather than the working copy (docs/casting.md, "O2/O5: what ops
  see"); ``model.to(device)`` on the model's own device (Lightning and Accelerate call it) then
  replaced every registered buffer with an unregistered copy, which ops read in fp32 instead of
  as its working copy, and with ``rules_under_no_grad`` gave each parameter new storage. The
  conversions now run with optamp's rules off, so ``_apply`` gets the tensors themselves back, as
  in plain torch.
* A real conversion (another device, a memory format) makes new tensors: parameters take theirs
  through ``set_data`` and keep their identity and key, but buffers are replaced, and the new
  ones were not registered. A registered buffer now takes its converted data through
  ``set_data`` too (same dtype and tensor type only; a dtype change after ``initialize`` is not
  followed, as for parameters).
"""
import functools
from typing import Any, Callable

import torch

from . import _C
from ._compile import is_registered_buffer
from ._wrapping import Function, inside, replace, rules_off


_CONVERT = "_optamp_converts_buffers_in_place"


def _converting_registered_buffers_in_place(fn: Callable[[torch.Tensor], Any]
                                            ) -> Callable[[torch.Tensor], Any]:
    if getattr(fn, _CONVERT, False):
        return fn  # a submodule's _apply, called by its parent's with the wrapped function

    def convert(t: torch.Tensor) -> Any:
        out = fn(t)
        if (out is not t and isinstance(out, torch.Tensor) and is_registered_buffer(t)
                and out.dtype == t.dtype and torch._has_compatible_shallow_copy_type(t, out)):
            t.data = out  # set_data: optamp's hook keeps the buffer's key
            return t
        return out

    setattr(convert, _CONVERT, True)
    return convert


def _keeping_registered_tensors(apply: Function) -> Function:
    @functools.wraps(apply)
    def apply_converting_buffers_in_place(module: torch.nn.Module,
                                          fn: Callable[[torch.Tensor], Any], *args: Any,
                                          **kwargs: Any) -> Any:
        return apply(module, _converting_registered_buffers_in_place(fn), *args, **kwargs)

    return rules_off(_in_a_swap_batch(apply_converting_buffers_in_place))


def _in_a_swap_batch(function: Function) -> Function:
    """``function`` with the parameters it swaps (``torch.utils.swap_tensors``) registered anew in
    one session at its end, not one per swap (_tensor_swap.py)."""
    return inside(_C._swap_batch, function)


def install() -> None:
    """Idempotent."""
    replace(torch.nn.Module, "_apply", _keeping_registered_tensors)
    replace(torch.nn.Module, "load_state_dict", _in_a_swap_batch)
    # A parametrization registered after initialize: its consistency checks (the parametrized
    # tensor keeps the original's dtype) and right_inverse read the original as it is, the fp32
    # master, not as O2/O5's working copy, which made the check refuse every one.
    replace(torch.nn.utils.parametrize, "register_parametrization", rules_off)
