"""Statistics of the A/B report (optamp.ab.summary): paired comparisons against a measured
noise floor, and loss-trajectory divergence. Pure functions on plain lists; no numpy needed.

The rule (RULE below, also printed in every report):
  Paired design: for each seed both the level and the baseline ran (same seed: same initial
  weights and data order), d = level - baseline. m = mean of d over the n seeds; its 95%
  interval is m +- t(0.975, n-1) * sd(d) / sqrt(n). The noise floor f is the baseline's own
  seed-to-seed standard deviation of the metric at the same budget. A level is "better" or
  "worse" when the interval excludes 0 (the difference is systematic, not seed luck) AND |m| > f
  (it is larger than what changing the seed does to the baseline); otherwise "indistinguishable".
  With fewer than 2 paired seeds, or fewer than 2 baseline seeds, there is no interval or floor:
  "n/a". Step time is compared the same way on ln(time) (its floor: the baseline's seed-to-seed
  sd of ln(median step time)), as "faster" / "slower" / "indistinguishable".
"""
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

RULE = ("paired by seed: d = level - baseline; m = mean(d), 95% interval m +- t(0.975, n-1) "
        "sd(d)/sqrt(n); noise floor f = the baseline's seed-to-seed standard deviation at the "
        "same budget. 'better'/'worse' (step time: 'faster'/'slower', on ln(time)) when the "
        "interval excludes 0 and |m| > f, else 'indistinguishable'; 'n/a' with fewer than 2 "
        "paired or baseline seeds")

# Two-sided 95% quantiles of Student's t, t(0.975, df), df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """t(0.975, df); beyond the table, the Cornish-Fisher expansion around z = 1.96."""
    if df < 1:
        raise ValueError(f"t975: degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def sample_sd(values: Sequence[float]) -> Optional[float]:
    """Sample standard deviation (n - 1); None below 2 values."""
    if len(values) < 2:
        return None
    m = mean(values)
    assert m is not None  # len(values) >= 2
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean_interval(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, half-width of its 95% t interval); the half-width is None below 2 values."""
    if not values:
        return None, None
    sd = sample_sd(values)
    half = None if sd is None else t975(len(values) - 1) * sd / math.sqrt(len(values))
    return mean(values), half


def classify(mean_diff: Optional[float], half_width: Optional[float], floor: Optional[float],
             higher_is_better: bool = True,
             words: Tuple[str, str] = ("better", "worse")) -> str:
    """The verdict of RULE for one metric."""
    if mean_diff is None or half_width is None or floor is None:
        return "n/a"
    excludes_zero = mean_diff - half_width > 0 or mean_diff + half_width < 0
    if not excludes_zero or abs(mean_diff) <= floor:
        return "indistinguishable"
    good = mean_diff > 0 if higher_is_better else mean_diff < 0
    return words[0] if good else words[1]


def paired(level: Mapping[int, Optional[float]], base: Mapping[int, Optional[float]],
           floor: Optional[float], higher_is_better: bool = True, log: bool = False,
           words: Tuple[str, str] = ("better", "worse")) -> Dict[str, Any]:
    """Compares a level with the baseline over the seeds both have.

    level, base: {seed: value}. floor: the baseline's seed-to-seed sd (on ln(value) when
    log=True). Returns a dict: n, seeds, diffs, mean_diff, ci95 [lo, hi], floor, verdict; with
    log=True the diffs are ln(level / base) and ratio / ratio_ci95 give them back as ratios.
    """
    lv = {s: v for s, v in level.items() if v is not None}
    bv = {s: v for s, v in base.items() if v is not None}
    seeds = sorted(s for s in lv if s in bv)
    if log:
        diffs = [math.log(lv[s] / bv[s]) for s in seeds]
    else:
        diffs = [lv[s] - bv[s] for s in seeds]
    m, half = mean_interval(diffs)
    out: Dict[str, Any] = {
        "n": len(seeds), "seeds": seeds, "diffs": diffs, "mean_diff": m,
        "ci95": None if m is None or half is None else [m - half, m + half], "floor": floor,
        "verdict": classify(m, half, floor, higher_is_better, words)}
    if log and m is not None:
        out["ratio"] = math.exp(m)
        out["ratio_ci95"] = None if half is None else [math.exp(m - half), math.exp(m + half)]
    return out


def noise_floor(base: Mapping[int, Optional[float]], log: bool = False) -> Optional[float]:
    """The baseline's seed-to-seed sd ({seed: value}; on ln(value) when log=True)."""
    values = [v for v in base.values() if v is not None]
    return sample_sd([math.log(v) for v in values] if log else values)


# ---- loss trajectories ------------------------------------------------------------------------
def smoothing_window(steps: int) -> int:
    """The moving-average window for a curve of `steps` steps: 1/20 of the run, at least 5."""
    return max(5, steps // 20)


def smooth(losses: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    """Trailing moving average over the finite values among the last `window` steps; a step
    with no finite value in its window repeats the previous average (None before the first)."""
    finite = [v if v is not None and math.isfinite(v) else None for v in losses]
    out: List[Optional[float]] = []
    prev: Optional[float] = None
    total, count = 0.0, 0
    for i, v in enumerate(finite):
        if v is not None:
            total, count = total + v, count + 1
        if i >= window:
            old = finite[i - window]
            if old is not None:
                total, count = total - old, count - 1
        prev = total / count if count else prev
        out.append(prev)
    return out


def curve_distance(a: Sequence[Optional[float]], b: Sequence[Optional[float]],
                   steps: int) -> Optional[float]:
    """Mean absolute difference of two per-step loss curves (lists, step 1 first) smoothed over
    smoothing_window(steps), over their first `steps` steps."""
    window = smoothing_window(steps)
    sa, sb = smooth(a[:steps], window), smooth(b[:steps], window)
    diffs = [abs(x - y) for x, y in zip(sa, sb) if x is not None and y is not None]
    return mean(diffs)


def divergence(level_curves: Mapping[int, Sequence[Optional[float]]],
               base_curves: Mapping[int, Sequence[Optional[float]]],
               steps: int) -> Dict[str, Any]:
    """Loss-trajectory divergence of a level from the baseline, and the baseline's own
    seed-to-seed distance, over the first `steps` steps.

    level_curves, base_curves: {seed: [loss per step]}. Returns a dict: per_seed {seed:
    distance to the baseline's curve of the same seed}, mean, floor (mean distance between the
    baseline's curves of two different seeds; None with fewer than 2 baseline seeds) and ratio
    (mean / floor: below 1, the level stays closer to the baseline than a change of seed does).
    """
    per_seed = {s: curve_distance(c, base_curves[s], steps)
                for s, c in level_curves.items() if s in base_curves}
    seeds = sorted(base_curves)
    pairs = [curve_distance(base_curves[a], base_curves[b], steps)
             for i, a in enumerate(seeds) for b in seeds[i + 1:]]
    floor = mean([p for p in pairs if p is not None]) if pairs else None
    m = mean([v for v in per_seed.values() if v is not None])
    ratio = m / floor if m is not None and floor else None
    return {"per_seed": per_seed, "mean": m, "floor": floor, "ratio": ratio}
