"""``torch._C._is_any_autocast_enabled()`` that tells the truth under optamp.

torch answers it from the dispatch-key TLS: autocast is "on" for a device when its autocast key
is not excluded. optamp's casting key is such a key (AutocastPrivateUse1), and it stays on where
optamp casts nothing (inside ``disable_casts`` / ``autocast(enabled=False)``, under the no_grad
gate), so torch's answer was True there. Two torch code paths read it:

* ``nn.RNNBase.check_input`` skips its input/weight dtype check when it is True (autocast will
  cast both): a bf16 LSTM fed fp32 input then failed deep in oneDNN instead of raising torch's
  ``ValueError``. optamp casts whole RNN layers wherever its rules apply (as native autocast and
  Apex do), so "True" must mean "the rules apply now".
* AOTAutograd (and Inductor) run a compiled graph under ``torch._C._DisableAutocast`` when it was
  True at compile time: the traced graph already holds the casts. That stays so where optamp
  casts; where it does not, the graph holds no casts and nothing needs disabling.

The replacement answers: native autocast is on for a device, or optamp's rules apply to ops on
this thread now (``optamp.is_casting_enabled()``). Dynamo folds it to a constant while tracing,
as it folds torch's own; optamp's state is part of Dynamo's guards (see ``_compile``).

The function carries Dynamo's constant-result mark without calling
``torch.compiler.assume_constant_result``: that call imports ``torch._dynamo``, which took 1.7 s of
``import optamp``'s 4.1 s on a 2-core EPYC, for every program, compiled or not. The mark is the one
attribute the decorator sets (torch 2.11 ``torch/_dynamo/decorators.py``);
``tests/python/test_apex_compat.py`` holds the two to each other and compiles code that reads the
flag with ``torch._dynamo`` imported before and after optamp.
"""
from typing import Callable, Optional

import torch

from . import _C

_torch_version: Optional[Callable[[], bool]] = None


def _is_any_autocast_enabled() -> bool:
    return _C._is_any_autocast_enabled()


# What torch.compiler.assume_constant_result(_is_any_autocast_enabled) would do (see above).
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"
setattr(_is_any_autocast_enabled, DYNAMO_CONSTANT_MARK, True)


def install() -> None:
    global _torch_version
    if _torch_version is None:
        _torch_version = torch._C._is_any_autocast_enabled
        torch._C._is_any_autocast_enabled = _is_any_autocast_enabled


def uninstall() -> None:
    """Back to torch's own (tests)."""
    global _torch_version
    if _torch_version is not None:
        torch._C._is_any_autocast_enabled = _torch_version
        _torch_version = None
