"""What several test modules share (fixtures are in conftest.py, the casting cases in
op_cases.py): small models, a quiet initialize, the tolerance table of tests/tolerances.txt,
the names of a tensor's autograd graph, where the A/B trainers are, and load_script (a script of examples/ or benchmarks/ as a module,
without editing sys.path)."""
import importlib.util
import os
import sys

import pytest
import torch

import optamp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# ---- models ----------------------------------------------------------------------------------


class TinyNet(torch.nn.Module):
    """conv -> batch-norm -> relu -> linear: exercises lower ops, batch-norm and a loss."""

    def __init__(self, bn=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(2) if bn else torch.nn.Identity()
        self.fc = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class Mlp(torch.nn.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def init(model, optimizer=None, opt_level="O1", **kw):
    kw.setdefault("verbosity", 0)
    return optamp.initialize(model, optimizer, opt_level=opt_level, **kw)


def two_steps(make, step, level, backend=None, lr=0.1, fullgraph=False, **init_kw):
    """Losses and gradients of two SGD steps of a seeded ``make()`` initialized at ``level``
    (``init_kw``: initialize's overrides), eager (``backend`` None) or compiled with ``backend``;
    ``step(run, gen)`` makes a step's loss from the model (or its compiled form) and a seeded
    generator. Resets optamp afterwards."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    init(model, opt, level, **init_kw)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    gen = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)  # each step's gradients are new tensors
        loss = step(run, gen)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        steps.append((loss.detach(), [p.grad for p in model.parameters()]))
        opt.step()
    optamp.reset()
    return steps


# ---- tolerances (tests/tolerances.txt, read by the C++ tests too) ----------------------------


def _load_tolerances():
    table = {}
    with open(os.path.join(ROOT, "tests", "tolerances.txt")) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and not parts[0].startswith("#"):
                table[parts[0]] = {"rtol": float(parts[1]), "atol": float(parts[2])}
    return table


TOLERANCES = _load_tolerances()
_DTYPE_ROWS = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def tol(key):
    """torch.testing.assert_close kwargs for a dtype or a row name such as "train_float16"."""
    return dict(TOLERANCES[_DTYPE_ROWS.get(key, key) if not isinstance(key, str) else key])


def train_row(level):
    """The tolerance row of a training run at ``level`` against fp32."""
    return "train_bfloat16" if level in ("O4", "O5") else "train_float16"


# ---- autograd graphs -------------------------------------------------------------------------


def graph_node_names(t):
    """The names of the distinct autograd nodes reachable from `t`'s grad_fn, depth first, without
    a C++ namespace ("AccumulateGrad", not "torch::autograd::AccumulateGrad")."""
    names, todo, seen = [], [t.grad_fn], {}  # seen keeps the wrappers alive: ids stay unique
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        names.append(node.name().split("::")[-1])
        todo.extend(fn for fn, _ in node.next_functions)
    return names


# ---- the A/B trainers (examples/) ------------------------------------------------------------

BUILD = os.environ.get("OPTAMP_BUILD_DIR", os.path.join(ROOT, "build"))
BIN = os.path.join(BUILD, "examples", "cpp", "train_fashion_mnist")
PY_TRAINER = os.path.join(ROOT, "examples", "python", "train_fashion_mnist.py")
DATA = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
    reason=f"Fashion-MNIST not in {DATA}: sudo apt-get install dataset-fashion-mnist")


def trainer_binary():
    if not os.access(BIN, os.X_OK):
        pytest.fail(f"{BIN} is missing: build the project with its examples "
                    "(OPTAMP_BUILD_EXAMPLES=ON, the default) or set OPTAMP_BUILD_DIR")
    return BIN


def env(progress="0"):
    """The trainers' environment; progress=None leaves OPTAMP_PROGRESS unset (the default:
    a progress line only when stderr is a terminal)."""
    e = dict(os.environ, OPTAMP_PYTHON=sys.executable, OPTAMP_PROGRESS=progress or "")
    if progress is None:
        del e["OPTAMP_PROGRESS"]
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + e.get("PYTHONPATH", "")
    return e


# ---- scripts of examples/ and benchmarks/ as modules -----------------------------------------


def _load_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it, as import does (dataclasses, pickle look)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_script(path, siblings=()):
    """The script at ``path`` (absolute, or from the repository root: e.g.
    "examples/python/train_char_gpt.py") as a module, loaded once per test session, without
    putting its directory on sys.path.

    It is registered in sys.modules under a name made from its path
    ("_script_examples_python_train_char_gpt"), so it neither shadows nor is shadowed by another
    module. ``siblings``: the modules of its directory that it imports by their plain name, as a
    script run from there does (the trainers' ``import trainer_common``); they are loaded first,
    under that name."""
    path = os.path.join(ROOT, path)
    relpath = os.path.relpath(path, ROOT)
    folder = os.path.dirname(path)
    for sibling in siblings:
        sibling_path = os.path.join(folder, sibling + ".py")
        loaded = sys.modules.get(sibling)
        if loaded is None:
            _load_file(sibling_path, sibling)
        elif os.path.realpath(getattr(loaded, "__file__", "") or "") != \
                os.path.realpath(sibling_path):
            raise ImportError(f"{relpath} imports {sibling!r}, but sys.modules holds another "
                              f"module of that name ({getattr(loaded, '__file__', loaded)})")
    name = "_script_" + os.path.splitext(relpath)[0].replace(os.sep, "_")
    return sys.modules.get(name) or _load_file(path, name)
