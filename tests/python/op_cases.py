"""The casting tests' cases: the op-case table shared with the C++ tests (tests/op_cases.txt,
one representative call of every lower / fp32 / promote entry of the policy table), the public
Python paths that reach other operators, and the levels and devices they run at.

A case is a callable taking an :class:`In` (the dtype and device to build inputs in) and
returning the op's (first) result.
"""
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

CASE_FILE = os.path.join(os.path.dirname(__file__), "..", "op_cases.txt")
LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}
CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]


def r(*shape, dtype=torch.float32, device="cpu"):
    return torch.rand(*shape, dtype=dtype, device=device) + 0.5


class In:
    """The inputs of one case, in dtype ``t`` on device ``d`` (tests/op_cases.txt's notation)."""

    def __init__(self, t, d):
        self.t, self.d = t, d

    def n(self, *shape):
        return torch.randn(*shape, dtype=self.t, device=self.d)

    def r(self, *shape):
        return r(*shape, dtype=self.t, device=self.d)

    def u(self, *shape):
        return torch.rand(*shape, dtype=self.t, device=self.d)

    def c(self, *shape):
        return torch.rand(*shape, dtype=self.t, device=self.d) - 0.5

    def hi(self, *shape):
        return r(*shape, device=self.d)

    def idx(self, *values):
        return torch.tensor(values, device=self.d)

    def signs(self, n=4):  # +1/-1 targets of the margin losses
        return torch.tensor([(-1.0) ** k for k in range(n)], device=self.d).to(self.t)

    def logp(self, *shape):
        return torch.log_softmax(torch.randn(*shape, device=self.d), -1).to(self.t)

    def z(self, *shape):  # complex64 whatever t is: there is no fp16/bf16 spectrum to hand over
        return torch.randn(*shape, dtype=torch.complex64, device=self.d)

    def spd(self, n):  # symmetric positive definite, made in fp32, handed over in dtype t
        m = torch.randn(n, n, device=self.d)
        return (m @ m.T + n * torch.eye(n, device=self.d)).to(self.t)


# ---- tests/op_cases.txt ----------------------------------------------------------------------

_TOKEN = re.compile(r"""\s*(?:
    (?P<name>[A-Za-z_]\w*)=                              # keyword
  | (?P<str>"[^"]*")
  | (?P<ref>\$\d+)
  | (?P<index>(?:cpu_)?i(?:32)?)\[(?P<values>[-\d,]*)\](?:\((?P<view>[\d,]+)\))?
  | (?P<kind>n|r|u|c|hi|signs|logp|z|spd)\((?P<shape>[\d,]+)\)
  | (?P<open>\[) | (?P<close>\]) | (?P<comma>,)
  | (?P<number>-?\d+(?:\.\d*)?(?:e-?\d+)?)
  | (?P<word>none|true|false|float32)
)""", re.VERBOSE)
_WORDS = {"none": None, "true": True, "false": False, "float32": torch.float32}


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def _parse(text):
    """The argument list of one row -> (positional, keyword) specs; a spec is a function of
    (In, the arguments built so far) or a list of them."""
    pos = 0

    def value():
        nonlocal pos
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"{CASE_FILE}: cannot read {text[pos:]!r}")
        pos = m.end()
        if m["open"]:
            items = []
            while True:
                close = _TOKEN.match(text, pos)
                if close and close["close"]:
                    pos = close.end()
                    return items
                if items:
                    comma = _TOKEN.match(text, pos)
                    if not (comma and comma["comma"]):
                        raise ValueError(f"{CASE_FILE}: expected ',' in {text!r}")
                    pos = comma.end()
                items.append(value())
        if m["str"]:
            return lambda In_, built, s=m["str"][1:-1]: s
        if m["ref"]:
            return lambda In_, built, k=int(m["ref"][1:]): built[k]
        if m["index"]:
            values, view = _ints(m["values"]), _ints(m["view"] or "")
            cpu = m["index"] == "cpu_i"

            pivots = m["index"].endswith("32")  # LU / LDL pivots are int32

            def index(inp, built):
                t = torch.tensor(values) if cpu else inp.idx(*values)
                t = t.int() if pivots else t
                return t.view(view) if view else t

            return index
        if m["kind"]:
            return lambda inp, built, k=m["kind"], s=_ints(m["shape"]): getattr(inp, k)(*s)
        if m["number"]:
            n = m["number"]
            number = float(n) if any(ch in n for ch in ".e") else int(n)
            return lambda inp, built: number
        if m["word"]:
            return lambda inp, built, w=_WORDS[m["word"]]: w
        raise ValueError(f"{CASE_FILE}: unexpected {m.group(0)!r} in {text!r}")

    args, kwargs = [], {}
    while text[pos:].strip():
        m = _TOKEN.match(text, pos)
        if m and m["name"]:
            pos = m.end()
            kwargs[m["name"]] = value()
        else:
            args.append(value())
    return args, kwargs


def _build(spec, inp, built):
    return [_build(s, inp, built) for s in spec] if isinstance(spec, list) else spec(inp, built)


def _case(op, arguments):
    name, _, overload = op.partition(".")
    args, kwargs = _parse(arguments)

    def run(inp):
        packet = getattr(torch.ops.aten, name)
        built = []
        for spec in args:
            built.append(_build(spec, inp, built))
        call_kwargs = {k: _build(spec, inp, built) for k, spec in kwargs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation warnings (chain_matmul)
            out = getattr(packet, overload or "default")(*built, **call_kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return run


def _load():
    tables = {"lower": {}, "fp32": {}, "promote": {}}
    results = {}
    with open(CASE_FILE) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            policy, op, result, arguments = line.split(None, 3)
            tables[policy][op] = _case(op, arguments)
            if result != "-":
                results[op] = getattr(torch, result)
    return tables, results


TABLES, RESULT = _load()  # RESULT: the cases whose result dtype is not the policy's
LOWER, FP32, PROMOTE = TABLES["lower"], TABLES["fp32"], TABLES["promote"]


def _u(fn):
    return lambda m: fn(m.r(2, 3))


# ---- public Python paths that reach a different operator than the table's case -------------
LOWER_PY = {
    "nn.Linear": lambda m: torch.nn.Linear(3, 2).to(m.d)(m.n(2, 3)),
    "nn.LSTMCell": lambda m: torch.nn.LSTMCell(3, 4).to(m.d)(m.n(2, 3))[0],
    "einsum_batched": lambda m: torch.einsum("bij,bjk->bik", m.n(2, 2, 3), m.n(2, 3, 2)),
}
FP32_PY = {
    "F.kl_div": lambda m: F.kl_div(m.r(4), m.r(4), reduction="batchmean"),
    "torch.norm": _u(torch.norm),
    "torch.std": _u(torch.std),
    "F.grid_sample": lambda m: F.grid_sample(m.r(1, 1, 3, 3), m.r(1, 2, 2, 2) - 1.0,
                                             align_corners=False),
    "interpolate_nearest": lambda m: F.interpolate(m.r(1, 1, 4, 4), scale_factor=2.0),
    "interpolate_nearest_exact_1d": lambda m: F.interpolate(m.r(1, 1, 4), size=7,
                                                            mode="nearest-exact"),
    "interpolate_bilinear": lambda m: F.interpolate(m.r(1, 1, 4, 4), size=(3, 5), mode="bilinear"),
    "interpolate_bicubic_antialias": lambda m: F.interpolate(m.r(1, 1, 4, 4), size=(2, 3),
                                                             mode="bicubic", antialias=True),
}
# The promote ops torch computes in the promoted dtype by itself (policy_table.cpp,
# kNativelyPromotingOps): optamp does not cast their inputs first. "operator*" is mul.Tensor.
NATIVE_PROMOTION = ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "eq.Tensor",
                    "ne.Tensor", "lt.Tensor", "le.Tensor", "gt.Tensor", "ge.Tensor", "cat",
                    "stack", "operator*")

PROMOTE_PY = {
    "operator*": lambda m: m.r(3) * m.hi(3),
    "F.bilinear": lambda m: F.bilinear(m.r(2, 3), m.hi(2, 4), m.hi(5, 3, 4)),
    "F.embedding_bag": lambda m: F.embedding_bag(
        m.idx(0, 1, 2, 3), m.r(5, 3), m.idx(0, 2), mode="sum", per_sample_weights=m.hi(4)),
}
