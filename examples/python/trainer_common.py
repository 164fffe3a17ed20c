"""What the two Python A/B trainers (train_fashion_mnist.py, train_char_gpt.py) share: the optamp
integration (AmpSession), the device setup, the run's bookkeeping (step times, losses, skipped
steps, the training's own time and peak memory), the progress line and main()'s exit statuses.
The C++ trainers share the same in examples/cpp/trainer_common.h.

A trainer imports it as a sibling module: a script's own directory is on sys.path when it runs.
(The tests load a trainer with tests/python/common_utils.py's load_script, which loads this
module first, under this name.)
"""
import contextlib
import math
import os
import statistics
import sys
import time

import torch

import optamp as amp


# ---- optamp integration: the only code in the trainers that touches the amp API, besides the ---
# amp.ab calls of the A/B protocol. Everything else is an ordinary PyTorch training loop.
class UnsupportedOptLevel(Exception):
    """amp.initialize raised NotImplementedError: the level is unsupported by this build or
    device. main() turns it into exit status 3 (not a RuntimeError, so it is not caught as 1)."""


class AmpSession:
    """initialize / scale_loss / loss-scaler queries, in one place."""

    def __init__(self, model, optimizer, opt_level):
        # initialize prints one line (verbosity 1, the default); the scaler logs each skipped
        # step on stderr. The A/B logs keep Apex's full report, printed here once.
        try:
            self.model, self.optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
        except NotImplementedError as e:
            raise UnsupportedOptLevel(f"opt level {opt_level} unsupported: {e}") from e
        print(amp.properties().describe(), end="", flush=True)

    def backward(self, loss):
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()

    def loss_scale(self):
        return float(amp.loss_scaler(0).loss_scale())

    def last_step_skipped(self):
        return bool(amp.loss_scaler(0).last_step_skipped)

    def reset(self):
        amp.reset()


# ---- end of optamp integration --------------------------------------------------------------


def setup_device(name, threads):
    """--threads and --device: the device to train on. A CUDA device torch cannot see is an
    error rather than a silent CPU run, which an A/B comparison would mislabel."""
    if threads > 0:
        torch.set_num_threads(threads)
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mb(device):
    """CPU: peak RSS; CUDA: the caching allocator's peak allocated bytes."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def fmt_duration(s):
    t = max(0, round(s))
    return f"{t // 60}:{t % 60:02d}"


class RunStats:
    """The run's bookkeeping. Mid-training evaluations (evaluation()) are left out of the
    training time and of the peak memory, so both describe training alone: the peak is that of
    each training stretch. Creating it starts the clock and the first stretch's peak."""

    def __init__(self, device):
        self.device = device
        self.step_ms, self.losses, self.skipped_steps = [], [], 0
        self.eval_s, self.peak_mb, self.train_s = 0.0, 0.0, 0.0
        self.start = self._t0 = time.perf_counter()
        reset_peak_memory(device)

    def start_step(self):
        self._t0 = time.perf_counter()

    def end_step(self, loss, session):
        """Ends the step begun by start_step; (ms, loss, skipped). It waits for the device, so
        the time is the step's own and not the launch's."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - self._t0) * 1000.0
        loss_value = loss.item()
        skipped = session.last_step_skipped()
        self.skipped_steps += skipped
        self.step_ms.append(ms)
        self.losses.append(loss_value)
        return ms, loss_value, skipped

    @contextlib.contextmanager
    def evaluation(self):
        e0 = time.perf_counter()
        self.peak_mb = max(self.peak_mb, peak_memory_mb(self.device))
        yield
        reset_peak_memory(self.device)
        self.eval_s += time.perf_counter() - e0

    def finish(self):
        """After the last step: the training time and the last stretch's peak."""
        self.train_s = time.perf_counter() - self.start - self.eval_s
        self.peak_mb = max(self.peak_mb, peak_memory_mb(self.device))

    def memory_kind(self):
        return "cuda_peak_allocated" if self.device.type == "cuda" else "cpu_peak_rss"

    def median_step_ms(self):
        """Steady state: the first 5 steps (allocator and kernel warm-up) are left out when there
        are more than 10."""
        steady = self.step_ms[5:] if len(self.step_ms) > 10 else self.step_ms
        return statistics.median(steady) if steady else float("nan")

    def mean_recent_loss(self):
        """The mean of the last (up to) 20 finite losses: one step's loss is too noisy to
        compare."""
        tail = [v for v in reversed(self.losses) if math.isfinite(v)][:20]
        return sum(tail) / len(tail) if tail else float("nan")


class Progress:
    """The stderr progress line with rate and ETA, at most 5 times a second and at the last step.
    Only on a terminal, unless OPTAMP_PROGRESS=1/0 forces it (ab_test.sh: 1 when its stderr is a
    TTY)."""

    def __init__(self, opt_level, total, start):
        force = os.environ.get("OPTAMP_PROGRESS", "")
        self.tty = force == "1" if force else sys.stderr.isatty()
        self.opt_level, self.total = opt_level, total
        self.start = self.last = start

    def show(self, step, loss_value, scale):
        """After step ``step`` (0-based)."""
        now = time.perf_counter()
        if not self.tty or not (now - self.last > 0.2 or step + 1 == self.total):
            return
        self.last = now
        rate = (step + 1) / (now - self.start)
        sys.stderr.write(f"\r[{self.opt_level}] step {step + 1}/{self.total}  loss {loss_value:.4f}"
                         f"  scale {scale:g}  {rate:.1f} it/s  "
                         f"ETA {fmt_duration((self.total - step - 1) / rate)}   ")
        if step + 1 == self.total:
            sys.stderr.write("\n")


def main(program, parse_args, run, argv=None):
    """main() of a trainer. Exit status: 2 for bad arguments (argparse exits), 3 when ``run``
    raises UnsupportedOptLevel, 1 for the errors a user can act on (a missing file, a bad size,
    no CUDA device), else run's."""
    args = parse_args(argv)
    try:
        return run(args)
    except UnsupportedOptLevel as e:
        print(f"{program}: {e}", file=sys.stderr)
        return 3
    except (OSError, ValueError, RuntimeError) as e:
        print(f"{program}: {e}", file=sys.stderr)
        return 1
