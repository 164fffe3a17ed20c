#!/usr/bin/env python
"""The fp32 list's softmaxes and loss of reduced input on their own: optamp's kernels against
torch's.

log_softmax and cross_entropy (mean, class-index targets) at GPT-2 small's logits (batch 8 x 512
tokens = 4096 rows of 50257 classes) and softmax at attention scores written out (batch 8 x 12
heads x 1024 tokens = 98304 rows of 1024 keys), per pass (forward, backward) and dtype (bf16,
fp16):
  optamp   torch.ops.optamp.widened_log_softmax / widened_softmax / fused_cross_entropy and their
           backwards (read the reduced input; the loss without log-probabilities)
  native   x.float().log_softmax(-1) (.softmax(-1); for the loss nll_loss of it), its backward
           then .to(dtype) (native autocast's fp32 rule: a widened copy first, a narrowing pass
           after the backward)
  h2f      torch._log_softmax(x, -1, half_to_float=True) (torch._softmax; for the loss nll_loss
           of it) and its backward (fp16 only: torch's own reduced-to-fp32 kernel, which Apex's
           lists get from torch for fp16 on CUDA; CUDA only)
Methods are interleaved round by round; the median per call is reported, with each method's
time over optamp's (above 1: optamp faster). Values are checked against native's (the largest
difference is printed). The training benchmarks' kernel lines say what this costs in a step; this
says which kernel to change (docs/benchmarks.md, "The softmax kernels").

    PYTHONPATH=python python benchmarks/bench_softmax_kernels.py [--device cuda|cpu]
        [--rows 4096] [--cols 50257] [--attention-rows 98304] [--keys 1024] [--reps 10]
        [--rounds 7]
"""
import argparse
import statistics
import time

import torch

import optamp  # noqa: F401  (registers torch.ops.optamp)

OPS = torch.ops.optamp


def loss_methods(dtype, device, target):
    """name -> (forward(x), backward(g, saved)) of the mean cross_entropy of `target`: forward
    returns (loss, what its backward needs), backward the gradient of the logits in `dtype`."""
    rows = target.numel()

    def pair(half_to_float):
        def forward(x):
            logp = torch._log_softmax(x if half_to_float else x.float(), -1, half_to_float)
            loss, total = torch.ops.aten.nll_loss_forward(logp, target, None, 1, -100)
            return loss, (logp, total)

        def backward(g, saved):
            logp, total = saved
            dense = torch.ops.aten.nll_loss_backward(g, logp, target, None, 1, -100, total)
            grad = torch._log_softmax_backward_data(dense, logp, -1,
                                                    dtype if half_to_float else torch.float32)
            return grad.to(dtype)
        return forward, backward

    def ours_forward(x):
        losses, stats = OPS.fused_cross_entropy(x, target, -100)
        return losses.mean(), (x, stats)

    def ours_backward(g, saved):
        x, stats = saved
        return OPS.fused_cross_entropy_backward(g.expand(rows) / rows, x, target, stats, -100)
    table = {"optamp": (ours_forward, ours_backward), "native": pair(False)}
    if dtype == torch.float16 and device.type == "cuda":
        table["h2f"] = pair(True)
    return table


def methods(kind, dtype, device):
    """name -> (forward(x), backward(g, out)) for `kind` ("log_softmax", "softmax") of `dtype`."""
    ours = getattr(OPS, f"widened_{kind}")
    ours_backward = getattr(OPS, f"widened_{kind}_backward")
    fp32 = getattr(torch, f"_{kind}")
    fp32_backward = getattr(torch, f"_{kind}_backward_data")
    table = {
        "optamp": (lambda x: ours(x, -1), lambda g, out: ours_backward(g, out, -1, dtype)),
        "native": (lambda x: fp32(x.float(), -1, False),
                   lambda g, out: fp32_backward(g, out, -1, torch.float32).to(dtype)),
    }
    if dtype == torch.float16 and device.type == "cuda":  # torch's CPU softmax has no such kernel
        table["h2f"] = (lambda x: fp32(x, -1, True),
                        lambda g, out: fp32_backward(g, out, -1, dtype))
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


def measure(kind, rows, cols, dtype, args, device):
    """Lines for one kind and dtype: each pass's median per method, and the values' largest
    difference."""
    torch.manual_seed(0)
    x = (torch.randn(rows, cols, device=device) * 4).to(dtype)
    if kind == "cross_entropy":
        g = torch.ones((), device=device)
        table = loss_methods(dtype, device, torch.randint(cols, (rows,), device=device))
        saved = {name: forward(x)[1] for name, (forward, _) in table.items()}
        out = table["native"][0](x)[0]
    else:
        g = torch.randn(rows, cols, device=device) / cols
        table = methods(kind, dtype, device)
        out = table["native"][0](x)
        saved = {name: out for name in table}
    calls = {}
    for name, (forward, backward) in table.items():
        calls[("forward", name)] = (lambda f=forward: f(x))
        calls[("backward", name)] = (lambda b=backward, s=saved[name]: b(g, s))
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
        lines.append(f"{kind} {name_of} {pass_} [{rows} x {cols}]: " + ", ".join(parts))
    ours_out = table["optamp"][0](x)
    ours_out = ours_out[0] if kind == "cross_entropy" else ours_out
    forward_diff = (ours_out - out).abs().max().item()
    backward_diff = (table["optamp"][1](g, saved["optamp"]).float() -
                     table["native"][1](g, saved["native"]).float()).abs().max().item()
    lines.append(f"{kind} {name_of} values: largest difference from native's forward "
                 f"{forward_diff:.2e}, backward {backward_diff:.2e}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=50257)
    parser.add_argument("--attention-rows", type=int, default=98304)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {where}, torch {torch.__version__}")
    shapes = {"log_softmax": (args.rows, args.cols), "cross_entropy": (args.rows, args.cols),
              "softmax": (args.attention_rows, args.keys)}
    for kind, (rows, cols) in shapes.items():
        for dtype in (torch.bfloat16, torch.float16):
            for line in measure(kind, rows, cols, dtype, args, device):
                print(line, flush=True)


if __name__ == "__main__":
    main()
