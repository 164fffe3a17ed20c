#!/usr/bin/env python
"""The loss's log_softmax of reduced logits on its own: optamp's kernels against torch's.

At GPT-2 small's logits by default (batch 8 x 512 tokens = 4096 rows of 50257 classes), per pass
(forward, backward) and dtype (bf16, fp16):
  optamp   torch.ops.optamp.widened_log_softmax / _backward   (reads the reduced logits)
  native   x.float().log_softmax(-1), its backward then .to(dtype)   (native autocast's fp32 rule:
           a widened copy first, a narrowing pass after the backward)
  h2f      torch._log_softmax(x, -1, half_to_float=True) and its backward (fp16 only: torch's own
           reduced-to-fp32 kernel, which Apex's lists get from torch for fp16 on CUDA; CUDA only)
Methods are interleaved round by round; the median per call is reported, with each method's
time over optamp's (above 1: optamp faster). Values are checked against native's (the largest
difference is printed). The training benchmarks' kernel lines say what this costs in a step; this
says which kernel to change (docs/benchmarks.md, "The loss's kernels").

    PYTHONPATH=python python benchmarks/bench_loss_kernels.py [--device cuda|cpu]
        [--rows 4096] [--cols 50257] [--reps 10] [--rounds 7]
"""
import argparse
import statistics
import time

import torch

import optamp  # noqa: F401  (registers torch.ops.optamp)

OPS = torch.ops.optamp


def methods(dtype, device):
    """name -> (forward(x), backward(g, out)) for logits of `dtype` on `device`."""
    table = {
        "optamp": (lambda x: OPS.widened_log_softmax(x, -1),
                   lambda g, out: OPS.widened_log_softmax_backward(g, out, -1, dtype)),
        "native": (lambda x: x.float().log_softmax(-1),
                   lambda g, out: torch._log_softmax_backward_data(
                       g, out, -1, torch.float32).to(dtype)),
    }
    if dtype == torch.float16 and device.type == "cuda":  # torch's CPU softmax has no such kernel
        table["h2f"] = (lambda x: torch._log_softmax(x, -1, True),
                        lambda g, out: torch._log_softmax_backward_data(g, out, -1, dtype))
    return table


def time_per_call(fn, device, reps):
    """Seconds per call of fn() over `reps` calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure(dtype, args, device):
    """Lines for one dtype: each pass's median per method, and the values' largest difference."""
    torch.manual_seed(0)
    x = (torch.randn(args.rows, args.cols, device=device) * 4).to(dtype)
    g = torch.randn(args.rows, args.cols, device=device) / args.cols
    table = methods(dtype, device)
    out = table["native"][0](x)
    calls = {}
    for name, (forward, backward) in table.items():
        calls[("forward", name)] = (lambda f=forward: f(x))
        calls[("backward", name)] = (lambda b=backward: b(g, out))
    for fn in calls.values():  # warm-up: allocations, kernel loads
        fn()
    times = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, fn in calls.items():
            times[key].append(time_per_call(fn, device, args.reps))
    lines = []
    name_of = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    for pass_ in ("forward", "backward"):
        ours = statistics.median(times[(pass_, "optamp")])
        parts = [f"optamp {ours * 1e3:.3f} ms"]
        for name in table:
            if name != "optamp":
                theirs = statistics.median(times[(pass_, name)])
                parts.append(f"{name} {theirs * 1e3:.3f} ms ({theirs / ours:.2f}x)")
        lines.append(f"loss {name_of} {pass_} [{args.rows} x {args.cols}]: " + ", ".join(parts))
    forward_diff = (table["optamp"][0](x) - out).abs().max().item()
    backward_diff = (table["optamp"][1](g, out).float() -
                     table["native"][1](g, out).float()).abs().max().item()
    lines.append(f"loss {name_of} values: largest difference from native's forward "
                 f"{forward_diff:.2e}, backward {backward_diff:.2e}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=50257)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {where}, torch {torch.__version__}")
    for dtype in (torch.bfloat16, torch.float16):
        for line in measure(dtype, args, device):
            print(line, flush=True)


if __name__ == "__main__":
    main()
