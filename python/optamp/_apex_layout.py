"""Apex's state-dict layout: ``apex.amp.state_dict()`` wrote
``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``; ``optamp.load_state_dict``
takes it (so a run trained with Apex resumes here) by mapping it to optamp's flat layout and
naming Apex's keys in the errors (docs/loss_scaling.md)."""
import numbers
from typing import Any, Dict, Mapping, Tuple, Union

import torch

from . import _C

_ENTRIES = ("loss_scale", "unskipped")


def is_apex_layout(state: Mapping[Any, Any]) -> bool:
    """Whether ``state`` is nested as Apex wrote it (optamp's own layout is flat)."""
    return any(isinstance(v, Mapping) for v in state.values())


def _number(value: object, where: str, integral: bool) -> Union[int, float]:
    kinds = "an int" if integral else "a number"
    ok = isinstance(value, numbers.Integral if integral else numbers.Real) or (
        isinstance(value, torch.Tensor) and value.numel() == 1
        and (not integral or not value.is_floating_point()))
    if not ok or isinstance(value, bool):
        raise TypeError(f"{where} must be {kinds}, got {type(value).__name__}")
    number: Any = value  # an Integral, a Real or a one-element tensor (checked above)
    return int(number) if integral else float(number)


def _to_flat(state: Mapping[Any, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Apex's nested layout -> optamp's flat one, and for each flat entry that holds a value the
    caller wrote, the Apex key it came from (``"loss_scaler0.scale"`` ->
    ``"state_dict['loss_scaler0']['loss_scale']"``). Apex kept the scale and the count of steps
    since the last overflow ("unskipped", the growth tracker with Apex's scale_window=2000);
    the rest starts as in a fresh scaler: the full hysteresis, no skipped steps."""
    flat: Dict[str, torch.Tensor] = {}
    apex_keys: Dict[str, str] = {}
    for key, entry in state.items():
        if not isinstance(key, str) or not key.startswith("loss_scaler"):
            raise ValueError(f"state_dict in Apex's layout must hold only 'loss_scaler<i>' "
                             f"entries (as apex.amp.state_dict() writes), got {key!r}")
        if not isinstance(entry, Mapping):
            raise TypeError(f"state_dict[{key!r}] must be a mapping with 'loss_scale' and "
                            f"'unskipped' (Apex's layout), got {type(entry).__name__}")
        if set(entry) != set(_ENTRIES):
            raise ValueError(f"state_dict[{key!r}] must hold exactly 'loss_scale' and "
                             f"'unskipped' (Apex's layout), got {sorted(map(str, entry))}")
        scale = _number(entry["loss_scale"], f"state_dict[{key!r}]['loss_scale']", False)
        unskipped = _number(entry["unskipped"], f"state_dict[{key!r}]['unskipped']", True)
        index = key[len("loss_scaler"):]
        scaler = (_C.loss_scaler(int(index))
                  if index.isdigit() and int(index) < _C.num_loss_scalers() else None)
        # A fixed scale never grows, and Apex counted its steps past the window: nothing to keep.
        growth = unskipped if scaler is not None and scaler.dynamic else 0
        hysteresis = scaler.hysteresis if scaler is not None else 1
        flat[f"{key}.scale"] = torch.tensor(scale, dtype=torch.float32)
        flat[f"{key}.growth_tracker"] = torch.tensor(growth, dtype=torch.int32) \
            if -(2**31) <= growth < 2**31 else torch.tensor(growth)
        flat[f"{key}.hysteresis"] = torch.tensor(hysteresis, dtype=torch.int32)
        flat[f"{key}.skipped"] = torch.tensor(0, dtype=torch.int64)
        flat[f"{key}.floor_skips"] = torch.tensor(0, dtype=torch.int64)
        apex_keys[f"{key}.scale"] = f"state_dict[{key!r}]['loss_scale']"
        apex_keys[f"{key}.growth_tracker"] = f"state_dict[{key!r}]['unskipped']"
    return flat, apex_keys


def _with_apex_keys(message: str, apex_keys: Mapping[str, str]) -> str:
    """The core's validation error, with the flat entries it names replaced by the Apex keys
    they came from.

    Why a rewrite of the message: the range checks (the scale within the configured
    [min_loss_scale, max_loss_scale] or equal to the fixed scale, the growth count below
    growth_interval) live in the compiled core (LossScaler::check_state), which validates every
    scaler before any changes and names the flat entry it refused (``state entry
    'loss_scaler0.scale' must lie within ...``). Checking again here would be a second copy of
    those rules that could drift; the core takes no names to report instead. So the message is
    rewritten, but only by exact replacement of the entries this load built (no pattern over the
    core's wording): if that wording changes, the entry is still replaced whole, and
    test_apex_compat.py's Apex-layout error tests say so if the Apex key goes missing."""
    for flat_key, apex_key in apex_keys.items():
        message = message.replace(f"state entry '{flat_key}'", apex_key)
        message = message.replace(f"'{flat_key}'", apex_key)
    return message


def load(state: Mapping[Any, Any]) -> None:
    """Load a state dict in Apex's layout into the configured loss scalers (validated first;
    nothing changes on error). It must hold every scaler initialize configured."""
    if not _C.num_loss_scalers():
        _C.load_state_dict({})  # the "call initialize first" error
    flat, apex_keys = _to_flat(state)
    expected = [f"loss_scaler{i}" for i in range(_C.num_loss_scalers())]
    if sorted(state) != sorted(expected):
        # Apex warned and loaded what matched; a resumed loss would silently start over here.
        raise ValueError(f"state_dict (Apex's layout) must hold the {len(expected)} loss "
                         f"scaler(s) initialize configured (num_losses={len(expected)}: "
                         f"{', '.join(expected)}), got {', '.join(map(str, state))}")
    try:
        _C.load_state_dict(flat)
    except (ValueError, TypeError) as error:
        raise type(error)(_with_apex_keys(str(error), apex_keys)) from None
