#!/usr/bin/env python
"""Host instructions per training step, Python front: the twin of dispatch_icount's gpt_step.

A GPT-2-shaped model at tiny sizes (vocab 64, seq 16, 2 layers, d_model 32, 2 heads, batch 2) on
the CPU, where kernels cost almost nothing, so what is counted is the host work a GPU step pays
too: Python, dispatch, casting, loss scaling, autograd, the optimizer. One step is zero_grad,
forward + loss, loss scaling, backward and a fused AdamW step (which skips on the device).

  fp32          no amp
  native_fp16   torch.autocast(float16) around forward + loss, torch.amp.GradScaler
  native_bf16   torch.autocast(bfloat16) around forward + loss, torch.amp.GradScaler
  O1 O2 O4 O5   optamp.initialize(model, opt, opt_level=...) + optamp.scale_loss

Run under callgrind; the n measured steps run inside one C builtin of the interpreter (map()),
the only function collected, with the cyclic garbage collector off (its passes land on whichever
step allocates past its threshold), so per step = the program's total / n, without start-up:

  valgrind --tool=callgrind --collect-atstart=no --toggle-collect=map_next \\
      python benchmarks/step_icount.py O2 5

(benchmarks/step_icount.sh does that for every mode.)
"""
import gc
import sys

import torch
import torch.nn.functional as F

from bench_models import GPT  # a sibling module: the script's directory is on sys.path

MODES = ("fp32", "native_fp16", "native_bf16", "O1", "O2", "O4", "O5")
SIZES = dict(vocab=64, seq=16, layers=2, d_model=32, heads=2)


def make_step(mode):
    torch.manual_seed(0)
    model = GPT(**SIZES).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(SIZES["vocab"], (2, SIZES["seq"]))

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
    torch.set_num_threads(1)
    step = make_step(sys.argv[1])
    for _ in range(5):  # first-use allocations, lazy initialization, caches
        step()

    def run(_):
        for _ in range(n):
            step()

    gc.collect()
    gc.disable()
    list(map(run, [0]))


if __name__ == "__main__":
    main()
