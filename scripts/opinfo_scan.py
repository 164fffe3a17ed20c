"""Scan ATen's ops for calls that fail under optamp where fp32 training runs them.

For every op in torch's OpInfo database (``torch.testing._internal.common_methods_invocations``)
that supports float32 on the CPU, the first samples are called twice with grad mode on: once in
fp32, once under optamp at LEVEL. An op that runs in fp32 and fails under optamp is printed with
its error. Modes:

* ``input`` / ``arg`` (O2, O5): the sample's input / its first floating argument is a parameter
  registered by ``initialize``, which ops see as its fp16/bf16 working copy, beside the sample's
  other (fp32) tensors: what a model tensor meets beside fp32 activations.
* ``activation`` (O1, O4): the input is a reduced activation beside the sample's fp32 tensors
  (unregistered fp32 parameters at O1/O4); native autocast's verdict on the same call is printed
  beside optamp's.
* ``reduced`` (O1, O4): as ``activation``, for every sample, also those without a second
  floating tensor: ops with no fp16/bf16 kernel at all.

``--backward`` also back-propagates from the op's floating outputs, as a training step does:
ops with reduced forward kernels but a float/double-only backward show only with it.
``--no-grad`` calls the ops under ``torch.no_grad()`` (an evaluation: the no_grad gate);
``--lists=torch`` initializes with ``op_lists="torch"``. LEVEL may be O3 too.

    PYTHONPATH=python python scripts/opinfo_scan.py O2 input --backward  # under a minute, 2 cores

Found with it on 2026-12-07 (docs/results.md): matrix and nuclear norms of a working copy, a
meshgrid of one and fp32 coordinates, linalg.vecdot, out-of-place index_copy and scatter.reduce;
with ``--backward``, ``special.i1``/``i1e`` (float/double-only backward); with ``reduced``,
direct calls of ``grid_sampler_2d``/``3d`` and ``native_layer_norm``; with ``--no-grad``, 0-dim
fp32 tensors beside reduced ones in ops that do not promote (``prelu``); at O3, ``ctc_loss`` and
the margin losses. What it still prints, knowingly: ATen-internal ops users do not call
(``_softmax_backward_data``; ``_safe_softmax``, whose backward ignores its ``dtype`` argument,
so the softmax fp32 rule its kernel meets breaks it, as native CUDA autocast's would; at O3
``native_batch_norm`` and its siblings given fp32 input), sparse ops and ``to_sparse``,
``rrelu`` (no fp16 CPU kernel; its noise argument is written, so widening would lose it),
``linalg.vander``, and comparisons
(``isclose``, ``allclose``) that torch refuses across dtypes under native autocast too.
"""
import collections
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

import optamp


def _samples(op: Any) -> List[Any]:
    try:
        return list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:3]
    except Exception:  # an OpInfo whose sample generator needs what this build lacks
        return []


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _error(e: Exception) -> str:
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {text}"


BACKWARD = False  # --backward: a training step also runs the op's backward
GRAD = True  # --no-grad: an evaluation (the no_grad gate)
OPTIONS: Dict[str, Any] = {"verbosity": 0}  # --lists=torch: op_lists="torch"


def _backward(out: Any) -> None:
    """Back-propagates from every floating output that needs a gradient, as a loss would."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    losses = [o.real.float().sum() if o.is_complex() else o.float().sum()
              for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if losses:
        torch.stack(losses).sum().backward()


def _runs(call: Callable[[], Any], autocast: Optional[torch.dtype] = None) -> Optional[str]:
    """None when the call (and, with --backward, its backward) runs, else its error."""
    try:
        with torch.set_grad_enabled(GRAD):
            if autocast is None:
                out = call()
            else:
                with torch.autocast("cpu", dtype=autocast):
                    out = call()
            if BACKWARD:
                _backward(out)
        return None
    except Exception as e:  # the op's own error is the finding
        return _error(e)


def _registered_call(op: Any, sample: Any, level: Optional[str], mode: str) -> Callable[[], Any]:
    def call() -> Any:
        optamp.reset()
        args = list(sample.args)
        position = next((i for i, a in enumerate(args) if _floating(a)), None)
        target = sample.input if mode == "input" else args[position]
        holder = torch.nn.Module()
        holder.p = torch.nn.Parameter(target.detach().clone())
        if level is not None:
            optamp.initialize(holder, opt_level=level, **OPTIONS)
        if mode == "input":
            return op(holder.p, *args, **sample.kwargs)
        args[position] = holder.p
        return op(sample.input, *args, **sample.kwargs)
    return call


def scan(level: str, mode: str) -> Dict[str, str]:
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    found: Dict[str, str] = collections.OrderedDict()
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        torch.manual_seed(0)  # the samples are random: the same ones run after every change
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        for sample in _samples(op):
            if not _floating(sample.input):
                continue
            others = list(sample.args) + list(sample.kwargs.values())
            if mode == "arg" and not any(_floating(a) for a in sample.args):
                continue
            if mode in ("activation", "reduced"):
                if mode == "activation" and not any(_floating(a) for a in others):
                    continue  # a mix needs a second floating tensor
                x = sample.input.detach()
                fp32 = lambda: op(x.clone().requires_grad_(), *sample.args, **sample.kwargs)
                reduced = lambda: op(x.to(low).requires_grad_(), *sample.args, **sample.kwargs)
                if _runs(fp32) is not None:
                    continue
                optamp.reset()
                optamp.initialize(torch.nn.Linear(2, 2), opt_level=level, **OPTIONS)
                error = _runs(reduced)
                optamp.reset()
                if error is not None:
                    native = "native fails" if _runs(reduced, low) else "native runs"
                    found.setdefault(name, f"{native} | {error}")
                continue
            if _runs(_registered_call(op, sample, None, mode)) is not None:
                continue
            error = _runs(_registered_call(op, sample, level, mode))
            if error is not None:
                found.setdefault(name, error)
    optamp.reset()
    return found


def main(argv: List[str]) -> int:
    global BACKWARD, GRAD
    BACKWARD = "--backward" in argv
    GRAD = "--no-grad" not in argv
    if "--lists=torch" in argv:
        OPTIONS["op_lists"] = "torch"
    argv = [a for a in argv if not a.startswith("--")]
    level = argv[1] if len(argv) > 1 else "O2"
    mode = argv[2] if len(argv) > 2 else ("activation" if level in ("O1", "O4") else "input")
    if mode not in ("input", "arg", "activation", "reduced"):
        print("usage: opinfo_scan.py LEVEL [input|arg|activation|reduced] [--backward]"
              " [--no-grad] [--lists=torch]", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    found = scan(level, mode)
    for name, error in found.items():
        print(f"{level} {mode} | {name} | {error}")
    print(f"{len(found)} ops fail under optamp where fp32 runs them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
