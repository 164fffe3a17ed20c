#!/usr/bin/env python
"""Unscale + non-finite check over ResNet-50-shaped gradients (161 tensors, 25.56M elements).

Compares, per dtype:
  optamp  torch.ops.optamp.unscale_check_          (our fused multi-tensor kernel)
  torch   torch._amp_foreach_non_finite_check_and_unscale_  (what GradScaler.unscale_ runs)
  naive   a per-tensor loop: isfinite().all() check + mul_ (two passes per tensor)

Methods are interleaved round by round and the median is reported, which keeps a busy shared
machine from favouring whichever ran first. Two kinds of step per dtype: a dynamic scale (1/scale
alternates 0.5 / 2.0 so values stay put) and a fixed scale of 1.0, the pass every O0/O3/O4/O5
step runs since fixed scales check for overflow too (overflow_check).

On CUDA it also counts, per loss-scaling step over the same gradients, the kernel launches
(torch.profiler, memcpy/memset included) and the device->host syncs (CUDA sync debug mode) of
  optamp  LossScaler.unscale + update   (what amp::scale_loss runs when the guard exits)
  torch   GradScaler.unscale_ + step + update   (with an optimizer whose step does nothing)

On the CPU, --isa caps the instruction set optamp's kernels use (OPTAMP_CPU_ISA: scalar, avx2,
avx512; default: the widest the CPU runs), and the first line says which path ran, next to the
CPU's vector extensions, torch's CPU capability and the instruction set of torch's unscale loop
(AVX2 on AVX-512 CPUs too: torch 2.11 has no AVX-512 variant of that kernel).
benchmarks/unscale_model.py models both loops on CPUs not at hand.

    PYTHONPATH=python python benchmarks/bench_unscale.py [--device cpu|cuda] [--reps 30]
                                                         [--isa scalar|avx2|avx512] [--threads N]
"""
import argparse
import ctypes
import os
import platform
import statistics
import sys
import time

import torch

if "--isa" in sys.argv:  # read by optamp's first kernel call: set before anything runs
    os.environ["OPTAMP_CPU_ISA"] = sys.argv[sys.argv.index("--isa") + 1]

import optamp  # noqa: E402,F401  (registers torch.ops.optamp)


def resnet50_shapes():
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def naive(grads, found, inv):
    for g in grads:
        found += (~torch.isfinite(g).all()).float()
        g.mul_(inv)


class _NoOpOptimizer(torch.optim.Optimizer):
    """GradScaler.step needs an optimizer; this one's step launches nothing."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def _count_per_step(step, reps=5):
    """(kernel launches, device->host syncs) per call of ``step``, averaged over ``reps``."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up: lazily created state, first-call allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(reps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / reps
    return kernels, syncs


def launches_and_syncs(shapes, dtype, dev):
    """Per-step kernel launches and syncs: optamp's scaler vs torch.amp.GradScaler."""
    from optamp import _C

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(dtype).to(dev) for s in shapes]
    _C.reset_loss_scalers()
    _C.configure_loss_scalers(optamp.resolve("O1", verbosity=0))
    scaler = _C.loss_scaler(0)
    scaler.to(dev)

    def optamp_step():
        scaler.unscale(grads)
        scaler.update()

    params = [torch.zeros(s, dtype=dtype, device=dev, requires_grad=True) for s in shapes]
    noop = _NoOpOptimizer(params)
    grad_scaler = torch.amp.GradScaler("cuda")
    grad_scaler.scale(torch.ones((), device=dev))  # creates its scale tensor

    def torch_step():
        for p, g in zip(params, grads):
            p.grad = g
        grad_scaler.unscale_(noop)
        grad_scaler.step(noop)
        grad_scaler.update()

    try:
        return {"optamp": _count_per_step(optamp_step), "torch": _count_per_step(torch_step)}
    finally:
        _C.reset_loss_scalers()


# torch's DispatchStub slot for the AVX-512 variant of its CPU unscale kernel.
_TORCH_UNSCALE_AVX512_SLOT = (
    "_ZN2at6native12DispatchStubIPFvN3c108ArrayRefINS_6TensorEEERS4_RKS4_ENS0_72_amp_foreach_"
    "non_finite_check_and_unscale_cpu_stub_DECLARE_DISPATCH_typeEE6AVX512E")


def torch_unscale_kernel():
    """The instruction set of the loop torch's CPU unscale runs: torch's CPU capability, except
    where the kernel has no AVX-512 variant (torch 2.11 registers none: REGISTER_DISPATCH leaves
    the slot empty) and DispatchStub falls back to AVX2."""
    cap = torch.backends.cpu.get_cpu_capability()
    if not cap.startswith("AVX512"):
        return cap
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        slot = ctypes.c_void_p.in_dll(lib, _TORCH_UNSCALE_AVX512_SLOT).value
    except (OSError, ValueError):
        return cap + " (unverified)"
    return cap if slot else "AVX2"


def cpu_line():
    """The CPU, its vector extensions and the path optamp's CPU kernels take (ops/cpu/cpu_isa.cpp
    picks it the same way: AVX-512F, else AVX2+FMA+F16C, else scalar, capped by OPTAMP_CPU_ISA)."""
    flags, model, family = set(), platform.processor(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and not model:
                    model = value
                if key in ("cpu family", "model"):  # tell CPU generations of one brand apart
                    family.setdefault(key, value)
                if key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    order = ["scalar", "avx2", "avx512"]
    best = ("avx512" if {"avx512f", "avx2", "fma", "f16c"} <= flags
            else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar")
    cap = os.environ.get("OPTAMP_CPU_ISA", "").lower() or best
    path = order[min(order.index(cap), order.index(best))]
    shown = [f for f in ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                         "amx_bf16", "amx_tile") if f in flags]
    generation = " ".join(f"{k} {v}" for k, v in family.items())
    return (f"cpu={model or 'unknown'} [{generation}] ({' '.join(shown) or 'no AVX2/AVX-512'}) "
            f"torch capability={torch.backends.cpu.get_cpu_capability()} "
            f"torch unscale kernel={torch_unscale_kernel()} optamp path={path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--isa", choices=["scalar", "avx2", "avx512"],
                    help="cap optamp's CPU instruction set (sets OPTAMP_CPU_ISA)")
    ap.add_argument("--threads", type=int,
                    help="torch.set_num_threads (both kernels; 1 is steadier on a loaded machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = resnet50_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"device={dev} threads={torch.get_num_threads()} tensors={len(shapes)} "
          f"elements={numel / 1e6:.2f}M torch={torch.__version__}")
    if dev.type == "cpu":
        print(cpu_line())
    methods = {
        "optamp": torch.ops.optamp.unscale_check_,
        "torch": torch._amp_foreach_non_finite_check_and_unscale_,
        "naive": naive,
    }
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(s, generator=gen).to(dtype).to(dev) for s in shapes]
        for label, scales in (("dynamic", (0.5, 2.0)), ("fixed 1.0", (1.0,))):
            med, best = time_methods(methods, grads, scales, args.reps, dev, sync)
            gbps = numel * grads[0].element_size() * 2 / (med["optamp"] * 1e-3) / 1e9
            print(f"{str(dtype):15s} {label:9s} optamp {med['optamp']:8.2f} ms  torch "
                  f"{med['torch']:8.2f} ms  naive {med['naive']:8.2f} ms   optamp/torch "
                  f"{med['optamp'] / med['torch']:.2f}x  naive/torch "
                  f"{med['naive'] / med['torch']:.2f}x  optamp {gbps:.1f} GB/s")
            print(f"{'':25s} min: optamp {best['optamp']:8.2f} ms  torch {best['torch']:8.2f} ms  "
                  f"optamp/torch {best['optamp'] / best['torch']:.2f}x")
        if dev.type == "cuda":
            counts = launches_and_syncs(shapes, dtype, dev)
            print(f"{'':15s} per step: " + "  ".join(
                f"{name} {k:.0f} launches, {n:.0f} syncs" for name, (k, n) in counts.items()))


def time_methods(methods, grads, scales, reps, dev, sync):
    """Median and minimum milliseconds per call of each method, interleaved round by round."""
    found = torch.zeros(1, device=dev)
    invs = [torch.full((1,), v, device=dev) for v in scales]
    times = {k: [] for k in methods}
    for rep in range(reps + 3):
        for name, fn in methods.items():
            for inv in invs:
                sync()
                t0 = time.perf_counter()
                fn(grads, found, inv)
                sync()
                if rep >= 3:
                    times[name].append(time.perf_counter() - t0)
    assert found.item() == 0.0
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = {k: min(v) * 1e3 for k, v in times.items()}  # least disturbed by other load
    return med, best


if __name__ == "__main__":
    main()
