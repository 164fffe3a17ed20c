#!/usr/bin/env python
"""Host instructions per training step, Python front: the twin of dispatch_icount's gpt_step.

A GPT-2-shaped model at tiny sizes (vocab 64, seq 8, 2 layers or STEP_ICOUNT_LAYERS, d_model 8,
2 heads, batch 1) on the CPU, so small that its kernels cost almost nothing (at d_model 32 the CPU's fp16 matmuls were
two thirds of a step's instructions: work a GPU does on the device), so what is counted is the
host work a GPU step pays too: Python, dispatch, casting, loss scaling, autograd, the optimizer.
One step is zero_grad, forward + loss, loss scaling, backward and a fused AdamW step (which
skips on the device). STEP_ICOUNT_MODEL=resnet50 counts ResNet-50's layout instead (the same
53 convolutions, batch norms and 161 parameters at width 2, two 32 x 32 images, 10 classes) with
a fused SGD with momentum: dispatch_icount's resnet_step.

  fp32          no amp
  native_fp16   torch.autocast(float16) around forward + loss, torch.amp.GradScaler
  native_bf16   torch.autocast(bfloat16) around forward + loss, torch.amp.GradScaler
  O1 O2 O4 O5   optamp.initialize(model, opt, opt_level=...) + optamp.scale_loss

Run under callgrind; the n measured steps run inside one C builtin of the interpreter,
operator.call() (its C function `_operator_call`), the only function collected, with the cyclic
garbage collector off (its passes land on whichever step allocates past its threshold), so per
step = the program's total / n, without start-up:

  valgrind --tool=callgrind --collect-atstart=no --toggle-collect=_operator_call \\
      python benchmarks/step_icount.py O2 5

The builtin must be one that nothing calls before the steps: map() was used until 2026-11-26, and
torch's and Python's start-up code iterate map objects too (importlib among them), so every
"per step" figure then carried about 37M instructions of imports (native fp16: 60.6M reported,
23.3M measured). operator.call (Python >= 3.11) appears in neither.

(benchmarks/step_icount.sh does that for every mode.)

An instruction count hardly sees what a GPU step pays per kernel launch (on the CPU a cast of its
own costs about its share of a batch), so the same step also counts launches:

  python benchmarks/step_icount.py --launches O2 native_fp16 ...

prints, per mode, the operators of one step (after warm-up) that would each launch device work:
the leaves of torch.profiler's operator tree, a multi-tensor (_foreach_*, _fused_*) or optamp
operator counted once with what it calls (on a GPU one launch, or a few, where the CPU loops over
its tensors), allocations (empty*) and operators that only make views or read metadata left out;
split into the backward (under the autograd engine), the optimizer step and the rest (forward,
loss, scaling). optamp's gradient conversions are made a bucket at a time there, as on a GPU
(on the CPU each is made on its own by default: no launch to save).
"""
import gc
import operator
import os
import sys

import torch
import torch.nn.functional as F

from bench_models import GPT, ResNet  # sibling module: the script's directory is on sys.path

MODES = ("fp32", "native_fp16", "native_bf16", "O1", "O2", "O4", "O5")
# dispatch_icount's gpt_step sizes; STEP_ICOUNT_LAYERS=12 for GPT-2 small's depth (148 parameters)
SIZES = dict(vocab=64, seq=8, layers=int(os.environ.get("STEP_ICOUNT_LAYERS", "2")), d_model=8,
             heads=2)
BATCH = 1
# STEP_ICOUNT_MODEL=resnet50: ResNet-50's layout (53 convolutions and batch norms, 161 parameters)
# at width 2 on 2 x 3 x 32 x 32 images (the last stage's batch norms see 1 x 1 maps: train mode
# needs two samples), stepped by SGD with momentum, fused (skips on the device): the optimizer of
# bench_train.py's resnet50_fused run, without its weight decay (dispatch_icount's is the same).
MODEL = os.environ.get("STEP_ICOUNT_MODEL", "gpt2")
RESNET_SIZES = dict(blocks=(3, 4, 6, 3), width=2, classes=10)
RESNET_BATCH = 2


def make_model(model_name):
    """The model, its optimizer and its loss (a function of the model)."""
    if model_name == "resnet50":
        model = ResNet(**RESNET_SIZES).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        images = torch.randn(RESNET_BATCH, 3, 32, 32)
        labels = torch.randint(RESNET_SIZES["classes"], (RESNET_BATCH,))
        return model, opt, lambda m: F.cross_entropy(m(images).float(), labels)
    if model_name != "gpt2":
        sys.exit(f"step_icount.py: STEP_ICOUNT_MODEL is gpt2 or resnet50, not {model_name!r}")
    model = GPT(**SIZES).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(SIZES["vocab"], (BATCH, SIZES["seq"]))
    return model, opt, lambda m: F.cross_entropy(m(tokens).view(-1, SIZES["vocab"]).float(),
                                                 tokens.view(-1))


def make_step(mode, model_name=None):
    torch.manual_seed(0)
    model, opt, loss_of = make_model(model_name or MODEL)

    if mode == "fp32":
        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model).backward()
            opt.step()
        return step
    if mode.startswith("native"):
        dtype = torch.float16 if mode == "native_fp16" else torch.bfloat16
        scaler = torch.amp.GradScaler("cpu")

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(model)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return step
    import optamp

    model, opt = optamp.initialize(model, opt, opt_level=mode, verbosity=0)

    def step():
        opt.zero_grad(set_to_none=True)
        with optamp.scale_loss(loss_of(model), opt) as scaled:
            scaled.backward()
        opt.step()
    return step


# Operators that make no device work of their own: allocations, views, metadata.
NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::view",
    "aten::_reshape_alias", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
    "aten::detach", "aten::alias", "aten::lift_fresh", "aten::resize_", "aten::_unsafe_view",
    "aten::unflatten", "aten::split", "aten::chunk", "aten::narrow", "aten::expand_as",
    "aten::view_as", "aten::split_with_sizes", "aten::unbind", "aten::numpy_T", "aten::result_type",
    "aten::set_", "aten::is_nonzero", "aten::size", "aten::stride", "aten::resolve_conj",
    "aten::resolve_neg", "aten::to", "aten::contiguous", "aten::_has_compatible_shallow_copy_type",
}


def _is_batched(name):
    return name.startswith(("aten::_foreach_", "aten::_fused_", "aten::_amp_", "optamp::"))


def count_launches(step):
    """Per part of one step: the operators that would each launch device work (docstring)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    counts = {"forward, loss, scaling": 0, "backward": 0, "optimizer step": 0}

    def part_of(event):
        while event is not None:
            if event.name.startswith("autograd::engine::evaluate_function"):
                return "backward"
            if event.name.startswith("Optimizer.step"):
                return "optimizer step"
            event = event.cpu_parent
        return "forward, loss, scaling"

    def batched_above(event):
        parent = event.cpu_parent
        while parent is not None:
            if _is_batched(parent.name):
                return True
            parent = parent.cpu_parent
        return False

    for e in prof.events():
        if not e.name.startswith(("aten::", "optamp::")) or e.name in NO_LAUNCH or batched_above(e):
            continue
        ops_below = [c for c in e.cpu_children if c.name.startswith(("aten::", "optamp::"))]
        if _is_batched(e.name) or all(c.name in NO_LAUNCH for c in ops_below):
            counts[part_of(e)] += 1
    return counts


def print_launches(modes):
    torch.set_num_threads(1)
    for mode in modes:
        if mode not in ("fp32", "native_fp16", "native_bf16"):
            import optamp
            optamp.reset()  # one initialize per process otherwise
            optamp._C._set_gradient_buckets_on_cpu(True)  # what a GPU's step does
        step = make_step(mode)
        for _ in range(5):
            step()
        counts = count_launches(step)
        parts = ", ".join(f"{k} {v}" for k, v in counts.items())
        print(f"{mode}: {sum(counts.values())} launches per step ({parts})", flush=True)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--launches" and set(sys.argv[2:]) <= set(MODES):
        return print_launches(sys.argv[2:])
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: step_icount.py <{'|'.join(MODES)}> <n>\n"
                 f"       step_icount.py --launches <mode> [<mode> ...]")
    n = int(sys.argv[2])
    if not hasattr(operator, "call"):
        sys.exit("step_icount.py needs Python >= 3.11 (operator.call marks the measured steps)")
    torch.set_num_threads(1)
    step = make_step(sys.argv[1])
    for _ in range(5):  # first-use allocations, lazy initialization, caches
        step()

    def run(_):
        for _ in range(n):
            step()

    gc.collect()
    gc.disable()
    operator.call(run, 0)


if __name__ == "__main__":
    main()
