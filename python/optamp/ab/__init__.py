"""The A/B protocol between a training program and ``python -m optamp.ab`` (docs/ab_test.md).

The runner starts the program once per opt level and seed and tells it which through the
environment; the program asks for them (nothing reads the environment unless it does) and reports
what it measured, one JSON line per call::

    import optamp as amp
    model, optimizer = amp.initialize(model, optimizer, opt_level=amp.ab.opt_level("O1"))
    torch.manual_seed(amp.ab.seed(0))
    ...
    amp.ab.report(step=step, loss=loss.item())
    amp.ab.report(test_accuracy=accuracy)          # a final metric

Outside the runner (no ``OPTAMP_AB_METRICS``) :func:`report` does nothing, so the calls can stay.
In a distributed program only global rank 0 reports (:func:`reports_here`).
The C++ twin is ``optamp/ab.h`` (``amp::ab::opt_level``, ``amp::ab::seed``, ``amp::ab::report``).
"""
import atexit
import json
import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Dict, List, Optional, Union

if TYPE_CHECKING:
    import torch

    from ..precision import PrecisionReport

OPT_LEVEL_ENV = "OPTAMP_OPT_LEVEL"
SEED_ENV = "OPTAMP_SEED"
METRICS_ENV = "OPTAMP_AB_METRICS"
PRECISION_ENV = "OPTAMP_AB_PRECISION_STEPS"
LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
# Where launchers put a process's global rank: torchrun / torch.distributed.launch, Open MPI,
# MPICH and Intel MPI.
RANK_ENVS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def reports_here() -> bool:
    """Whether this process writes the run's metrics: global rank 0 of a distributed program
    (the first of ``RANK_ENVS`` that is set, else ``torch.distributed``'s rank once its default
    group exists), any process that is not one. Every rank writing into the one metrics file
    interleaved their losses and made step times of the gaps between ranks' lines."""
    for name in RANK_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value == "0"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_rank() == 0)
    return True


def opt_level(default: str = "O1") -> str:
    """``OPTAMP_OPT_LEVEL`` when it is set (one of O0..O5), else ``default``."""
    value = os.environ.get(OPT_LEVEL_ENV) or None
    if value is not None and value not in LEVELS:
        raise ValueError(f"{OPT_LEVEL_ENV} must be an opt level O0..O5, got {value!r}")
    _precision.arm()
    return value if value is not None else default


def seed(default: int = 0) -> int:
    """``OPTAMP_SEED`` when it is set (an integer >= 0), else ``default``."""
    return _env_count(SEED_ENV, "an integer", default)


def _env_count(name: str, what: str, default: int) -> int:
    """An environment variable holding an integer >= 0, else ``default`` when it is unset; any
    other value is a ValueError naming the variable (as amp::ab's in C++)."""
    value = os.environ.get(name) or None
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(f"{name} must be {what} >= 0, got {value!r}")
    return parsed


def _plain(value: Any) -> Union[int, float, bool, str, None]:
    """A JSON scalar from a number, flag, text or one-element tensor."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)  # torch.Tensor, numpy scalars
    if callable(item):
        return _plain(item())
    raise TypeError(f"optamp.ab.report: a metric must be a number, bool, str or one-element "
                    f"tensor, got {type(value).__name__}")


class Reporter:
    """Writes one JSON object a line with ``"t"``: seconds since the reporter was made (so the
    runner can time steps the program does not time itself). Thread-safe; each line is flushed.
    ``path=None`` makes a reporter that writes nothing."""

    def __init__(self, path: Optional[str]) -> None:
        self._file: Optional[IO[str]] = open(path, "a") if path else None
        self._start = time.perf_counter()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._file is not None

    def report(self, step: Optional[int] = None, loss: Any = None, **metrics: Any) -> None:
        if self._file is None:
            return
        if "t" in metrics:
            raise ValueError('optamp.ab.report: "t" is the reporter\'s own time stamp; name the '
                             "metric differently")
        line: Dict[str, Any] = {}
        if step is not None:
            line["step"] = int(step)
        if loss is not None:
            line["loss"] = _plain(loss)
        line.update((k, _plain(v)) for k, v in metrics.items())
        cuda_peak = _cuda_peak_mb()
        if cuda_peak is not None and "peak_memory_mb" not in line:
            line["cuda_peak_mb"] = cuda_peak
        self.write_line(line)
        if step is not None:
            _precision.after_step(int(step), self)

    def write_line(self, line: Dict[str, Any]) -> None:
        """One JSON object as it is, with its time stamp (on rank 0 of a distributed program)."""
        if self._file is None or not reports_here():
            return
        text = json.dumps(dict(line, t=time.perf_counter() - self._start), allow_nan=True)
        with self._lock:
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _cuda_peak_mb() -> Optional[float]:
    """The caching allocator's peak, once the program has used CUDA (no sync, no init)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return float(torch.cuda.max_memory_allocated()) / 2**20


class _PrecisionRequest:
    """The runner's --precision-steps N (OPTAMP_AB_PRECISION_STEPS): a program that asks for its
    level with opt_level() records the per-op precision report from initialize (whose models
    name the ops' modules) until it reports step N, and reports the table as one line."""

    def __init__(self) -> None:
        self.steps = 0
        self.report: Optional["PrecisionReport"] = None
        self.lock = threading.Lock()

    def arm(self) -> None:
        steps = _env_count(PRECISION_ENV, "a step count", 0)
        self.steps = steps if reports_here() else 0  # the other ranks would record for nothing

    def start(self, models: List["torch.nn.Module"]) -> None:
        """Called by initialize."""
        with self.lock:
            if self.steps <= 0 or self.report is not None:
                return
            from ..precision import precision_report

            self.report = precision_report(models, label="python -m optamp.ab --precision-steps")
            self.report.__enter__()
            atexit.register(self.finish, None)

    def after_step(self, step: int, reporter: "Reporter") -> None:
        if self.report is not None and self.report.recording and step >= self.steps:
            self.finish(reporter)

    def finish(self, reporter: Optional["Reporter"]) -> None:
        with self.lock:
            if self.report is None or not self.report.recording:
                return
            self.report.stop()
            data = self.report.to_dict()
            (reporter or _process_reporter()).write_line(
                {"type": "precision", "steps": self.steps, "table": self.report.table(),
                 "calls": data.get("calls"), "first_nonfinite": data.get("first_nonfinite")})


_precision = _PrecisionRequest()
_reporter: Optional[Reporter] = None
_reporter_lock = threading.Lock()


def reporter() -> Reporter:
    """The process's reporter: ``OPTAMP_AB_METRICS``'s file, opened at the first call."""
    return _process_reporter()


def _process_reporter() -> Reporter:
    global _reporter
    with _reporter_lock:
        if _reporter is None:
            _reporter = Reporter(os.environ.get(METRICS_ENV) or None)
        return _reporter


def report(step: Optional[int] = None, loss: Any = None, **metrics: Any) -> None:
    """Report a step (``step``, ``loss``, optionally ``step_ms``, ``loss_scale``, ``skipped``) or
    metrics (``test_accuracy=..``; with ``step=`` they belong to that step, without it they are
    final). Numbers may be one-element tensors. Does nothing outside the runner."""
    reporter().report(step=step, loss=loss, **metrics)


__all__ = ["opt_level", "seed", "report", "reporter", "reports_here", "Reporter", "OPT_LEVEL_ENV",
           "SEED_ENV", "METRICS_ENV", "RANK_ENVS"]
