"""optamp: Apex-style opt-level mixed precision on a compiled LibTorch core.

    import optamp as amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
"""
import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _C
from ._C import OptLevel, Properties, parse_opt_level
from .scaler import load_state_dict, loss_scaler, scale_loss, state_dict

__version__ = "0.1.0"


def resolve(opt_level="O1", **overrides):
    """Return the validated :class:`Properties` for ``opt_level`` with Apex-style overrides.

    ``None`` means "not overridden", as in ``apex.amp.initialize``.
    """
    return _C.resolve(opt_level, **overrides)


__all__ = [
    "OptLevel",
    "Properties",
    "parse_opt_level",
    "resolve",
    "scale_loss",
    "loss_scaler",
    "state_dict",
    "load_state_dict",
    "__version__",
]
