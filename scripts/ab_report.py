#!/usr/bin/env python3
"""Builds the A/B report of scripts/ab_test.sh from the trainers' JSON-lines metrics.

    python scripts/ab_report.py --out results/ab --levels O0,O1,O2

Reads OUT/<level>.jsonl (config, step and summary objects written by train_fashion_mnist) and
OUT/<level>.status (JSON: status ok|unsupported|failed, message, exit_code; written by
ab_test.sh), and writes OUT/summary.md, OUT/summary.json and OUT/ab.png (matplotlib, Agg).
The baseline is O0 when it ran, else the first level that ran; the table headers name it. A
level has "equal accuracy" when its test accuracy is no more than EQUAL_POINTS (1.0) percentage
points below the baseline's. A level's status message (the last line its trainer wrote to
stderr) is reported only for a level that is not ok.
"""
import argparse
import json
import math
import os
import sys

EQUAL_POINTS = 1.0
SUMMARY_FIELDS = ("test_accuracy", "peak_memory_mb", "peak_memory_kind", "median_step_ms",
                  "samples_per_s", "final_train_loss", "skipped_steps", "final_loss_scale",
                  "train_time_s", "steps", "batch_size")


def read_jsonl(path):
    config, steps, summary = {}, [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            kind = obj.get("type")
            if kind == "config":
                config = obj
            elif kind == "step":
                steps.append(obj)
            elif kind == "summary":
                summary = obj
    return config, steps, summary


def read_status(out, level):
    path = os.path.join(out, f"{level}.status")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    if os.path.isfile(os.path.join(out, f"{level}.jsonl")):
        return {"status": "ok"}
    return {"status": "missing", "message": f"no {level}.jsonl in {out}"}


def collect(out, levels):
    rows, curves, config = [], {}, {}
    for level in levels:
        status = read_status(out, level)
        row = {"level": level, "status": status.get("status", "ok")}
        if row["status"] != "ok" and status.get("message"):
            # For an ok level the last stderr line is noise (a warning, the progress line).
            row["message"] = status["message"]
        metrics = os.path.join(out, f"{level}.jsonl")
        if row["status"] == "ok":
            if not os.path.isfile(metrics):
                row.update(status="failed", message=f"no metrics file {metrics}")
            else:
                cfg, steps, summary = read_jsonl(metrics)
                if summary is None:
                    row.update(status="failed", message=f"{metrics} has no summary line")
                else:
                    config = config or cfg
                    row.update({k: summary.get(k) for k in SUMMARY_FIELDS})
                    curves[level] = steps
        rows.append(row)
    return rows, curves, config


def ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def baseline_of(rows):
    """The baseline row: O0 when it ran, else the first level that ran (None: none ran)."""
    ok = [r for r in rows if r["status"] == "ok"]
    return next((r for r in ok if r["level"] == "O0"), ok[0] if ok else None)


def add_ratios_and_verdict(rows):
    ok = [r for r in rows if r["status"] == "ok"]
    base = baseline_of(rows)
    if base is None:
        return None, "Verdict: no level ran; see the logs next to this report."
    for r in ok:
        r["step_time_ratio"] = ratio(r["median_step_ms"], base["median_step_ms"])
        r["peak_memory_ratio"] = ratio(r["peak_memory_mb"], base["peak_memory_mb"])
        acc, base_acc = r["test_accuracy"], base["test_accuracy"]
        r["accuracy_delta"] = None if acc is None or base_acc is None else acc - base_acc
        # "Equal" = no worse than the baseline by more than EQUAL_POINTS: a level that is
        # *more* accurate is not excluded for it.
        r["equal_accuracy"] = r["accuracy_delta"] is not None and \
            r["accuracy_delta"] >= -EQUAL_POINTS - 1e-9
    equal = [r for r in ok if r["equal_accuracy"] and r["median_step_ms"] is not None]
    fastest = min(equal, key=lambda r: r["median_step_ms"]) if equal else base
    dropped = [f"{r['level']} ({r['accuracy_delta']:+.2f} pts)" for r in ok
               if not r["equal_accuracy"] and r["accuracy_delta"] is not None]
    tail = f" Excluded for accuracy: {', '.join(dropped)}." if dropped else ""
    not_run = [r["level"] for r in rows if r["status"] != "ok"]
    if not_run:
        tail += f" Not run: {', '.join(not_run)}."
    if fastest is base:
        others = [r["level"] for r in ok if r is not base]
        verdict = (f"Verdict: {base['level']} (baseline) is the fastest at equal accuracy "
                   f"(no more than {EQUAL_POINTS:g} pt below {base['test_accuracy']:.2f}%)"
                   + (f"; {', '.join(others)} did not beat it." if others else
                      "; no other level ran.") + tail)
    else:
        speedup = base["median_step_ms"] / fastest["median_step_ms"]
        verdict = (f"Verdict: {fastest['level']} is the fastest at equal accuracy: "
                   f"{speedup:.2f}x faster per step than {base['level']} (test accuracy "
                   f"{fastest['test_accuracy']:.2f}% vs {base['test_accuracy']:.2f}%, no more than "
                   f"{EQUAL_POINTS:g} pt below)." + tail)
    return fastest["level"], verdict


def fmt(v, spec, suffix=""):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec) + suffix


def write_markdown(path, rows, config, verdict, plot=True):
    base = baseline_of(rows)
    vs = f"vs {base['level']}" if base is not None else "vs baseline"
    mem_kind = next((r.get("peak_memory_kind") for r in rows if r.get("peak_memory_kind")), "")
    mem_label = {"cpu_peak_rss": "peak RSS", "cuda_peak_allocated": "CUDA peak allocated"}.get(
        mem_kind, "peak memory")
    lines = [
        "# optamp A/B test: Fashion-MNIST CNN",
        "",
        f"{config.get('program', 'train_fashion_mnist')} ({config.get('language', '?')}), "
        f"device {config.get('device', '?')}, {config.get('steps', '?')} steps x batch "
        f"{config.get('batch_size', '?')}, lr {config.get('lr', '?')}, seed "
        f"{config.get('seed', '?')}, {config.get('train_images', '?')} training images, "
        f"{config.get('test_images', '?')} test images, {config.get('threads', '?')} threads, "
        f"torch {config.get('torch', '?')}.",
        "",
        f"| level | median step (ms) | step time {vs} | samples/s | "
        f"{mem_label} (MB) | memory {vs} | final train loss | test accuracy | skipped steps "
        "| final loss scale |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['level']} | {r['status']}: {r.get('message', '')} "
                         "| | | | | | | | |")
            continue
        lines.append(
            f"| {r['level']}{' (baseline)' if r is base else ''} | "
            f"{fmt(r['median_step_ms'], '.2f')} | "
            f"{fmt(r['step_time_ratio'], '.2f', 'x')} | {fmt(r['samples_per_s'], '.0f')} | "
            f"{fmt(r['peak_memory_mb'], '.1f')} | {fmt(r['peak_memory_ratio'], '.2f', 'x')} | "
            f"{fmt(r['final_train_loss'], '.4f')} | {fmt(r['test_accuracy'], '.2f', '%')} | "
            f"{r['skipped_steps']} | {fmt(r['final_loss_scale'], 'g')} |")
    lines += [
        "",
        f"**{verdict}**",
        "",
        "Step time: median over the steps after the first 5 (forward, backward, optimizer step; "
        "synchronized on CUDA); ratios are level / baseline"
        + (f" ({base['level']})" if base is not None else "") + ", so below 1x is faster. "
        "samples/s = batch size / median step time. Final train loss: mean of the last 20 "
        "finite step losses. Equal accuracy: no more than "
        f"{EQUAL_POINTS:g} percentage point below the baseline. "
        + ("Plot: ab.png." if plot else "No plot: matplotlib is not installed."),
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def moving_average(values, window):
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def write_plot(path, curves, rows, config):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {"O0": "#222222", "O1": "#1f77b4", "O2": "#d62728", "O3": "#ff7f0e",
              "O4": "#2ca02c", "O5": "#9467bd"}
    styles = {"O0": "-", "O1": "--", "O2": "-", "O3": "-.", "O4": "--", "O5": ":"}
    acc = {r["level"]: r.get("test_accuracy") for r in rows}
    fig, (ax_loss, ax_scale) = plt.subplots(
        2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, (level, steps) in enumerate(curves.items()):
        # Later levels are drawn thinner and in their own line style, so coinciding curves
        # (O0 and O1 often overlap) stay visible.
        c, ls, lw = colors.get(level), styles.get(level, "-"), max(1.2, 3.2 - 0.5 * i)
        pts = [(s["step"], s["loss"]) for s in steps if s.get("loss") is not None]
        if pts:
            xs, ys = zip(*pts)
            window = max(1, len(xs) // 25)
            ax_loss.plot(xs, ys, color=c, alpha=0.2, linewidth=0.8)
            label = f"{level}" + (f"  (test acc {acc[level]:.1f}%)" if acc.get(level) else "")
            ax_loss.plot(xs, moving_average(ys, window), color=c, linestyle=ls, linewidth=lw,
                         label=label)
        sc = [(s["step"], s["loss_scale"]) for s in steps if s.get("loss_scale") is not None]
        if sc:
            xs, ys = zip(*sc)
            ax_scale.step(xs, ys, where="post", color=c, linestyle=ls, linewidth=lw, label=level)
        skipped = [(s["step"], s["loss_scale"]) for s in steps
                   if s.get("skipped") and s.get("loss_scale") is not None]
        if skipped:
            xs, ys = zip(*skipped)
            ax_scale.scatter(xs, ys, marker="x", color=c, s=40, zorder=3,
                             label=f"{level} skipped step")
    ax_loss.set_ylabel("training loss (thin: per step, bold: moving average)")
    ax_loss.set_yscale("log")
    ax_loss.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_loss.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=10)
    ax_loss.set_title(
        f"optamp A/B: Fashion-MNIST CNN, {config.get('device', '?')}, "
        f"{config.get('steps', '?')} steps x batch {config.get('batch_size', '?')}, "
        f"seed {config.get('seed', '?')}", fontsize=12)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (x: skipped step)")
    ax_scale.set_xlabel("step")
    ax_scale.grid(True, which="both", alpha=0.3)
    ax_scale.legend(loc="best", fontsize=9, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/ab")
    p.add_argument("--levels", default="O0,O1,O2")
    args = p.parse_args(argv)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]

    rows, curves, config = collect(args.out, levels)
    fastest, verdict = add_ratios_and_verdict(rows)
    base = baseline_of(rows)
    summary = {"baseline": base["level"] if base is not None else None,
               "equal_accuracy_points": EQUAL_POINTS, "fastest_at_equal_accuracy": fastest,
               "verdict": verdict, "config": config, "levels": rows}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    try:
        write_plot(os.path.join(args.out, "ab.png"), curves, rows, config)
        plot = True
    except ImportError as e:  # e.g. the GPU machine's bare python3; the numbers are all here
        print(f"ab_report: no plot ({e}); install matplotlib (e.g. apt-get install "
              "python3-matplotlib) for ab.png", file=sys.stderr)
        plot = False
    write_markdown(os.path.join(args.out, "summary.md"), rows, config, verdict, plot)
    print(verdict)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
