"""Apex's model boundary: the forward of each model initialize is given casts floating inputs to
the model's dtype and floating outputs to fp32 (or ``cast_model_outputs``) wherever the level casts
the model (O2, O3, O5); at O2/O5 the inputs follow where ops see the working copies. The twin of
tests/cpp/test_model_boundary.cpp (same table)."""
import collections
import copy
import dataclasses
import gc
import inspect
import math
import os
import subprocess
import sys
import threading
import weakref
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import optamp
from common_utils import init, tol, train_row

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# level: (dtype the model's first op saw, output dtype), for fp32 inputs in grad mode
TABLE = {"O0": (F32, F32), "O1": (F32, F16), "O2": (F16, F32), "O3": (F16, F32),
         "O4": (F32, BF16), "O5": (BF16, F32)}


class Probe(torch.nn.Module):
    """A linear layer that records the dtype its input arrived in."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        return self.fc(x)


def probe(level, **kw):
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, level, **kw)
    return model


@pytest.mark.parametrize("level", list(TABLE))
def test_inputs_go_to_the_model_dtype_and_outputs_to_fp32(fresh, level):
    model = probe(level)
    out = model(torch.randn(2, 4))
    assert (model.seen, out.dtype) == TABLE[level]
    expected_in = {"O2": F16, "O3": F16, "O5": BF16}.get(level)  # O0 changes nothing
    assert optamp.properties().model_boundary == (expected_in, F32 if expected_in else None)


def test_an_explicit_output_type_is_honoured_at_every_level(fresh):
    model = probe("O2", cast_model_outputs=F16)
    assert model(torch.randn(2, 4)).dtype == F16
    optamp.reset()
    model = probe("O1", cast_model_outputs=F32)  # O1: outputs only (Apex's elif branch)
    assert model(torch.randn(2, 4)).dtype == F32 and model.seen == F32
    assert optamp.properties().cast_model_outputs == F32


def test_a_non_floating_output_type_is_refused(fresh):
    with pytest.raises(ValueError, match="cast_model_outputs must be a floating type"):
        probe("O2", cast_model_outputs=torch.int64)
    with pytest.raises(TypeError, match="cast_model_outputs"):
        probe("O2", cast_model_outputs="float16")
    assert not optamp.is_initialized()


def test_o2_feeds_fp32_where_ops_see_the_masters(fresh):
    # Under no_grad (the gate), inside disable_casts and on a thread initialize did not turn on,
    # ops see the fp32 masters: fp16 inputs would not match them.
    model = probe("O2")
    with torch.no_grad():
        assert model(torch.randn(2, 4, dtype=F16)).dtype == F32 and model.seen == F32
    with optamp.disable_casts():
        assert model(torch.randn(2, 4)).dtype == F32 and model.seen == F32
    seen = []
    thread = threading.Thread(target=lambda: seen.append((model(torch.randn(2, 4)).dtype,
                                                          model.seen)))
    thread.start()
    thread.join()
    assert seen == [(F32, F32)]
    model(torch.randn(2, 4))
    assert model.seen == F16


class _TimestepNet(torch.nn.Module):
    """A diffusion / flow-matching network: a float timestep in [0, 1) turned into sinusoidal
    features of high frequency, added to the input's projection."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.SiLU(),
                                        torch.nn.Linear(32, 8))

    def forward(self, x, t):
        self.timestep_dtype = t.dtype
        freqs = torch.exp(torch.arange(8, device=t.device) * (-math.log(1e4) / 8)) * 1000
        angles = t[:, None] * freqs[None]
        self.features = torch.cat([angles.sin(), angles.cos()], -1).detach()
        return self.body(x + self.embed(self.features))


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_inputs_as_given_keep_a_float_timestep_exact_and_train(fresh, level):
    # Apex's boundary rounds the timestep to fp16/bf16 (bf16 holds t = 0.9 to within 2e-3), so
    # features of frequency 1000 came out with the wrong phase (up to 1.5 off at O5, where
    # native bf16 autocast keeps them exact).
    model = _TimestepNet()
    reference = copy.deepcopy(model)
    x, t = torch.randn(16, 8), torch.rand(16)
    with torch.no_grad():
        reference(x, t)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    model(x, t=t)
    assert model.timestep_dtype != F32
    assert (model.features.float() - reference.features).abs().max() > 0.1
    optamp.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    init(model, opt, level, cast_model_inputs=False)
    assert optamp.properties().model_boundary == (None, F32)
    for step in range(3):
        out = model(x, t=t)
        assert out.dtype == F32 and model.timestep_dtype == F32
        if step == 0:
            assert torch.equal(model.features, reference.features)
        opt.zero_grad()
        loss = F.mse_loss(out, torch.zeros_like(out))
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert not optamp.loss_scaler(0).last_step_skipped
        with optamp.disable_casts():
            ref_opt.zero_grad()
            ref_loss = F.mse_loss(reference(x, t), torch.zeros_like(out))
            ref_loss.backward()
            ref_opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **tol(train_row(level)))


def test_inputs_as_given_in_a_compiled_forward_see_the_working_copies(fresh):
    model = probe("O2", cast_model_inputs=False)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 4)
    out = compiled(x)
    assert out.dtype == F32 and model.seen == F32
    torch.testing.assert_close(out, model(x))
    with torch.no_grad():  # the fp32 masters, not the fp16 working copies
        assert not torch.equal(model.fc(x), out)


def test_inputs_as_given_are_refused_where_the_model_is_cast_in_place(fresh):
    model = Probe()
    with pytest.raises(ValueError, match=r"cast_model_inputs=False needs fp32 master weights "
                                         r"\(O2, O5\): opt_level O3 casts the model itself"):
        init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", cast_model_inputs=False)
    with pytest.raises(ValueError, match='cast_model_inputs must be True, False, .* got "no"'):
        init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", cast_model_inputs="no")
    assert not optamp.is_initialized() and model.fc.weight.dtype == F32


def test_tensors_inside_containers_and_keywords(fresh):
    Out = collections.namedtuple("Out", "h index")

    class Containers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, xs, index, factor, extra=None):
            self.seen = [xs[0].dtype, xs[1].dtype, index.dtype, extra["t"].dtype]
            h = self.fc(xs[0] + xs[1]) * factor
            return Out(h, index + 1), [h, self.fc(extra["t"])]

    model = Containers()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O5")
    out, more = model((torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64)),
                      torch.arange(2), 0.5, extra={"t": torch.randn(2, 4)})
    assert model.seen == [BF16, BF16, torch.int64, BF16]
    assert isinstance(out, Out) and out.h.dtype == F32 and out.index.dtype == torch.int64
    assert [t.dtype for t in more] == [F32, F32]


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: tuple
    step: int = 0


class _Record(dict):
    """An output class that is a dict with attributes (as Hugging Face's ModelOutput is)."""

    def __init__(self, **fields):
        super().__init__(**fields)
        self.note = "kept"


@pytest.mark.parametrize("compiled", [False, True])
def test_outputs_in_dataclasses_and_dict_subclasses_are_cast(fresh, compiled):
    # Returned unchanged (fp16 at O2) from a dataclass until 2026-12-05, and a dict subclass
    # whose constructor takes no key/value pairs (defaultdict) made the boundary raise.
    class Records(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            table = collections.defaultdict(list, h=h)
            return _Output(h, (h, h.argmax(1)), 3), table, _Record(h=h)

    model = Records()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    run = torch.compile(model, backend="aot_eager") if compiled else model
    out, table, record = run(torch.randn(2, 4))
    assert isinstance(out, _Output) and out.step == 3
    assert out.logits.dtype == F32 and out.hidden[0].dtype == F32
    assert out.hidden[1].dtype == torch.int64
    assert isinstance(table, collections.defaultdict) and table.default_factory is list
    assert table["h"].dtype == F32
    assert isinstance(record, _Record) and record.note == "kept" and record["h"].dtype == F32


@dataclasses.dataclass
class _DictRecord(collections.OrderedDict):
    """Hugging Face's ModelOutput in small: a dataclass whose set fields are also its items."""
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_dict_that_is_a_dataclass_is_cast_in_one_compiled_graph(fresh, level):
    # Went through copy.copy, which Dynamo does not trace: fullgraph=True failed at O2/O5 on a
    # Hugging Face model's output until 2026-12-06.
    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            logits = self.fc(x)
            return _DictRecord(loss=logits.float().pow(2).mean(), logits=logits)

    model = Lm()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    eager = model(torch.ones(2, 4))
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(torch.ones(2, 4))
    assert isinstance(out, _DictRecord) and list(out.keys()) == ["loss", "logits"]
    assert out.logits.dtype == F32 and out["logits"] is out.logits
    assert torch.equal(out.logits, eager.logits) and torch.equal(out.loss, eager.loss)


def test_gradients_flow_back_through_the_boundary_in_the_inputs_dtype(fresh):
    model = probe("O2")
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == F32 and x.grad.abs().sum() > 0
    assert model.fc.weight.grad.dtype == F32


def test_o3_trains_a_model_that_starts_with_layer_norm_on_fp32_inputs(fresh):
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, "O3")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    before = model[1].weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        assert loss.dtype == F32  # the loss runs in fp32, not fp16
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert not torch.equal(before, model[1].weight)


def test_a_deep_copy_runs_its_own_weights_as_a_plain_model(fresh):
    # An EMA copy (copy.deepcopy(model), as timm's ModelEmaV2 makes it) must not run the
    # original's forward through a wrapper that closed over it. The boundary belongs to the
    # models initialize was given (as amp::forward's in C++), so the copy runs as any other
    # module does at O2: no boundary casts, its linear in fp16 by the level's rules in grad mode,
    # fp32 under no_grad.
    model = probe("O2")
    ema = copy.deepcopy(model)
    with torch.no_grad():
        ema.fc.weight.zero_()
        ema.fc.bias.zero_()
    assert ema.forward.__self__ is ema
    out = ema(torch.randn(2, 4))
    assert torch.equal(out, torch.zeros(2, 3, dtype=F16)) and ema.seen == F32
    with torch.no_grad():
        assert ema(torch.randn(2, 4)).dtype == F32
    assert model(torch.randn(2, 4)).abs().sum() > 0 and model.seen == F16


def test_a_deep_copy_initialized_after_reset_gets_the_boundary(fresh):
    model = probe("O2")
    copied = copy.deepcopy(model)
    optamp.reset()
    init(copied, torch.optim.SGD(copied.parameters(), lr=0.1), "O2")
    assert copied(torch.randn(2, 4)).dtype == F32 and copied.seen == F16


def _sequential():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _save_and_load(model, path):
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.forward.__func__ is type(model).forward
    assert loaded.__dict__["_optamp_boundary"] is None
    x = torch.randn(2, 4)
    with torch.no_grad():  # under no_grad neither model meets the level's rules
        assert torch.equal(loaded(x), model(x))
    return loaded


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_model_saved_whole_loads_as_a_plain_module_without_optamp(fresh, level, tmp_path):
    # torch.save(model) pickles the instance's attributes, the forward wrapper among them. A
    # bound method pickles as getattr(model, its function's name), which failed at load ("has no
    # attribute '_boundary_forward'"): the checkpoint saved, and could not be read back.
    model = _sequential()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    _save_and_load(model, tmp_path / "model.pt")
    # A process without optamp on its path reads it as well (the pickle names no optamp class).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "assert 'optamp' not in sys.modules; print(tuple(m(torch.ones(1, 4)).shape))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 3)"


def test_a_model_cast_in_place_saved_whole_keeps_its_fp32_state_dict(fresh, tmp_path):
    # O3 casts the model itself; its state_dict hook (fp32 checkpoints, as Apex's) is pickled
    # with it, so loading it needs optamp importable.
    model = _sequential()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O3")
    loaded = _save_and_load(model, tmp_path / "model.pt")
    assert loaded[0].weight.dtype == F16
    assert loaded.state_dict()["0.weight"].dtype == F32


def test_the_forward_looks_like_a_method_with_the_models_signature(fresh):
    # Libraries map inputs onto forward's parameters (inspect.signature(model.forward)); the
    # wrapper's own (*args, **kwargs) would hide them. torch reads forward.__func__ / __code__
    # (torch.export, Dynamo), so it stays a bound method.
    model = probe("O2")
    assert list(inspect.signature(model.forward).parameters) == ["x"]
    assert model.forward.__self__ is model and model.forward.__code__ is not None
    model.forward = lambda x, *, scale=2.0: Probe.forward(model, x) * scale
    optamp.reset()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O5")
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]


def test_torch_export_and_jit_trace_take_an_initialized_model(fresh):
    # What users run to deploy a trained model (docs/python.md, "Exporting"): both trace what
    # ops see, so they trace under no_grad, where the model is its fp32 self.
    model = _sequential()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    model.eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        traced = torch.jit.trace(model, x)
        exported = torch.export.export(model, (x,)).module()
        assert torch.equal(traced(x), expected) and torch.equal(exported(x), expected)


def test_reset_restores_the_forward_the_model_had(fresh):
    model = Probe()
    own = model.forward  # an instance attribute set by the user, kept and restored
    model.forward = lambda x: own(x) * 2
    mine = model.forward
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    assert model(torch.randn(2, 4)).dtype == F32 and model.seen == F16
    optamp.reset()
    assert model.forward is mine
    plain = Probe()
    init(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "O5")
    optamp.reset()
    assert "forward" not in plain.__dict__


def test_compiled_model_keeps_the_boundary_in_one_graph(fresh):
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = probe("O2")
    compiled = torch.compile(model, backend=count)
    x = torch.randn(2, 4)
    assert compiled(x).dtype == F32 and model.seen == F16
    assert len(graphs) == 1, "the boundary made Dynamo break the graph"
    with torch.no_grad():  # grad mode is guarded: traced again, fp32 inputs
        assert compiled(x.to(F16)).dtype == F32 and model.seen == F32


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_dropped_forward_frees_its_graph(fresh, level):
    """A forward whose output is dropped without a backward (a validation loop that forgot
    no_grad, an eager forward right before a CUDA graph capture) frees its graph and the
    activations saved for it at once, as natively. At O2/O5 the boundary keeps the reduced output
    for a loss, without the graph that made it: holding the output kept the graph until the next
    step's end, and before a capture the parameters' grad accumulators with it (the seventh GPU
    run's failed capture). O1/O4 (the widened GELU's reduced result, taken by the next linear)
    hold nothing either."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    saved = []

    def pack(t):
        if t.dim() == 2 and t.size(0) == 5:  # the batch's activations, not the weights' copies
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(5, 4))
    assert out.requires_grad and saved
    del out
    gc.collect()
    assert [r for r in saved if r() is not None] == []
