#!/usr/bin/env python3
"""Python twin of examples/cpp/train_fashion_mnist.cpp: same CNN, flags, metrics and exit codes.

    python examples/python/train_fashion_mnist.py --opt-level O2 --steps 200 --metrics o2.jsonl

A program of python -m optamp.ab's protocol (docs/ab_test.md): without --opt-level / --seed it
takes OPTAMP_OPT_LEVEL / OPTAMP_SEED (else O0 / 0), and reports through optamp.ab to --metrics
FILE, or else to the runner's OPTAMP_AB_METRICS file.
Metrics file (JSON lines, each with "t": seconds since the first): a "config" object, one "step" object per step (step, loss,
loss_scale, skipped, step_ms), an "eval" object (step, test_accuracy, test_loss) for each
--eval-at step and a final "summary" object (test_accuracy, test_loss, peak_memory_mb,
median_step_ms, samples_per_s, final_train_loss, skipped_steps, final_loss_scale, ...).
--eval-at evaluates mid-training without changing the training (eval mode, no grad), so a
100-step run's result equals the eval at step 100 of a longer run with the same seed.
--save-weights FILE writes the trained parameters and buffers (torch.save of the state dict).
Exit status: 0 ok, 2 bad arguments, 3 the opt level is unsupported by this optamp build or
device (amp.initialize raised NotImplementedError), 1 otherwise.

Needs the optamp package (``pip install .``, or PYTHONPATH=python after an in-tree build).
"""
import argparse
import gzip
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import optamp as amp
import trainer_common
from trainer_common import AmpSession, Progress, RunStats  # AmpSession: the optamp integration

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530
LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
EVAL_BATCH = 250  # as the C++ trainer: half the time of 1000-image batches on a CPU


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def missing_data_message(path):
    return (f"Fashion-MNIST data not found: {path}\n"
            "  It comes from the Debian package `dataset-fashion-mnist`; install it with\n"
            "    sudo apt-get install dataset-fashion-mnist\n"
            f"  (files land in {DEFAULT_DATA}), or pass --data DIR with the four *-ubyte.gz files.")


def read_idx_u8(path, limit=0):
    """An IDX file of unsigned bytes (gzip-compressed) as a uint8 array, first `limit` items."""
    if not os.path.isfile(path):
        raise FileNotFoundError(missing_data_message(path))
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08" or data[3] == 0:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * d:8 + 4 * d], "big") for d in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != math.prod(shape):
        raise ValueError(f"{path}: size does not match its IDX header")
    arr = arr.reshape(shape)
    return arr[:limit] if limit > 0 else arr


def load(data_dir, train, limit=0):
    prefix = os.path.join(data_dir, "train" if train else "t10k")
    images = torch.from_numpy(read_idx_u8(prefix + "-images-idx3-ubyte.gz", limit).copy())
    labels = torch.from_numpy(read_idx_u8(prefix + "-labels-idx1-ubyte.gz", limit).astype(np.int64))
    if images.shape[1:] != (28, 28) or images.shape[0] != labels.shape[0]:
        raise ValueError(f"{prefix}: images and labels do not match (expected N x 28 x 28)")
    return images, labels


def to_input(images_u8, device):
    return images_u8.to(device).unsqueeze(1).float().div_(255.0).sub_(MEAN).div_(STD)


def step_list(text):
    """argparse type: "100,400" -> [100, 400] (sorted, unique, every step >= 1)."""
    try:
        steps = sorted({int(v) for v in text.split(",")})
    except ValueError:
        steps = [0]
    if not steps or steps[0] < 1:
        raise argparse.ArgumentTypeError(
            f'takes step numbers >= 1 separated by commas, got "{text}"')
    return steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--opt-level", default=None, choices=LEVELS,
                   help="default: OPTAMP_OPT_LEVEL (python -m optamp.ab), else O0")
    p.add_argument("--steps", type=int, default=0, help="0: use --epochs")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"),
                   help="cosine: lr * (1 + cos(pi * step / steps)) / 2")
    p.add_argument("--seed", type=int, default=None,
                   help="default: OPTAMP_SEED (python -m optamp.ab), else 0")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--subset", type=int, default=0, help="first N training images (0: all)")
    p.add_argument("--test-subset", type=int, default=0, help="first N test images (0: all)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--metrics", default="")
    p.add_argument("--eval-at", type=step_list, default=[],
                   help="also evaluate the test set after these steps (S1,S2,..)")
    p.add_argument("--save-weights", default="", help="write the trained state dict here")
    a = p.parse_args(argv)
    if a.steps < 0 or a.epochs < 1 or a.batch_size < 1 or a.subset < 0 or a.test_subset < 0 \
            or not a.lr > 0:
        p.error("--steps >= 0, --epochs >= 1, --batch-size >= 1, --lr > 0")
    # Under python -m optamp.ab the level and seed come from the environment, unless given here.
    a.opt_level = a.opt_level or amp.ab.opt_level("O0")
    a.seed = amp.ab.seed(0) if a.seed is None else a.seed
    return a


def lr_at(args, step, total):
    """The learning rate of step `step` (0-based) of `total`: constant, or cosine decay to 0 (for
    --epochs runs to convergence; a constant rate keeps a short run the prefix of a longer one).
    """
    if args.lr_schedule == "constant":
        return args.lr
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))


def evaluate(model, test_x, test_y, device):
    """Test-set pass: eval mode, no grad (optamp's no_grad gate: the model's own fp32 weights,
    no casts), batches of EVAL_BATCH. Returns (accuracy %, mean cross-entropy) and leaves the model in
    train mode again, so it can run mid-training."""
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for i in range(0, test_x.shape[0], EVAL_BATCH):
            logits = model(to_input(test_x[i:i + EVAL_BATCH], device)).float().cpu()
            y = test_y[i:i + EVAL_BATCH]
            correct += int(logits.argmax(1).eq(y).sum())
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
    model.train()
    n = test_x.shape[0]
    return 100.0 * correct / n, loss_sum / n


def run(args):
    device = trainer_common.setup_device(args.device, args.threads)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True

    train_x, train_y = load(args.data, True, args.subset)
    test_x, test_y = load(args.data, False, args.test_subset)
    n_train = train_x.shape[0]
    batch = min(args.batch_size, n_train)
    per_epoch = n_train // batch  # the last partial batch is dropped
    total = args.steps if args.steps > 0 else args.epochs * per_epoch
    if args.eval_at and args.eval_at[-1] > total:
        raise ValueError(f"--eval-at {args.eval_at[-1]} is after the run's last step {total}")

    torch.manual_seed(args.seed)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    session = AmpSession(model, optimizer, args.opt_level)  # raises UnsupportedOptLevel
    model, optimizer = session.model, session.optimizer

    # --metrics FILE, else the runner's file (OPTAMP_AB_METRICS; none: nothing is written).
    if args.metrics:
        open(args.metrics, "w").close()
    reporter = amp.ab.Reporter(args.metrics) if args.metrics else amp.ab.reporter()

    def emit(obj):
        reporter.report(**obj)

    emit({"type": "config", "program": "train_fashion_mnist.py", "language": "python",
          "opt_level": args.opt_level, "device": args.device, "steps": total,
          "batch_size": batch, "lr": args.lr, "lr_schedule": args.lr_schedule,
          "seed": args.seed, "train_images": n_train,
          "test_images": int(test_x.shape[0]), "threads": torch.get_num_threads(),
          "torch": torch.__version__, "optamp": amp.__version__})

    shuffle = torch.Generator().manual_seed(args.seed)  # same permutations as the C++ trainer
    pending_evals = list(args.eval_at)
    order = None
    model.train()
    stats = RunStats(device)
    progress = Progress(args.opt_level, total, stats.start)
    for step in range(total):
        pos = step % per_epoch
        if pos == 0:
            order = torch.randperm(n_train, generator=shuffle)
        idx = order[pos * batch:(pos + 1) * batch]
        x = to_input(train_x.index_select(0, idx), device)
        y = train_y.index_select(0, idx).to(device)
        scale = session.loss_scale()

        if args.lr_schedule != "constant":
            for group in optimizer.param_groups:
                group["lr"] = lr_at(args, step, total)
        stats.start_step()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        session.backward(loss)
        optimizer.step()
        ms, loss_value, skipped = stats.end_step(loss, session)

        emit({"type": "step", "step": step + 1, "loss": loss_value, "loss_scale": scale,
              "skipped": skipped, "step_ms": ms})
        progress.show(step, loss_value, scale)
        if pending_evals and pending_evals[0] == step + 1 and step + 1 < total:
            with stats.evaluation():
                acc, test_loss = evaluate(model, test_x, test_y, device)
                emit({"type": "eval", "step": step + 1, "test_accuracy": acc,
                      "test_loss": test_loss})
            pending_evals.pop(0)
    stats.finish()
    final_scale = session.loss_scale()

    accuracy, test_loss = evaluate(model, test_x, test_y, device)
    if pending_evals:  # --eval-at named the last step
        emit({"type": "eval", "step": total, "test_accuracy": accuracy, "test_loss": test_loss})
    if args.save_weights:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
                   args.save_weights)
    session.reset()

    median_ms, final_loss = stats.median_step_ms(), stats.mean_recent_loss()
    samples_per_s = batch / (median_ms / 1000.0)
    train_s, peak_mb, skipped_steps = stats.train_s, stats.peak_mb, stats.skipped_steps
    mem_kind = stats.memory_kind()
    summary = {"type": "summary", "opt_level": args.opt_level, "device": args.device,
               "steps": total, "batch_size": batch, "test_accuracy": accuracy,
               "test_loss": test_loss, "peak_memory_mb": peak_mb, "peak_memory_kind": mem_kind,
               "median_step_ms": median_ms, "samples_per_s": samples_per_s,
               "final_train_loss": final_loss, "skipped_steps": skipped_steps,
               "final_loss_scale": final_scale, "train_time_s": train_s}
    emit(summary)
    if args.metrics:
        reporter.close()
    print(f"summary: {args.opt_level} {args.device} | test accuracy {accuracy:.2f}% "
          f"(loss {test_loss:.4f}) | "
          f"median step {median_ms:.2f} ms | {samples_per_s:.0f} samples/s | peak memory "
          f"{peak_mb:.1f} MB ({mem_kind}) | final train loss {final_loss:.4f} | "
          f"skipped {skipped_steps} | loss scale {final_scale:g} | {train_s:.1f} s")
    return 0


def main(argv=None):
    return trainer_common.main("train_fashion_mnist.py", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
