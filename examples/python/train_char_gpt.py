#!/usr/bin/env python3
"""Python twin of examples/cpp/train_char_gpt.cpp: a small byte-level GPT trained on the Python
standard library's sources, bits per character on held-out stdlib files (docs/char_gpt.md).

    python examples/python/train_char_gpt.py --opt-level O2 --steps 300 [--preset tiny|gpu|test]

Same file lists, model (parameter shapes, registration and init order), batches (torch.randint
on a CPU generator seeded with the seed), schedule, flags, reports and exit codes as the C++
trainer, so the two give the same losses for the same seed on the CPU. It speaks the A/B protocol
(optamp.ab): the opt level and seed come from --opt-level/--seed, else OPTAMP_OPT_LEVEL /
OPTAMP_SEED, else O0 and 0; with OPTAMP_AB_METRICS set it writes one JSON line per optimizer step
(step, loss, step_ms, loss_scale, skipped, lr), one per evaluation (step, val_bpc) and a final one
without step (val_bpc, train_bpc, tokens_per_s, sizes, ...).
Exit status: 0 ok, 2 bad arguments, 3 the opt level is unsupported by this optamp build or
device (amp.initialize raised NotImplementedError), 1 otherwise.

Needs the optamp package (``pip install .``, or PYTHONPATH=python after an in-tree build).
"""
import argparse
import math
import os
import sys
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

import optamp as amp
import trainer_common
from trainer_common import AmpSession, Progress, RunStats  # AmpSession: the optamp integration

# Training text: these stdlib modules, concatenated in this order (about 1.7 MB). Every one exists,
# as a plain module file with its real source, in CPython 3.9 to 3.13 (none was removed or turned
# into a package or a stub: not datetime.py, pathlib.py, zipfile.py, sysconfig.py, ...).
# Keep identical to char_gpt::train_files() in examples/cpp/char_gpt.h (tested).
TRAIN_FILES = (
    "argparse.py", "ast.py", "calendar.py", "configparser.py",
    "csv.py", "dataclasses.py", "difflib.py", "doctest.py",
    "enum.py", "fractions.py", "functools.py", "heapq.py",
    "inspect.py", "logging/__init__.py", "mailbox.py", "pickle.py",
    "pprint.py", "pydoc.py", "random.py", "shutil.py",
    "statistics.py", "subprocess.py", "tarfile.py", "tempfile.py",
    "threading.py", "typing.py",
)
# Held-out text for val_bpc (about 175 KB): modules that are not in the training list.
# Keep identical to char_gpt::val_files() (tested).
VAL_FILES = (
    "textwrap.py", "shlex.py", "copy.py", "queue.py", "getopt.py", "numbers.py",
    "fnmatch.py", "glob.py", "sched.py", "optparse.py", "gettext.py",
)
VOCAB = 256  # bytes
LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
# name: d_model, n_layer, n_head, seq_len, batch_size, lr, steps, eval_bytes (as char_gpt.h)
PRESETS = {
    "tiny": dict(d_model=128, n_layer=4, n_head=4, seq_len=128, batch_size=16, lr=2e-3,
                 steps=300, eval_bytes=32768),
    "gpu": dict(d_model=512, n_layer=8, n_head=8, seq_len=256, batch_size=32, lr=6e-4,
                steps=2000, eval_bytes=0),
    "test": dict(d_model=32, n_layer=2, n_head=2, seq_len=32, batch_size=4, lr=2e-3,
                 steps=20, eval_bytes=2048),
}
EVAL_BATCH = 64  # held-out windows per forward pass


def load_text(data_dir, names):
    """The files of ``names`` under ``data_dir``, concatenated, as a 1-D uint8 tensor."""
    chunks = []
    for name in names:
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"stdlib file {name} not found in {data_dir} "
                "(--data DIR: a CPython 3.9-3.13 standard library directory)")
        with open(path, "rb") as f:
            chunks.append(f.read())
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class Attention(nn.Module):
    """Causal self-attention: one qkv projection, scaled_dot_product_attention, projection."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(C, 2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)) with a 4x GELU MLP."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, an untied head over
    the 256 byte values; registered and initialized in the C++ model's order (char_gpt.h)."""

    def __init__(self, d_model, n_layer, n_head, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.init_weights(n_layer)

    @torch.no_grad()
    def init_weights(self, n_layer):
        """GPT-2's init: matrices and embeddings N(0, 0.02), residual projections (c_proj)
        N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorms 1/0."""
        proj_std = 0.02 / math.sqrt(2.0 * n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, proj_std if "c_proj.weight" in name else 0.02)
            elif name.endswith(".bias"):
                p.zero_()

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LibTorchAdamW(torch.optim.Optimizer):
    """AdamW with LibTorch's arithmetic (torch::optim::AdamW::step), so the twins stay
    bit-identical: torch.optim.AdamW updates the first moment with lerp_, LibTorch with
    mul_(beta1).add_(grad, 1 - beta1), which rounds differently. Same hyperparameters and state
    names (step, exp_avg, exp_avg_sq) as torch.optim.AdamW; no amsgrad."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(
                    group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)
        return loss


def get_batch(data, batch, seq_len, gen, device):
    """``batch`` random windows of seq_len + 1 bytes (starts from torch.randint with ``gen``, as
    the C++ trainer's torch::randint); x = the first seq_len bytes, y = the last seq_len."""
    starts = torch.randint(0, data.shape[0] - seq_len, (batch,), generator=gen)
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)
    w = data.index_select(0, idx.flatten()).view(batch, seq_len + 1).long()
    return w[:, :seq_len].contiguous().to(device), w[:, 1:].contiguous().to(device)


def eval_starts(n, seq_len, eval_bytes):
    """Starts of the held-out windows: evenly spaced over the whole held-out text, as many as fit
    in eval_bytes (0: the whole text, windows about seq_len apart), at least one."""
    last = n - seq_len - 1
    if last < 0:
        raise ValueError("held-out text shorter than one window (--seq-len)")
    count = (n - 1) // seq_len
    if eval_bytes > 0:
        count = min(count, max(1, eval_bytes // seq_len))
    return [i * last // (count - 1) if count > 1 else 0 for i in range(count)]


@torch.no_grad()
def evaluate(model, val, starts, seq_len, device):
    """Bits per character on the held-out windows (mean cross-entropy in nats / ln 2). Eval mode
    under no_grad, where optamp does not cast (the fp32 weights). Leaves the model in train
    mode."""
    model.eval()
    nats = 0.0
    all_starts = torch.tensor(starts, dtype=torch.long)
    offsets = torch.arange(seq_len + 1)
    for i in range(0, len(starts), EVAL_BATCH):
        s = all_starts[i:i + EVAL_BATCH]
        w = val.index_select(0, (s.unsqueeze(1) + offsets).flatten()).view(-1, seq_len + 1).long()
        x = w[:, :seq_len].contiguous().to(device)
        y = w[:, 1:].contiguous().to(device)
        logits = model(x).float()
        nats += F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum").item()
    model.train()
    return nats / (len(starts) * seq_len) / math.log(2.0)


def lr_at(lr, min_lr_ratio, warmup, steps, step):
    """Linear warmup over ``warmup`` steps, then cosine decay to lr * min_lr_ratio at the last
    step; ``step`` is 0-based. The same doubles as the C++ trainer."""
    min_lr = lr * min_lr_ratio
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _int_at_least(lo):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f'takes an integer >= {lo}, got "{text}"')
        return v
    return parse


def _number(strict):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or (v <= 0 if strict else v < 0):
            raise argparse.ArgumentTypeError(
                f'takes a number {"> 0" if strict else ">= 0"}, got "{text}"')
        return v
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--opt-level", choices=LEVELS, help="default: OPTAMP_OPT_LEVEL, else O0")
    p.add_argument("--seed", type=_int_at_least(0), help="default: OPTAMP_SEED, else 0")
    p.add_argument("--preset", choices=tuple(PRESETS), help="default: tiny on cpu, gpu on cuda")
    p.add_argument("--steps", type=_int_at_least(1), help="default: the preset's")
    for flag in ("--batch-size", "--seq-len", "--d-model", "--layers", "--heads"):
        p.add_argument(flag, type=_int_at_least(1), help="default: the preset's")
    p.add_argument("--lr", type=_number(True), help="peak rate; default: the preset's")
    p.add_argument("--warmup", type=_int_at_least(0), help="default: min(100, steps / 10)")
    p.add_argument("--weight-decay", type=_number(False), default=0.1)
    p.add_argument("--eps", type=_number(True), default=1e-8,
                   help="AdamW's epsilon (O3 steps fp16 weights: use >= 1e-4)")
    p.add_argument("--clip", type=_number(False), default=1.0,
                   help="max global gradient norm; 0: no clipping")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=_int_at_least(0), default=0)
    p.add_argument("--data", help="stdlib directory; default: sysconfig's stdlib path")
    p.add_argument("--eval-every", type=_int_at_least(0),
                   help="default: steps / 4; 0: only at the end")
    p.add_argument("--eval-bytes", type=_int_at_least(0),
                   help="held-out bytes per evaluation; default: the preset's; 0: all")
    a = p.parse_args(argv)
    # The environment is read only where no flag was given; a bad value is a bad argument too.
    try:
        if a.opt_level is None:
            a.opt_level = amp.ab.opt_level("O0")
        if a.seed is None:
            a.seed = amp.ab.seed(0)
    except ValueError as e:
        p.error(str(e))
    a.preset = a.preset or ("gpu" if a.device == "cuda" else "tiny")
    cfg = dict(PRESETS[a.preset])
    for key, flag in (("batch_size", "batch_size"), ("seq_len", "seq_len"),
                      ("d_model", "d_model"), ("n_layer", "layers"), ("n_head", "heads"),
                      ("lr", "lr"), ("steps", "steps"), ("eval_bytes", "eval_bytes")):
        if getattr(a, flag) is not None:
            cfg[key] = getattr(a, flag)
    if cfg["d_model"] % cfg["n_head"]:
        p.error(f"--d-model ({cfg['d_model']}) must be a multiple of --heads ({cfg['n_head']})")
    a.cfg = cfg
    steps = cfg["steps"]
    a.warmup = min(a.warmup, steps) if a.warmup is not None else min(100, steps // 10)
    a.eval_every = a.eval_every if a.eval_every is not None else max(1, steps // 4)
    a.min_lr_ratio = 0.1
    return a


def run(args):
    c = args.cfg
    steps, batch, seq_len = c["steps"], c["batch_size"], c["seq_len"]
    device = trainer_common.setup_device(args.device, args.threads)

    data_dir = args.data or sysconfig.get_paths()["stdlib"]
    train = load_text(data_dir, TRAIN_FILES)
    val = load_text(data_dir, VAL_FILES)
    if train.shape[0] <= seq_len + 1:
        raise ValueError(f"--seq-len {seq_len} is longer than the training text")
    starts = eval_starts(val.shape[0], seq_len, c["eval_bytes"])

    torch.manual_seed(args.seed)
    model = GPT(c["d_model"], c["n_layer"], c["n_head"], seq_len).to(device)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    optimizer = LibTorchAdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=c["lr"], betas=(0.9, 0.95), eps=args.eps, weight_decay=args.weight_decay)
    session = AmpSession(model, optimizer, args.opt_level)  # raises UnsupportedOptLevel
    model, optimizer = session.model, session.optimizer

    gen = torch.Generator().manual_seed(args.seed)  # the same windows as the C++ trainer
    val_bpc = float("nan")
    model.train()
    stats = RunStats(device)
    progress = Progress(args.opt_level, steps, stats.start)
    for step in range(steps):
        x, y = get_batch(train, batch, seq_len, gen, device)
        scale = session.loss_scale()
        lr = lr_at(c["lr"], args.min_lr_ratio, args.warmup, steps, step)
        for group in optimizer.param_groups:
            group["lr"] = lr

        stats.start_step()
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        session.backward(loss)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        ms, loss_value, skipped = stats.end_step(loss, session)

        amp.ab.report(step=step + 1, loss=loss_value, step_ms=ms, loss_scale=scale,
                      skipped=skipped, lr=lr)
        progress.show(step, loss_value, scale)
        if step + 1 == steps or (args.eval_every > 0 and (step + 1) % args.eval_every == 0):
            with stats.evaluation():
                val_bpc = evaluate(model, val, starts, seq_len, device)
                amp.ab.report(step=step + 1, val_bpc=val_bpc)
    stats.finish()
    final_scale = session.loss_scale()
    session.reset()

    median_ms = stats.median_step_ms()
    train_bpc = stats.mean_recent_loss() / math.log(2.0)  # the recent loss (nats) / ln 2
    tokens_per_s = batch * seq_len / (median_ms / 1000.0)
    train_s, peak_mb, skipped_steps = stats.train_s, stats.peak_mb, stats.skipped_steps
    mem_kind = stats.memory_kind()
    amp.ab.report(val_bpc=val_bpc, train_bpc=train_bpc, tokens_per_s=tokens_per_s,
                  median_step_ms=median_ms, skipped_steps=skipped_steps,
                  final_loss_scale=final_scale, train_time_s=train_s, peak_memory_mb=peak_mb,
                  peak_memory_kind=mem_kind, opt_level=args.opt_level, seed=args.seed,
                  steps=steps, device=args.device, preset=args.preset, batch_size=batch,
                  seq_len=seq_len, d_model=c["d_model"], layers=c["n_layer"],
                  heads=c["n_head"], params=n_params, train_bytes=int(train.shape[0]),
                  val_bytes=int(val.shape[0]), eval_windows=len(starts),
                  threads=torch.get_num_threads(), language="python", torch=torch.__version__)
    print(f"summary: {args.opt_level} {args.device} {args.preset} seed {args.seed} | "
          f"val bpc {val_bpc:.4f} | train bpc {train_bpc:.4f} | median step {median_ms:.2f} ms | "
          f"{tokens_per_s:.0f} tokens/s | peak memory {peak_mb:.1f} MB ({mem_kind}) | "
          f"skipped {skipped_steps} | loss scale {final_scale:g} | {train_s:.1f} s")
    return 0


def main(argv=None):
    return trainer_common.main("train_char_gpt.py", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
