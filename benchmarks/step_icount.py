#!/usr/bin/env python
"""Host instructions per training step, Python front: the twin of dispatch_icount's gpt_step.

A GPT-2-shaped model at tiny sizes (vocab 64, seq 8, 2 layers or STEP_ICOUNT_LAYERS, d_model 8,
2 heads, batch 1) on the CPU, so small that its kernels cost almost nothing (at d_model 32 the CPU's fp16 matmuls were
two thirds of a step's instructions: work a GPU does on the device), so what is counted is the
host work a GPU step pays too: Python, dispatch, casting, loss scaling, autograd, the optimizer.
One step is zero_grad, forward + loss, loss scaling, backward and a fused AdamW step (which
skips on the device).

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
"""
import gc
import operator
import os
import sys

import torch
import torch.nn.functional as F

from bench_models import GPT  # a sibling module: the script's directory is on sys.path

MODES = ("fp32", "native_fp16", "native_bf16", "O1", "O2", "O4", "O5")
# dispatch_icount's gpt_step sizes; STEP_ICOUNT_LAYERS=12 for GPT-2 small's depth (148 parameters)
SIZES = dict(vocab=64, seq=8, layers=int(os.environ.get("STEP_ICOUNT_LAYERS", "2")), d_model=8,
             heads=2)
BATCH = 1


def make_step(mode):
    torch.manual_seed(0)
    model = GPT(**SIZES).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(SIZES["vocab"], (BATCH, SIZES["seq"]))

    def loss_of(m):
        return F.cross_entropy(m(tokens).view(-1, SIZES["vocab"]).float(), tokens.view(-1))

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


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: step_icount.py <{'|'.join(MODES)}> <n>")
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
