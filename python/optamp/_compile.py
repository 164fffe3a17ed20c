"""torch.compile under optamp.

Dynamo traces Python; the casts happen below it, in the dispatcher, when AOTAutograd traces the
graph's ops. So a compiled graph holds the casts of the state it was traced under, and reusing it
under another state would silently change precision. What keeps that from happening:

* Regions and ``disable_casts`` are carried in the PrivateUse1 autocast dtype slot and the
  dispatch-key TLS (see docs/casting.md), both part of Dynamo's guards: entering a region makes
  Dynamo recompile (``GLOBAL_STATE changed: autocast(privateuseone)_dtype``).
* The level itself is process-wide and not guarded, so ``initialize`` and ``reset`` call
  ``torch._dynamo.reset()``: frames compiled under another level (or none) are traced again.
* AOTAutograd's cache keys a compiled artifact by the Dynamo graph, which holds no casts: an O1
  artifact was served to an O5 run (fp16 instead of bf16). While optamp casts, that cache is
  turned off; ``reset`` restores the previous setting.
"""
import sys
from typing import Optional

_saved_autograd_cache: Optional[bool] = None


def _reset_dynamo() -> None:
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing compiled yet
    if dynamo is not None:
        dynamo.reset()


def on_initialize(casting: bool) -> None:
    """Called by initialize; ``casting``: the level casts (enabled, not O0)."""
    global _saved_autograd_cache
    _reset_dynamo()
    if casting and _saved_autograd_cache is None:
        import torch._functorch.config as functorch_config

        _saved_autograd_cache = functorch_config.enable_autograd_cache
        functorch_config.enable_autograd_cache = False


def on_reset() -> None:
    """Called by reset."""
    global _saved_autograd_cache
    _reset_dynamo()
    if _saved_autograd_cache is not None:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = _saved_autograd_cache
        _saved_autograd_cache = None
