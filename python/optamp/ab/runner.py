"""A/B of any training program: ``python -m optamp.ab [options] -- <command ...>``.

Runs the command once per opt level and seed (seed by seed, so a level's run and the baseline's
run of the same seed are close in time), tells it the level and seed through the environment
(OPTAMP_OPT_LEVEL, OPTAMP_SEED: the program asks for them with optamp.ab.opt_level() /
amp::ab::opt_level()), collects what it reports through optamp.ab.report / amp::ab::report
(OPTAMP_AB_METRICS names the file), measures its peak memory, and writes the report
(optamp.ab.summary: statistics, verdicts, summary.md/json, ab.png). A run that crashes, times out
or diverges is recorded as such and the others go on.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

from . import LEVELS, METRICS_ENV, OPT_LEVEL_ENV, SEED_ENV
from .plan import parse_seeds, run_name
from .summary import STEADY_SKIP, any_level_ran, read_run, write_report

PRECISION_ENV = "OPTAMP_AB_PRECISION_STEPS"
UNSUPPORTED_EXIT = 3  # the project's trainers: the level is not supported on this build/device

Run = Tuple[str, int, str, List[str]]  # level, seed, run name, extra arguments


def read_plan_file(path: str) -> List[Run]:
    """runs.tsv: level, seed, run name, then extra arguments, tab-separated."""
    runs: List[Run] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3 or fields[0] not in LEVELS or not fields[1].isdigit():
                raise ValueError(f"--plan {path}, line {number}: expected 'level<TAB>seed<TAB>"
                                 f"name[<TAB>argument...]', got {line.rstrip()!r}")
            runs.append((fields[0], int(fields[1]), fields[2], fields[3:]))
    return runs


def planned_runs(levels: Sequence[str], seeds: Sequence[int]) -> List[Run]:
    return [(lv, s, run_name(lv, s), []) for s in seeds for lv in levels]


class Metrics:
    """Follows a run's metrics file as the program writes it (for the progress line)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0
        self.step: Optional[int] = None
        self.loss: Optional[float] = None
        self.partial = ""

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except OSError:
            return
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "step" in obj and "loss" in obj:
                self.step, self.loss = obj["step"], obj["loss"]


class Progress:
    """One line per run on a terminal, rewritten in place; plain lines elsewhere."""

    def __init__(self, total: int, enabled: bool, stream: IO[str]) -> None:
        self.total, self.enabled, self.stream = total, enabled, stream
        self.tty = enabled and stream.isatty()
        self.last_plain = 0.0

    def update(self, index: int, level: str, seed: int, metrics: Metrics, start: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        text = f"[{index}/{self.total}] {level} seed {seed}: "
        text += (f"step {metrics.step}, loss {_num(metrics.loss)}" if metrics.step is not None
                 else "starting")
        text += f", {now - start:.0f} s"
        if self.tty:
            self.stream.write("\r" + text.ljust(78)[:160])
            self.stream.flush()
        elif now - self.last_plain >= 30:
            self.last_plain = now
            self.stream.write(text + "\n")
            self.stream.flush()

    def done(self, index: int, level: str, seed: int, text: str) -> None:
        if not self.enabled:
            return
        line = f"[{index}/{self.total}] {level} seed {seed}: {text}"
        self.stream.write(("\r" + line.ljust(78) if self.tty else line) + "\n")
        self.stream.flush()


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def last_line(path: str) -> str:
    """The last non-empty line of a log (progress lines end in carriage returns)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").split("\n") if ln.strip()]
    return lines[-1] if lines else ""


def wait(proc: "subprocess.Popen[bytes]", timeout: Optional[float], tick: Any) -> Tuple[
        Optional[int], float, bool]:
    """Waits for the child, calling tick() meanwhile: (exit code, peak RSS in MB, timed out).
    os.wait4 gives the child's own resource usage (its peak RSS, its children's included)."""
    start = time.monotonic()
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            code = os.waitstatus_to_exitcode(status)
            proc.returncode = code
            return code, usage.ru_maxrss / 1024.0, timed_out
        if timeout is not None and not timed_out and time.monotonic() - start > timeout:
            timed_out = True
            proc.send_signal(signal.SIGKILL)
        tick()
        time.sleep(0.2)


def run_one(command: List[str], run: Run, out: str, precision_steps: int, timeout: Optional[float],
            progress: Progress, index: int) -> Dict[str, Any]:
    level, seed, name, extra = run
    paths = {ext: os.path.join(out, name + ext) for ext in (".jsonl", ".log", ".err", ".status")}
    for path in paths.values():
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, **{OPT_LEVEL_ENV: level, SEED_ENV: str(seed),
                              METRICS_ENV: os.path.abspath(paths[".jsonl"]),
                              "OPTAMP_PROGRESS": "0"})
    env.pop(PRECISION_ENV, None)
    if precision_steps > 0:
        env[PRECISION_ENV] = str(precision_steps)
    metrics = Metrics(paths[".jsonl"])
    start = time.monotonic()
    with open(paths[".log"], "wb") as log, open(paths[".err"], "wb") as err:
        try:
            proc = subprocess.Popen(command + extra, stdout=log, stderr=err,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            status = {"status": "failed", "exit_code": 127, "message": f"cannot start: {e}",
                      "seconds": 0}
            return _finish(status, paths, progress, index, run)

        def tick() -> None:
            metrics.poll()
            progress.update(index, level, seed, metrics, start)
        code, peak_rss_mb, timed_out = wait(proc, timeout, tick)
    message = last_line(paths[".err"])
    if timed_out:
        state, message = "timeout", f"killed after {timeout:g} s"
    elif code == 0:
        state = "ok"
    elif code == UNSUPPORTED_EXIT or "NotImplementedError" in message:
        state = "unsupported"
    else:
        state = "failed"
    status = {"status": state, "exit_code": code, "message": message,
              "seconds": round(time.monotonic() - start, 1), "peak_rss_mb": peak_rss_mb,
              "opt_level": level, "seed": seed, "command": command + extra}
    return _finish(status, paths, progress, index, run)


def _finish(status: Dict[str, Any], paths: Dict[str, str], progress: Progress, index: int,
            run: Run) -> Dict[str, Any]:
    with open(paths[".status"], "w") as f:
        json.dump(status, f)
        f.write("\n")
    out, name = os.path.dirname(paths[".status"]), run[2]
    read = read_run(out, name) if status["status"] == "ok" else None
    if read is not None and read["status"] == "diverged":
        status.update(status="diverged", message=read["message"])
        with open(paths[".status"], "w") as f:
            json.dump(status, f)
            f.write("\n")
    if read is not None and read["status"] == "ok":
        s = read["summary"]
        text = (f"ok, {s.get('steps')} steps, final train loss {_num(s.get('final_train_loss'))}"
                f", median step {_num(s.get('median_step_ms'))} ms, {status['seconds']:.0f} s")
    else:
        text = f"{status['status']} (exit {status['exit_code']}): {status['message']}"
    progress.done(index, run[0], run[1], text)
    return status


def parse_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    argv = list(argv)
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        raise SystemExit("python -m optamp.ab: give the command to run after --, e.g. "
                         "python -m optamp.ab --levels O0,O1,O2 -- python train.py")
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(
        prog="python -m optamp.ab",
        description="A/B of a training program across opt levels and seeds "
                    "(docs/ab_test.md).", usage="%(prog)s [options] -- command [args ...]")
    p.add_argument("--levels", default="O0,O1,O2",
                   help="opt levels to run (default O0,O1,O2); the baseline is O0 when listed, "
                        "else the first")
    p.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2],
                   help="a count N (seeds 0..N-1) or seeds S1,S2,.. (default 3)")
    p.add_argument("--out", default="results/ab", help="report folder (default results/ab)")
    p.add_argument("--plan", default=None,
                   help="runs.tsv: level, seed, run name and extra arguments per run (the "
                        "Fashion-MNIST job's budgets); replaces --levels/--seeds")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--higher", default="", help="metrics where higher is better (names)")
    p.add_argument("--lower", default="", help="metrics where lower is better (names)")
    p.add_argument("--precision-steps", type=int, default=2,
                   help="record the per-op precision report (docs/precision.md) over the first "
                        "N <= 5 steps of each level's first seed (default 2; 0: off)")
    p.add_argument("--title", default=None, help="the report's title")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    a = p.parse_args(options)
    if not command:
        p.error("no command after --")
    levels = [lv for lv in a.levels.split(",") if lv]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        p.error(f"--levels must list opt levels O0..O5, got {a.levels!r}")
    a.levels = levels
    if a.timeout is not None and a.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {a.timeout:g}")
    if not 0 <= a.precision_steps <= STEADY_SKIP:
        # A probe slows the steps it records; the step time leaves out the first 5 anyway.
        p.error(f"--precision-steps must be 0..{STEADY_SKIP} (probed steps are slow; the median "
                f"step time leaves out the first {STEADY_SKIP}), got {a.precision_steps}")
    return a, command


def write_plan(out: str, a: argparse.Namespace, command: List[str], runs: List[Run]) -> None:
    """plan.json for the report: the Fashion-MNIST plan (--plan) gets the command and metric
    directions added; otherwise one is made from the runs."""
    path = os.path.join(out, "plan.json")
    directions = {n: True for n in a.higher.split(",") if n}
    directions.update({n: False for n in a.lower.split(",") if n})
    if a.plan and os.path.isfile(path):
        with open(path) as f:
            plan = json.load(f)
    else:
        levels = list(dict.fromkeys(r[0] for r in runs))
        base = "O0" if "O0" in levels else levels[0]
        plan = {"device": None, "mode": "steps", "baseline": base, "cpu": None,
                "seeds": sorted({r[1] for r in runs}),
                "levels": [{"level": lv, "baseline": lv == base, "slow": False, "steps": None,
                            "eval_at": [], "seeds": [r[1] for r in runs if r[0] == lv]}
                           for lv in levels]}
    plan.update(command=command, higher_is_better=directions)
    if a.title:
        plan["title"] = a.title
    with open(path, "w") as f:
        json.dump(plan, f, indent=2)
        f.write("\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a, command = parse_args(sys.argv[1:] if argv is None else argv)
    runs = read_plan_file(a.plan) if a.plan else planned_runs(a.levels, a.seeds)
    os.makedirs(a.out, exist_ok=True)
    write_plan(a.out, a, command, runs)
    progress = Progress(len(runs), not a.no_progress, sys.stderr)
    unsupported: Dict[str, Dict[str, Any]] = {}
    probed = set()
    failed = False
    t0 = time.monotonic()
    for index, run in enumerate(runs, 1):
        level = run[0]
        if level in unsupported:  # the same answer on every seed: not rerun
            with open(os.path.join(a.out, run[2] + ".status"), "w") as f:
                json.dump(dict(unsupported[level], seconds=0), f)
            continue
        steps = a.precision_steps if level not in probed else 0
        probed.add(level)
        status = run_one(command, run, a.out, steps, a.timeout, progress, index)
        if status["status"] == "unsupported":
            unsupported[level] = status
        failed |= status["status"] in ("failed", "timeout")
    summary = write_report(a.out)
    print(summary["verdict"])
    print(f"optamp.ab: {len(runs)} runs in {time.monotonic() - t0:.0f} s; report: "
          f"{os.path.join(a.out, 'summary.md')}, summary.json, ab.png")
    return 1 if failed or not any_level_ran(summary) else 0
