"""optamp composed with the rest of PyTorch's training stack: activation checkpointing (both
variants), state carried by at::ThreadLocalState (torch.jit.fork), inference under no_grad /
inference_mode, the ungated option, torch.compile and TorchScript models."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint  # imported before initialize, as users do

import optamp
from common_utils import init, tol, train_row, two_steps
from programs import (DiagonalStateSpaceNet, LinalgNet, LinearRecurrentNet, SinusoidalNet,
                      SpectralNet, orthogonal_classifier)

pytestmark = pytest.mark.usefixtures("fresh")

LEVELS = ["O1", "O2", "O3", "O4", "O5"]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """Block (maybe checkpointed) -> head, recording the block's output dtype."""

    def __init__(self, mode=None):
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(16, 4)
        self.mode = mode  # None, "reentrant", "non_reentrant"
        self.block_dtype = None

    def forward(self, x):
        if self.mode is None:
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.mode == "reentrant")
        self.block_dtype = h.dtype
        return self.head(h)


def _grads_and_dtypes(level, mode, region=None):
    torch.manual_seed(0)
    net = Net(mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, level)
    x = torch.randn(8, 16, requires_grad=True)
    seen = []
    net.block.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    if region == "bf16":
        with optamp.autocast(dtype=torch.bfloat16):
            out = net(x)
    elif region == "disabled":
        with optamp.disable_casts():
            out = net(x)
    else:
        out = net(x)
    loss = out.float().pow(2).mean()
    loss.backward()  # after the region, as a training loop does
    grads = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    return net.block_dtype, seen, grads


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_forward_and_recompute_follow_the_same_rules(level, mode):
    plain_dtype, plain_seen, plain_grads = _grads_and_dtypes(level, None)
    optamp.reset()
    dtype, seen, grads = _grads_and_dtypes(level, mode)
    assert dtype == plain_dtype, (level, mode)
    assert len(seen) == 2, "forward + recompute"
    assert seen[0] == seen[1] == plain_seen[0], (level, mode, seen, plain_seen)
    for g, ref in zip(grads, plain_grads):
        assert torch.equal(g, ref), (level, mode)


@pytest.mark.parametrize("region", ["bf16", "disabled"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_recompute_after_the_region_uses_the_regions_rules(mode, region):
    plain_dtype, plain_seen, plain_grads = _grads_and_dtypes("O1", None, region)
    optamp.reset()
    dtype, seen, grads = _grads_and_dtypes("O1", mode, region)
    expected = torch.bfloat16 if region == "bf16" else torch.float32
    assert plain_seen == [expected] and seen == [expected, expected], (mode, region, seen)
    assert dtype == plain_dtype
    for g, ref in zip(grads, plain_grads):
        assert torch.equal(g, ref)


def test_checkpoint_without_optamp_is_untouched():
    net = Net("reentrant")
    x = torch.randn(8, 16, requires_grad=True)
    net(x).sum().backward()
    assert net.block_dtype == torch.float32


# ---- state carried by at::ThreadLocalState ------------------------------------------------


def _mm_dtype():
    a = torch.randn(4, 4, requires_grad=True)
    return (a @ a).dtype


def _forked_mm_source(a: torch.Tensor) -> torch.Tensor:
    # TorchScript runs the fork on the inter-op thread pool (at::launch), restoring the caller's
    # at::ThreadLocalState there, as the autograd engine does on its device threads.
    future = torch.jit.fork(torch.mm, a, a)
    return torch.jit.wait(future)


@pytest.fixture
def jit_autocast_pass_off():
    """TorchScript's own autocast pass (on by default) runs forked tasks with every autocast key
    excluded, optamp's too; turned off, forks carry the caller's state (docs/python.md)."""
    previous = torch._C._jit_set_autocast_mode(False)
    yield
    torch._C._jit_set_autocast_mode(previous)


@pytest.mark.filterwarnings("ignore:`torch.jit.(fork|wait)` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch.jit.(fork|wait)` is deprecated")
def test_eager_fork_runs_inline_under_the_callers_state():
    model = torch.nn.Linear(4, 4)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    with optamp.autocast(dtype=torch.bfloat16):
        assert torch.jit.wait(torch.jit.fork(_mm)).dtype == torch.bfloat16


def _mm():
    a = torch.randn(4, 4, requires_grad=True)
    return a @ a


@pytest.mark.filterwarnings("ignore:`torch.jit.(fork|wait)` is deprecated")
def test_scripted_fork_carries_regions_and_disable_casts_to_the_pool_thread(
        jit_autocast_pass_off):
    _forked_mm = torch.jit.script(_forked_mm_source)  # compiled with the pass off
    model = torch.nn.Linear(4, 4)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    a = torch.randn(4, 4, requires_grad=True)
    _forked_mm(a)  # the first (profiling) run of a scripted fork drops every autocast key
    assert _forked_mm(a).dtype == torch.float16
    with optamp.autocast(dtype=torch.bfloat16):
        assert _forked_mm(a).dtype == torch.bfloat16
    with optamp.disable_casts():
        assert _forked_mm(a).dtype == torch.float32
    with torch.no_grad():
        assert _forked_mm(a).dtype == torch.float32
        with optamp.lift_no_grad_gate():
            assert _forked_mm(a).dtype == torch.float16


# ---- weight parametrizations (spectral / weight norm) ------------------------------------------


def _discriminator(kind):
    """A GAN discriminator's layers under a weight parametrization. spectral_norm's power
    iteration runs under no_grad on the weight as the forward sees it (fp16/bf16 at O2/O5) and
    its fp32 buffers, then multiplies a clone of a buffer (fp32: clone sees the master) by that
    weight while autograd records: mixed widths both times."""
    P = torch.nn.utils.parametrizations
    wrap = {"spectral_norm": P.spectral_norm, "weight_norm": P.weight_norm,
            "spectral_norm_hook": torch.nn.utils.spectral_norm}[kind]
    return torch.nn.Sequential(wrap(torch.nn.Linear(16, 32)), torch.nn.LeakyReLU(0.2),
                               wrap(torch.nn.Linear(32, 1)))


def _train_discriminator(kind, level, steps=4):
    torch.manual_seed(0)
    model = _discriminator(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if level != "O0":
        model, opt = init(model, opt, level)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = torch.nn.functional.softplus(-model(x).float()).mean()
        opt.zero_grad()
        if level == "O0":
            loss.backward()
        else:
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        losses.append(loss.item())
    buffers = {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}
    optamp.reset()
    return losses, buffers


@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm", "spectral_norm_hook"])
@pytest.mark.parametrize("level", LEVELS)
def test_weight_parametrizations_train_close_to_fp32(kind, level):
    losses, buffers = _train_discriminator(kind, level)
    ref_losses, ref_buffers = _train_discriminator(kind, "O0")
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    torch.testing.assert_close(losses, ref_losses, **tol(f"train_{str(low)[6:]}"))
    assert buffers.keys() == ref_buffers.keys()
    for name, ref in ref_buffers.items():  # the power iteration's vectors stay fp32
        assert buffers[name].dtype == (low if level == "O3" else torch.float32), name
        torch.testing.assert_close(buffers[name].float(), ref, **tol(f"train_{str(low)[6:]}"))


class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(30, 8, mode="sum")
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids, offsets, weights):
        return self.head(self.bag(ids, offsets, per_sample_weights=weights))


@pytest.mark.parametrize("level", LEVELS)
def test_embedding_bag_with_per_sample_weights_trains(level):
    """embedding_bag is a promote op: at O2/O5 its weight is weighed as the working copy it will
    be, beside the per-sample weights the model boundary cast to the same dtype."""
    torch.manual_seed(0)
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    ids, offsets = torch.randint(0, 30, (6,)), torch.tensor([0, 3])
    weights = torch.rand(6)
    before = model.bag.weight.detach().clone()
    loss = model(ids, offsets, weights).float().pow(2).mean()
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert not torch.equal(model.bag.weight.detach().float(), before.float())


# ---- inference -----------------------------------------------------------------------------


def test_inference_under_no_grad_and_inference_mode_is_fp32_by_default():
    model = torch.nn.Linear(4, 4)
    model = init(model, None, "O1")
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert model(x).dtype == torch.float32
    with torch.inference_mode():
        assert model(x).dtype == torch.float32
    with torch.no_grad(), optamp.autocast():
        assert model(x).dtype == torch.float16
    with torch.no_grad(), optamp.lift_no_grad_gate():
        assert model(x).dtype == torch.float16


@pytest.mark.parametrize("level, low", [("O1", torch.float16), ("O5", torch.bfloat16)])
def test_rules_under_no_grad_option_is_apex_and_torch_amp_inference(level, low):
    # The dtype the linear layer computes in (inside the model: at O5 the model boundary casts
    # its output to fp32).
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    computed = []
    model[0].register_forward_hook(lambda m, i, o: computed.append(o.dtype))
    model = init(model, None, level, rules_under_no_grad=True)
    assert optamp.properties().rules_under_no_grad is True
    with torch.no_grad():
        model(torch.randn(2, 4))
        assert computed.pop() == low
        assert optamp.is_casting_enabled()
    with torch.inference_mode():
        model(torch.randn(2, 4))
        assert computed.pop() == low
    optamp.reset()
    model = init(model, None, level)
    with torch.no_grad():
        model(torch.randn(2, 4))
        assert computed.pop() == torch.float32, "reset restores the gate"


# ---- torch.compile -------------------------------------------------------------------------

ALL_LEVELS = ["O0"] + LEVELS


class CNet(torch.nn.Module):
    """Linear -> (checkpointed) layer norm * gain -> relu -> linear, for compile tests. The layer
    norm and the gain parameter run in fp16/bf16 at O2/O5 (working copies) and in fp32 at O1/O4
    (Apex's fp32 list, widest-type promotion): a compiled O2 that ran O1's numerics differs."""

    def __init__(self, mode=None):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.b = torch.nn.Linear(32, 4)
        self.mode = mode

    def block(self, x):
        return self.norm(self.a(x)) * self.gain

    def forward(self, x):
        if self.mode is None:
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.mode == "reentrant")
        return self.b(torch.relu(h))


def _train(level, backend, mode=None, steps=4, compile_first=False, **init_kw):
    """Losses and the last output dtype of a few training steps, eager or compiled (after
    initialize, or before it with ``compile_first``); ``init_kw``: initialize's overrides."""
    torch.manual_seed(0)
    net = CNet(mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if compile_first:
        net = torch.compile(net, backend=backend)
    net, opt = init(net, opt, level, **init_kw)
    run = net if backend is None or compile_first else torch.compile(net, backend=backend)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).requires_grad_()
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        out = run(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    optamp.reset()
    return losses, out.dtype


@pytest.mark.parametrize("mode", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_compiled_training_matches_eager_at_every_level(level, mode):
    eager = _train(level, None, mode)
    compiled = _train(level, "aot_eager", mode)
    assert compiled[1] == eager[1], (level, mode)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_a_model_compiled_before_initialize_trains_as_eager(level):
    # torch.compile's wrapper runs the module it compiled through Dynamo's frame: the boundary
    # goes on that module, or the traced forward would miss it (O2/O5: fp32 parameters).
    eager = _train(level, None)
    compiled = _train(level, "aot_eager", compile_first=True)
    assert compiled[1] == eager[1], level
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)


def test_the_compile_tests_model_tells_o2_from_o1():
    # Otherwise a compiled O2 that ran O1's numerics (no working copies: fp32 parameters) would
    # pass the test above, as it did.
    assert _train("O2", None)[0] != _train("O1", None)[0]
    assert _train("O5", None)[0] != _train("O4", None)[0]


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_compiled_o2_o5_model_without_input_casts_trains_as_eager(level):
    # Found 2026-12-07: the compile mode took the working copies' dtype from the boundary's input
    # cast, which cast_model_inputs=False turns off: the compiled forward ran on the fp32 masters
    # (O1's numerics in an O2 run, silently), where eager's ran on the working copies.
    eager = _train(level, None, cast_model_inputs=False)
    compiled = _train(level, "aot_eager", cast_model_inputs=False)
    assert compiled[1] == eager[1]
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    assert eager[0] != _train("O1" if level == "O2" else "O4", None)[0]


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_compiled_o2_o5_forward_sees_working_copies_in_one_graph(level):
    # Found 2026-12-05: the fake tensors AOTAutograd traces with carry no dispatch key, so a
    # compiled O2 model ran with fp32 parameters. The boundary now casts them in the graph.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    net = init(CNet(), None, level)
    low = torch.float16 if level == "O2" else torch.bfloat16
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=counter, fullgraph=True)
    x = torch.randn(8, 16, requires_grad=True)
    eager_out = net(x)
    out = compiled(x)
    assert counter.frame_count == 1
    casts = [n for n in counter.graphs[0].graph.nodes if n.target == "to" and low in n.args]
    assert len(casts) >= 6, "the six parameters' casts are graph nodes"
    assert torch.equal(out, eager_out)
    out.sum().backward()
    assert net.gain.grad.dtype == torch.float32
    with torch.no_grad():  # the gate: no working copies, fp32 masters, as eager
        assert torch.equal(compiled(x), net(x))


class BufferUpdatingNet(torch.nn.Module):
    """A buffer updated in place in the forward and read afterwards, a parameter read through
    an "own data" function and through .dtype: what substitution must leave alone."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        self.running.mul_(0.5).add_(x.detach().float().mean(0))
        centred = x.to(self.fc.weight.dtype) - self.running  # fp32 here, fp16 in the op
        return self.fc(centred) + self.fc.weight.detach().sum()


@torch.library.custom_op("optamp_test::count_", mutates_args=("counter",))
def _count_(x: torch.Tensor, counter: torch.Tensor) -> None:
    counter.add_(x.float().abs().mean())


class CountingNet(torch.nn.Module):
    """A custom op that updates a registered buffer in place (a usage counter), called as a
    torch.library.custom_op and through its overload packet."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("counter", torch.zeros(1))

    def forward(self, x):
        h = self.fc(x)
        _count_(h.detach(), self.counter)
        torch.ops.optamp_test.count_(h.detach(), counter=self.counter)
        return h


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_compiled_o2_o5_custom_ops_update_registered_buffers_as_eager(level):
    # The compiled forward's working-copy mode read written arguments by name only (in-place
    # methods end in "_"): a custom op's `Tensor(a!)` buffer got a working copy, and the update
    # was lost (the counter stayed 0 compiled, eager counted). In one graph: until 2026-12-06
    # reading a packet's schemas broke the graph inside the mode (a Hugging Face MoE model's
    # resumed frame then failed, its tensor's device read as a torch.Size).
    counters = []
    for backend in [None, "aot_eager"]:
        torch.manual_seed(0)
        net = init(CountingNet(), None, level)
        run = net if backend is None else torch.compile(net, backend=backend, fullgraph=True)
        x = torch.randn(4, 8, requires_grad=True)
        for _ in range(2):
            run(x)
        counters.append(net.counter.clone())
        optamp.reset()
    assert counters[0].item() > 0
    assert torch.equal(counters[1], counters[0])


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_compiled_o2_o5_write_buffers_and_read_own_data_as_eager(level):
    results = []
    for backend in [None, "aot_eager"]:
        torch.manual_seed(0)
        net = init(BufferUpdatingNet(), None, level)
        run = net if backend is None else torch.compile(net, backend=backend, fullgraph=True)
        x = torch.randn(4, 8)
        outs = [run(x * (i + 1)) for i in range(3)]
        assert net.running.dtype == torch.float32
        results.append((outs, net.running.clone()))
        optamp.reset()
    (eager_outs, eager_running), (outs, running) = results
    assert torch.equal(running, eager_running), "the in-place update reached the fp32 buffer"
    for a, b in zip(outs, eager_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("program", ["state_space", "recurrent_unit"])
def test_compiled_o2_o5_complex_values_and_widened_ops_read_the_masters_as_eager(level, program):
    # Eager substitution leaves a call's registered tensors alone where it has a complex argument
    # (`1j * a_imag`) and where an fp32 (always) op widens (`view_as_complex(c)`, the FFTs): the
    # compiled forward's mode did not, so the compiled S4D layer computed its kernel from the
    # fp16/bf16-rounded copies (losses 4e-5 off eager at O2, 1.6e-4 at O5).
    cls, shape = {"state_space": (DiagonalStateSpaceNet, (3, 16)),
                  "recurrent_unit": (LinearRecurrentNet, (3, 8, 2))}[program]
    losses = []
    for backend in [None, "aot_eager"]:
        torch.manual_seed(0)
        net = init(cls(), None, level)
        run = net if backend is None else torch.compile(net, backend=backend)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        losses.append(run(x).float().square().mean().detach())
        optamp.reset()
    assert torch.equal(losses[1], losses[0])


class WeightedLoss(torch.nn.Module):
    """A linear whose forward ends in a cross entropy weighted by a registered buffer of class
    weights that fp16 does not hold exactly."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 5)
        self.register_buffer("class_weight", torch.tensor([1 / 3, 0.7, 1.1, 2 / 3, 0.1]))

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x).float(), y, weight=self.class_weight)


def _sinusoidal_step(run, gen):
    idx = torch.randint(0, 50, (4, 12), generator=gen)
    return F.cross_entropy(run(idx).float().flatten(0, 1), idx.flatten())


def _weighted_loss_step(run, gen):
    return run(torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen))


@pytest.mark.parametrize("op_lists", ["apex", "torch"])
@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("program", ["sinusoidal", "weighted_loss"])
def test_compiled_o2_o5_calls_widened_to_fp32_read_the_masters_as_eager(level, op_lists, program):
    # Eager casting hands a call it casts to fp32 the fp32 masters: a layer norm of fp16
    # embeddings plus an fp32 positional encoding (widened: mixed widths), a cross entropy's
    # class-weight buffer (O2/O5's fp32 losses). The compiled forward's mode knew only the fp32
    # (always) ops: it handed both the working copies, widened in the graph, so the weights'
    # gradients were rounded through fp16 (LayerNorm 1.2e-4 off eager's at O2, 9.8e-4 at O5;
    # the weighted loss 2.4e-4 and 2e-3).
    make, step = {"sinusoidal": (SinusoidalNet, _sinusoidal_step),
                  "weighted_loss": (WeightedLoss, _weighted_loss_step)}[program]
    eager = two_steps(make, step, level, op_lists=op_lists)
    compiled = two_steps(make, step, level, "aot_eager", fullgraph=True, op_lists=op_lists)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("op_lists", ["apex", "torch"])
def test_the_compile_mode_asks_the_casting_kernels_plan_which_calls_read_the_masters(
        fresh, op_lists):
    # Eager O2 hands a call's model tensors their fp32 masters where the casting kernel casts the
    # call to fp32; the compiled forward's mode asks the kernel's own plan (until 2026-12-08 it
    # knew only the fp32 (always) rows by name).
    init(torch.nn.Linear(2, 2), None, "O2", op_lists=op_lists)
    f16, f32 = torch.float16, torch.float32
    weight, bias = (f32, True, True), (f32, True, True)  # model tensors, seen fp16

    def reads(op, tensors, device="cpu", self_dtype=None, dtype_given=False):
        return optamp._C._call_reads_masters(op, device, tensors, self_dtype, dtype_given)

    # fp32 (always), everywhere and on the CPU only (avg_pool3d has no reduced CPU kernel)
    assert reads("aten::linalg_slogdet", [weight], self_dtype=f32)
    assert reads("aten::avg_pool3d", [weight], self_dtype=f32)
    assert not reads("aten::avg_pool3d", [weight], device="cuda", self_dtype=f32)
    # a layer norm: fp32 input beside reduced weights is widened; a reduced input is not
    assert reads("aten::layer_norm", [(f32, False, True), weight, bias], self_dtype=f32)
    assert not reads("aten::layer_norm", [(f16, False, True), weight, bias], self_dtype=f16)
    # O2's fp32 losses: a registered class-weight buffer is read in fp32
    assert reads("aten::cross_entropy_loss", [(f16, False, True), weight], self_dtype=f16)
    # lower: the working copies' dtype; promote where torch agrees: the op promotes itself
    assert not reads("aten::linear", [(f32, False, True), weight, bias], self_dtype=f32)
    assert not reads("aten::add", [(f32, False, True), weight], self_dtype=f32)
    # a 0-dim fp32 tensor: torch would pick fp16, Apex's promote rule fp32 (torch's lists have
    # no promote row for add: as native)
    zero_dim = [(f32, False, False), weight]
    assert reads("aten::add", zero_dim, self_dtype=f32) == (op_lists == "apex")
    assert reads("aten::add.Tensor", zero_dim, self_dtype=f32) == (op_lists == "apex")
    assert not reads("aten::add.Scalar", [weight], self_dtype=f32), "add.Scalar is in no table"
    # an op in no table
    assert not reads("aten::relu", [weight], self_dtype=f32)
    # match self: a working copy written into an fp32 activation is its master, widened
    assert reads("aten::index_add", [(f32, False, True), weight], self_dtype=f32)
    assert not reads("aten::index_add", [(f16, False, True), weight], self_dtype=f16)
    with optamp.autocast(dtype=f16):  # a region applies the fp32 list at O2
        # (torch's CPU list has no layer_norm row: as native autocast, fp16 throughout)
        norm = [(f16, False, True), weight, bias]
        assert reads("aten::layer_norm", norm, self_dtype=f16) == (op_lists == "apex")
        # an fp32-list op with a dtype argument is asked for fp32 results, reading the copies
        assert not reads("aten::softmax", [weight], self_dtype=f32)
    with torch.no_grad():  # the gate: ops see the masters, nothing to decide
        assert not reads("aten::layer_norm", [(f32, False, True), weight, bias], self_dtype=f32)


class NormsWithStatistics(torch.nn.Module):
    """Batch norm, instance norm tracking statistics, group norm and attention over a conv."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.inorm = torch.nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.conv(x)
        h = self.gn(torch.relu(self.bn(h) + self.inorm(h)))
        t = h.flatten(2).transpose(1, 2)
        return self.attn(t, t, t)[0].sum(1)


def _train_norms(net_class, input_shape, level, backend, **init_kw):
    """Outputs (in fp32), running statistics and gradients of three forwards and backwards of a
    seeded ``net_class()``: in fp32 (``level`` None) or initialized at ``level`` with
    ``init_kw``, eager or compiled with ``backend``."""
    torch.manual_seed(0)
    net = net_class()
    if level is not None:
        net = init(net, None, level, **init_kw)
    run = net if backend is None else torch.compile(net, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    outs = []
    for step in range(3):
        out = run(torch.randn(*input_shape, generator=gen) + step)
        out.float().sum().backward()
        outs.append(out.detach().float())
    stats = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    grads = [p.grad.float() for p in net.parameters()]
    optamp.reset()
    return outs, stats, grads


def _norm_statistics(level, backend, keep_batchnorm_fp32):
    return _train_norms(NormsWithStatistics, (2, 3, 8, 8), level, backend,
                        keep_batchnorm_fp32=keep_batchnorm_fp32)


@pytest.mark.parametrize("keep_batchnorm_fp32", [None, False])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_running_statistics_follow_training_eager_and_compiled(level, keep_batchnorm_fp32):
    # Found 2026-12-05: the running statistics of a registered norm (batch norm under
    # keep_batchnorm_fp32=False, an InstanceNorm tracking them at any O2/O5) never moved in
    # eager runs (the kernel updated a working copy), and a compiled forward failed.
    reference = _norm_statistics(None, None, None)[1]
    eager = _norm_statistics(level, None, keep_batchnorm_fp32)
    compiled = _norm_statistics(level, "aot_eager", keep_batchnorm_fp32)
    row = "train_float16" if level == "O2" else "train_bfloat16"
    for name, expected in reference.items():
        assert eager[1][name].dtype == torch.float32, name
        torch.testing.assert_close(eager[1][name], expected, **tol(row), msg=name)
    for a, b in zip(compiled[0] + compiled[2], eager[0] + eager[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in reference:
        torch.testing.assert_close(compiled[1][name], eager[1][name], rtol=0, atol=0)


class FunctionalBatchNorm(torch.nn.Module):
    """A norm of the user's (not a torch.nn batch norm: initialize casts its parameters and
    registers its buffers at O2/O5) that calls F.batch_norm with them."""

    def __init__(self, channels):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(channels) * 0.1)
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                              self.bias, self.training, 0.1, 1e-5)


class NormsOfFp32Input(torch.nn.Module):
    """fp32 tensors reaching norms whose weights are registered: the model input itself (under
    cast_model_inputs=False), and an activation an fp32 tensor made in the forward promoted."""

    def __init__(self):
        super().__init__()
        self.norm_in = FunctionalBatchNorm(6)
        self.fc = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.inorm = torch.nn.InstanceNorm1d(8, affine=True, track_running_stats=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(self.norm_in(x))
        h = h + torch.linspace(0.0, 1.0, h.shape[-1])  # fp32, made here: an fp32 sum
        h = torch.relu(self.bn(h))
        h = self.inorm(h.unsqueeze(-1).expand(-1, -1, 4)).mean(-1)
        return self.out(h)


def _fp32_input_norms(level, backend):
    return _train_norms(NormsOfFp32Input, (16, 6), level, backend, keep_batchnorm_fp32=False,
                        cast_model_inputs=False)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_norms_given_fp32_input_read_the_masters_eager_and_compiled(level):
    # Found 2026-12-07: a batch or instance norm whose weights are registered working copies
    # (keep_batchnorm_fp32=False, or a norm of the user's calling F.batch_norm) failed when its
    # input was fp32 ("mixed dtype (CPU): expect parameter to have scalar type of Float"), where
    # fp32 training runs. They run in fp32 on the masters now and update the buffers themselves.
    reference = _fp32_input_norms(None, None)
    eager = _fp32_input_norms(level, None)
    compiled = _fp32_input_norms(level, "aot_eager")
    row = train_row(level)
    for name, expected in reference[1].items():
        assert eager[1][name].dtype == torch.float32, name
        torch.testing.assert_close(eager[1][name], expected, **tol(row), msg=name)
    for a, b in zip(eager[0] + eager[2], reference[0] + reference[2]):
        torch.testing.assert_close(a, b, **tol(row))
    for a, b in zip(compiled[0] + compiled[2], eager[0] + eager[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in reference[1]:
        torch.testing.assert_close(compiled[1][name], eager[1][name], rtol=0, atol=0)


class BufferViews(torch.nn.Module):
    """Writes through views of a buffer, and reads of a view of a buffer that is itself a view."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("memory", torch.zeros(3, 4))
        self.register_buffer("table", torch.arange(8.0).view(2, 4))
        self.row_dtype = None

    def forward(self, x):
        self.memory[0] = x.detach().float().mean(0)
        self.memory[1:2].copy_(x.detach().float().amax(0, keepdim=True))
        self.memory[2].add_(1.0)
        row = x + self.table[:1]
        self.row_dtype = row.dtype
        return self.fc(row) + self.memory.sum(0)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_writes_through_a_buffers_views_reach_it_eager_and_compiled(level):
    # Found 2026-12-05: at O2/O5 a view op on a registered buffer returned a view of its working
    # copy, so `buffer[0] = x` in a training forward wrote into the copy and was lost.
    low = torch.float16 if level == "O2" else torch.bfloat16
    results = []
    for backend in [None, "aot_eager"]:
        torch.manual_seed(0)
        net = init(BufferViews(), None, level)
        run = net if backend is None else torch.compile(net, backend=backend, fullgraph=True)
        xs = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
        outs = [run(x) for x in xs]
        last = xs[-1].detach().to(low).float()
        expected = torch.stack([last.mean(0), last.amax(0), torch.full((4,), 2.0)])
        with torch.no_grad():  # the buffer itself, not what ops see
            torch.testing.assert_close(net.memory, expected, rtol=0, atol=0)
        assert net.table.dtype == torch.float32 and net.memory.dtype == torch.float32
        if backend is None:
            assert net.row_dtype == low, "a buffer's view is read in the working dtype"
        results.append([o.detach() for o in outs])
        optamp.reset()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inductor_levels_one_after_another_keep_their_precision():
    # AOTAutograd's cache keys artifacts by the Dynamo graph, which holds no casts: without
    # optamp turning it off, O5 got O1's fp16 graph.
    for level in ["O1", "O5", "O4", "O2", "O3", "O0"]:
        eager = _train(level, None, steps=2)
        compiled = _train(level, "inductor", steps=2)
        assert compiled[1] == eager[1], level
        # Inductor fuses and reorders: the train_* rows of the shared table, by the level's
        # reduced dtype (O2/O5 return fp32 outputs computed in fp16/bf16).
        row = {"O1": "train_float16", "O2": "train_float16", "O3": "train_float16",
               "O4": "train_bfloat16", "O5": "train_bfloat16"}.get(level, "float32")
        torch.testing.assert_close(compiled[0], eager[0], **tol(row))


def test_issue_repro_compile_after_a_checkpoint_call_keeps_the_level_dtype():
    # The report: after any checkpoint call, torch.compile(model) returned bf16 where eager gave
    # fp16, silently.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    model, opt = init(model, opt, "O1")
    x = torch.randn(8, 32, requires_grad=True)
    y = checkpoint(model[0], x, use_reentrant=False)
    with optamp.scale_loss(model[2](model[1](y)).float().sum(), opt) as scaled:
        scaled.backward()
    assert model(x).dtype == torch.compile(model)(x).dtype == torch.float16


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_follows_regions_no_grad_and_reinitialization(backend):
    torch.manual_seed(0)
    net = CNet()
    net = init(net, None, "O1")
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(8, 16, requires_grad=True)
    assert compiled(x).dtype == net(x).dtype == torch.float16
    with optamp.autocast(dtype=torch.bfloat16):
        assert compiled(x).dtype == torch.bfloat16
    with optamp.disable_casts():
        assert compiled(x).dtype == torch.float32
    with torch.no_grad():
        assert compiled(x).dtype == torch.float32
    assert compiled(x).dtype == torch.float16
    optamp.reset()
    assert compiled(x).dtype == torch.float32, "after reset nothing is cast"
    init(net, None, "O4")  # the same compiled module, another level: traced again
    assert compiled(x).dtype == torch.bfloat16
    with torch.no_grad(), optamp.lift_no_grad_gate():
        assert compiled(x).dtype == torch.bfloat16


def test_initialize_turns_the_autograd_cache_off_and_reset_restores_it():
    import torch._functorch.config as functorch_config

    before = functorch_config.enable_autograd_cache
    net = init(CNet(), None, "O2")
    assert functorch_config.enable_autograd_cache is False
    optamp.reset()
    assert functorch_config.enable_autograd_cache == before
    init(CNet(), None, "O0")
    assert functorch_config.enable_autograd_cache == before, "O0 casts nothing"
    del net


def _compiled_step_run(level, fused, compiled):
    """The parameters after each of four AdamW steps, the third with an inf loss, and the skipped
    steps; the whole training step (``"train_step"``: forward, guard, step) or only
    ``optimizer.step`` (``"optimizer_step"``) compiled with aot_eager, or all eager (None)."""
    torch.manual_seed(0)
    net = CNet()
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, **kind)
    net, opt = init(net, opt, level)
    optimizer_step = opt.step
    if compiled == "optimizer_step":
        optimizer_step = torch.compile(opt.step, backend="aot_eager")

    def train_step(x, y, factor):
        opt.zero_grad()
        loss = F.cross_entropy(net(x).float(), y) * factor
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        optimizer_step()

    step = train_step
    if compiled == "train_step":
        step = torch.compile(train_step, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    params = []
    for i in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        step(x, y, torch.tensor(float("inf") if i == 2 else 1.0))
        with torch.no_grad():
            params.append([p.detach().clone() for p in net.parameters()])
    skipped = optamp.loss_scaler(0).skipped_steps
    optamp.reset()
    return params, skipped


@pytest.mark.parametrize("compiled", ["train_step", "optimizer_step"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_compiled_training_step_skips_and_trains_as_eager(fresh, level, fused, compiled):
    # Found 2026-12-05: compiling a step with the guard inside (or only a fused optimizer's
    # step) made Dynamo trace the guard's attribute writes on the optimizer (found_inf) and
    # fail ("Attempted setattr on a user-defined object"); a foreach step warned about tracing
    # optamp._C. The guard's halves and its step hooks now run outside Dynamo's tracing.
    eager = _compiled_step_run(level, fused, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compiled_step_run(level, fused, compiled)
    assert eager[1] == got[1] == 1, "the inf step is skipped, eager and compiled"
    torch.testing.assert_close(got[0][2], got[0][1], rtol=0, atol=0, msg="the skip changed nothing")
    # torch's fused kernels are not traced (the same kernel runs); a traced foreach AdamW rounds
    # differently from eager's (7e-7 without optamp), which the fp16 forwards then amplify.
    exact = dict(rtol=0, atol=0) if fused else dict(rtol=0, atol=2e-3)
    torch.testing.assert_close(got[0], eager[0], **exact)
    # Dynamo's warning names what it could not trace (optamp._C, or set_eval_frame had the
    # guard's wrapper been traced into).
    untraceable = [str(w.message) for w in caught
                   if "optamp" in str(w.message) or "does not know how to trace" in str(w.message)]
    assert not untraceable, untraceable


def test_compiled_autograd_is_refused_by_name_and_the_step_runs_without_it(fresh):
    # Compiled autograd traces a backward through each node's and hook's compiled_args, which
    # optamp's C++ nodes and the guard's hook on the scaled loss do not have; torch's own
    # refusal named a mangled C++ type ("compiled_args nyi ... CppFunctionTensorPreHookE").
    from torch._dynamo import compiled_autograd

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, "O1")
    x = torch.randn(8, 16)
    before = [p.detach().clone() for p in net.parameters()]
    compiler = torch.compile(backend="aot_eager")
    try:
        with pytest.raises(NotImplementedError, match="optamp's scale_loss guard .*cannot run "
                           "under compiled autograd"):
            with optamp.scale_loss(net(x).float().pow(2).mean(), opt) as scaled:
                with compiled_autograd._enable(compiler):
                    scaled.backward()
        assert all(p.grad is None for p in net.parameters()), "the guard unwound"
        loss = net(x).float().pow(2).mean()  # O1's fp32 GELU is one op with its own node
        with pytest.raises(NotImplementedError, match="optamp's widened GELU"):
            with compiled_autograd._enable(compiler):
                loss.backward()
    finally:
        torch._dynamo.reset()
    opt.zero_grad()
    with optamp.scale_loss(net(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not optamp.loss_scaler().last_step_skipped
    assert all(not torch.equal(p, b) for p, b in zip(net.parameters(), before))


class _MatmulTransformDataset(torch.utils.data.Dataset):
    """A dataset whose transform multiplies matrices (a filterbank, a whitening): what optamp
    must not cast. At module level so that spawned workers can import it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.randn(4, 4)
        return torch.mm(x, x.t()), torch.tensor(float(optamp.is_casting_enabled()))


@pytest.mark.parametrize("workers,context", [(0, None), (2, "fork"), (2, "spawn")])
def test_a_dataloader_fetches_without_optamps_rules_in_any_process(fresh, workers, context):
    # Before 2026-12-06 a fork-started worker inherited the initializing thread's casting (the
    # transform's matmul came back fp16), a spawned one did not, and with num_workers=0 the
    # training thread cast the transform: the same program gave other data by platform.
    init(torch.nn.Linear(4, 4))
    loader = torch.utils.data.DataLoader(_MatmulTransformDataset(), batch_size=2,
                                         num_workers=workers, multiprocessing_context=context)
    for product, casting in loader:
        assert product.dtype == torch.float32 and not casting.any()
    assert optamp.is_casting_enabled() and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == \
        torch.float16, "the training thread casts as before"


def test_the_guards_wrapper_carries_torch_compiler_disables_mark():
    # optamp.scaler makes torch.compiler.disable's wrapper without importing torch._dynamo; the
    # attribute Dynamo reads must stay the one torch's decorator sets.
    from optamp import scaler

    wrapped = torch.compiler.disable(lambda: None)
    assert getattr(wrapped, scaler.DYNAMO_DISABLE_MARK) is True


class RegionInsideForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        with optamp.autocast(dtype=torch.bfloat16):
            g = self.b(h)
        with optamp.disable_casts():
            k = self.c(g.float())
        return h, g, k


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_optamp_context_managers_inside_a_compiled_forward_keep_their_dtypes(backend):
    net = init(RegionInsideForward(), None, "O1")
    x = torch.randn(4, 16, requires_grad=True)
    eager = [t.dtype for t in net(x)]
    compiled = [t.dtype for t in torch.compile(net, backend=backend)(x)]
    assert eager == compiled == [torch.float16, torch.bfloat16, torch.float32]


def test_the_guards_old_name_is_a_deprecated_alias_of_lift_no_grad_gate():
    with pytest.warns(DeprecationWarning, match="lift_no_grad_gate"):
        guard = optamp.rules_under_no_grad()
    assert isinstance(guard, optamp.lift_no_grad_gate)
    with guard:  # still a working guard
        assert optamp.is_casting_enabled() is False  # nothing initialized: no rules


# ---- higher-order operators (torch.cond, nested_compile_region, flex_attention) ---------------

LOW = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float16, "O4": torch.bfloat16,
       "O5": torch.bfloat16}


@torch.compiler.nested_compile_region
def _region(block, x):
    return block(x)


class HopNet(torch.nn.Module):
    """Two blocks inside a higher-order operator (``cond``: one of them, by the input's sign;
    ``region``: both, each in a nested_compile_region), or the same computation without one
    (``plain_*``); then a head. Returns the blocks' output too."""

    def __init__(self, hop):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(16, 4)
        self.hop = hop

    def forward(self, x):
        first, second = self.blocks
        if self.hop == "cond":
            h = torch.cond(x.sum() > 0, lambda t: first(t), lambda t: second(t), (x,))
        elif self.hop == "plain_cond":
            h = first(x) if x.sum() > 0 else second(x)
        elif self.hop == "region":
            h = _region(second, _region(first, x))
        else:
            h = second(first(x))
        return self.head(h), h


def _train_hop(hop, level, backend, steps=3):
    """Losses and the blocks' output dtypes of a few steps, then of a no_grad forward."""
    torch.manual_seed(0)
    net = HopNet(hop)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = init(net, opt, level)
    run = net if backend is None else torch.compile(net, backend=backend)
    gen = torch.Generator().manual_seed(1)
    losses, inner = [], []
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen).abs() * (1 if step % 2 else -1)  # both branches
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        out, h = run(x)
        loss = F.cross_entropy(out.float(), y)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
        inner.append(h.dtype)
    with torch.no_grad():  # the no_grad gate: nothing cast at the call, nothing inside
        inner.append(run(x)[1].dtype)
    optamp.reset()
    return losses, inner


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("hop", ["cond", "region"])
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_higher_order_ops_cast_their_subgraphs_and_train_as_without_them(hop, level):
    # Every HOP failed while optamp was initialized ("could not find kernel for
    # HigherOrderOperator cond at dispatch key AutocastPrivateUse1"): torch makes HOPs fall
    # through its own autocast keys only. Losses equal to the plain model's say the subgraphs'
    # ops were cast as the level casts them (O2/O5: on working copies).
    plain = _train_hop("plain_" + hop, level, None)
    eager = _train_hop(hop, level, None)
    compiled = _train_hop(hop, level, "aot_eager")
    torch.testing.assert_close(eager[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(compiled[0], plain[0], rtol=0, atol=0)
    # O2/O5: the model boundary returns fp32; O1/O4: the blocks' last linear is cast
    grad_dtype = torch.float32 if level in ("O2", "O5") else LOW[level]
    assert plain[1] == eager[1] == compiled[1] == [grad_dtype] * 3 + [torch.float32], level


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_inductor_compiled_nested_region_returns_what_eager_does():
    # The region's forward runs inside an autograd.Function (no_grad: optamp's gate cast nothing
    # there) while its backward was traced with grad mode on (cast): inductor's compiled forward
    # returned bf16 data its caller read as fp32 (values of 1e34) before the HOP ran under the
    # state of its call.
    torch.manual_seed(0)
    net = init(HopNet("region"), None, "O4")
    x = torch.randn(8, 16)
    eager_out, eager_h = net(x)
    compiled_out, compiled_h = torch.compile(net)(x)
    assert compiled_h.dtype == eager_h.dtype == torch.bfloat16
    torch.testing.assert_close(compiled_out, eager_out, **tol(torch.bfloat16))
    torch.testing.assert_close(compiled_h, eager_h, **tol(torch.bfloat16))


def _flex_qkv(dtypes):
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(2, 2, 32, 16, generator=gen).to(dt) for dt in dtypes]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_flex_attention_is_cast_as_under_native_autocast(level):
    from torch.nn.attention.flex_attention import flex_attention

    def shift(score, b, h, q, kv):
        return score + (q - kv) * 0.01

    init(torch.nn.Linear(2, 2), None, level)
    low = LOW[level]
    q, k, v = _flex_qkv([torch.float32, low, torch.float32])  # k from a cast op, q and v not
    with torch.no_grad():
        with torch.autocast("cpu", dtype=low):
            native = flex_attention(q, k, v, score_mod=shift)
        with optamp.autocast():
            ours = flex_attention(q, k, v, score_mod=shift)
        assert ours.dtype == native.dtype == low
        torch.testing.assert_close(ours, native, rtol=0, atol=0)
        # The no_grad gate: no rules, no casts; flex promotes the mixed inputs (fp32).
        assert flex_attention(q, k, v, score_mod=shift).dtype == torch.float32


def test_a_higher_order_op_defined_after_import_falls_through_optamps_keys():
    from torch._ops import HigherOrderOperator

    class Twice(HigherOrderOperator):
        def __init__(self):
            super().__init__("optamp_test_twice")

        def __call__(self, fn, x):
            return super().__call__(fn, x)

    twice = Twice()
    twice.py_impl(torch._C.DispatchKey.CompositeExplicitAutograd)(lambda fn, x: fn(fn(x)))
    twice.fallthrough(torch._C.DispatchKey.AutogradCPU)
    lin = init(torch.nn.Linear(4, 4), None, "O1")
    assert twice(lin, torch.randn(2, 4)).dtype == torch.float16


# ---- native torch.autocast(enabled=False) regions -----------------------------------------


def _rotary_angles(positions):
    """Hugging Face's rotary embedding: the angles in fp32, under autocast(enabled=False)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    with torch.autocast(device_type="cpu", enabled=False):  # "Force float32", as HF says
        return inv_freq[None, :, None].float() @ positions[None, None, :].float()


@pytest.mark.parametrize("level", LEVELS)
def test_a_native_region_that_disables_autocast_keeps_optamp_out(level):
    # Found 2026-12-05: optamp cast inside such regions, so at O1 the rotary angles of positions
    # up to 4096 came out of an fp16 matmul, up to 2.8 radians off.
    net = init(torch.nn.Linear(4, 4), None, level)
    positions = torch.arange(4096.0)
    x = torch.randn(2, 4, requires_grad=True)  # a training forward: the level's rules apply
    expected = (1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))[None, :, None].double()
    angles = _rotary_angles(positions)
    assert angles.dtype == torch.float32
    torch.testing.assert_close(angles, (expected @ positions[None, None, :].double()).float())
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    assert (x @ x.t().float()).dtype == low, "outside the region the rules apply again"

    @torch.autocast(device_type="cpu", enabled=False)
    def decorated(a):
        return a @ a.t()

    assert decorated(x.detach()).dtype == torch.float32
    with pytest.raises(RuntimeError, match="inside"):
        with torch.autocast(device_type="cpu", enabled=False):
            raise RuntimeError("inside")
    assert (x @ x.t().float()).dtype == low, "an exception leaves the region as well"
    with torch.autocast(device_type="cpu", enabled=False):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # native on: native casts
            assert (x @ x.t()).dtype == torch.bfloat16
    del net


class _RotaryBlock(torch.nn.Module):
    """A linear beside Hugging Face's rotary angles (fp32 under autocast(enabled=False)); the
    forward also returns the linear's dtype, a non-tensor value the O2/O5 boundary passes on."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, positions):
        angles = _rotary_angles(positions)
        h = self.lin(x)
        return h, angles, h.dtype


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_compiled_region_that_disables_autocast_keeps_optamp_out(fresh, level, backend):
    """Dynamo records the region in the graph and AOTAutograd enters it (optamp's wrapper) while
    it traces: the angles stay fp32 in one graph, the linear outside is cast. fullgraph also
    checks that returning ``h.dtype`` traces (it failed at O2/O5 until 2026-12-06: the
    boundary asked dataclasses.is_dataclass of it, which Dynamo cannot trace for a dtype)."""
    torch.manual_seed(0)
    net = _RotaryBlock()
    init(net, None, level)
    positions = torch.arange(4096)  # int64 position ids, as Hugging Face passes them
    compiled = torch.compile(lambda x: net(x, positions), backend=backend, fullgraph=True)
    x = torch.randn(2, 4, requires_grad=True)
    out, angles, h_dtype = compiled(x)
    assert angles.dtype == torch.float32
    assert torch.equal(angles, _rotary_angles(positions))
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    assert h_dtype == low
    eager_out, _, _ = net(x, positions)
    assert out.dtype == eager_out.dtype


# ---- torch.amp.custom_fwd / custom_bwd Functions ------------------------------------------------


def _matmul_grads(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.t(), x.t() @ grad


class _Fp32Only(torch.autograd.Function):
    """A Function whose kernel takes fp32 only, declared as torch.amp's docs say."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        assert x.dtype == torch.float32 and w.dtype == torch.float32, "an fp32-only kernel"
        assert not optamp.is_casting_enabled(), "the forward runs with casts off"
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        assert grad.dtype == torch.float32
        return _matmul_grads(ctx, grad)


class _SavesWhatItGot(torch.autograd.Function):
    """custom_fwd without cast_inputs: the backward multiplies what the forward saved."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return _matmul_grads(ctx, grad)


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_custom_fwd_functions_get_their_inputs_as_under_native_autocast(fresh, level):
    # Found 2026-12-05: custom_fwd(cast_inputs=torch.float32) asks native autocast whether to
    # cast, so under optamp an fp16 activation reached an fp32-only forward; and custom_bwd's
    # disabled region made the backward of a forward optamp had widened fail ("expected m1 and
    # m2 to have the same dtype").
    layer = torch.nn.Linear(8, 8)
    init(layer, torch.optim.SGD(layer.parameters(), lr=0.1), level)
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    for function in (_Fp32Only, _SavesWhatItGot):
        x.grad = w.grad = None
        h = x.to(low)  # an activation the level made reduced
        out = function.apply(h, w)
        # custom_fwd without cast_inputs: the forward runs under the rules of the call, its
        # matmul in the low dtype, as under native autocast (fp32 until 2026-12-07: the gate)
        assert out.dtype == (torch.float32 if function is _Fp32Only else low)
        out.sum().backward()
        with torch.no_grad():  # the references in fp32 (the no_grad gate)
            grad_x = (torch.ones(4, 8) @ w.t()).to(low).float()  # back through the cast to h
            grad_w = h.float().t() @ torch.ones(4, 8)
        torch.testing.assert_close(x.grad, grad_x, **tol(low))
        torch.testing.assert_close(w.grad, grad_w, **tol(low))
    assert optamp.is_casting_enabled() and torch.is_autocast_enabled("cpu") is False
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # native: torch's answer
        assert torch.is_autocast_enabled("cpu") is True


class _ReversibleCoupling(torch.autograd.Function):
    """A reversible block (RevNet, Reformer): the forward runs without recording (it is a
    Function's, under no_grad) and keeps only its output; the backward reconstructs the input by
    recomputing f and g under ``enable_grad`` and backpropagates through them. The gradient is
    right only if the recompute casts as the forward did."""

    @staticmethod
    def forward(ctx, x, block, *params):
        x1, x2 = x.chunk(2, dim=-1)
        f_x2 = block.f(x2)
        block.forward_dtypes.append(f_x2.dtype)
        y1 = x1 + f_x2
        y = torch.cat([y1, x2 + block.g(y1)], dim=-1)
        ctx.block = block
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        block = ctx.block
        (y1, y2), (dy1, dy2) = y.chunk(2, dim=-1), dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            g_y1 = block.g(y1)
            torch.autograd.backward(g_y1, dy2)
        with torch.no_grad():
            x2 = y2 - g_y1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            f_x2 = block.f(x2)
            torch.autograd.backward(f_x2, dx1)
        with torch.no_grad():
            block.reconstructed.append(torch.cat([y1 - f_x2, x2], dim=-1))
            dx2 = dy2 + x2.grad
        return (torch.cat([dx1, dx2], dim=-1), None) + (None,) * len(list(block.parameters()))


class _CouplingBlock(torch.nn.Module):
    def __init__(self, reversible):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.g = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.reversible, self.forward_dtypes, self.reconstructed = reversible, [], []

    def forward(self, x):
        if self.reversible:
            return _ReversibleCoupling.apply(x, self, *self.parameters())
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + self.f(x2)
        return torch.cat([y1, x2 + self.g(y1)], dim=-1)


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_custom_functions_forward_casts_as_its_call_site(fresh, level):
    # Found 2026-12-07 (Reformer, reversible layers): a Function's forward runs with grad mode
    # off, so the no_grad gate cast nothing there while its backward's recompute (enable_grad)
    # was cast: fp32 forward, fp16 recompute, an input reconstructed wrongly and gradients 104%
    # off those of the same model with plain residuals (native autocast: 33%, its recompute runs
    # outside the region in fp32). A Function called while autograd records now runs its
    # forward under the rules of the call, as native autocast and Apex cast there.
    torch.manual_seed(0)
    block = _CouplingBlock(reversible=True)
    plain = copy.deepcopy(block)
    plain.reversible = False
    init([block, plain], None, level, cast_model_inputs=False)
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    x = torch.randn(4, 16)
    grads = []
    for model in (block, plain):
        x_in = x.clone().requires_grad_()
        model(x_in).float().pow(2).sum().backward()
        grads.append([x_in.grad] + [p.grad for p in model.parameters()])
    assert block.forward_dtypes == [low]
    torch.testing.assert_close(block.reconstructed[0], x, rtol=1e-6, atol=1e-6)  # fp32 add/sub
    for reversible_grad, plain_grad in zip(*grads):
        torch.testing.assert_close(reversible_grad, plain_grad, rtol=1e-4, atol=1e-5)
    # Under no_grad (validation) and inside disable_casts the gate and the region stand.
    for context in (torch.no_grad, optamp.disable_casts):
        with context():
            block(x)
    assert block.forward_dtypes == [low, torch.float32, torch.float32]


class _ScaledReluMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.relu(x @ w) * 2 + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad, grad.sum(0)


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_compiled_custom_functions_forward_casts_as_the_eager_one(fresh, level):
    # torch.compile traces a Function's forward through torch's own ApplyTemplate Function,
    # which optamp lifts like any other, and runs the compiled graph inside AOTAutograd's
    # CompiledFunction, which it leaves alone (the casts are traced in): the compiled output and
    # gradients equal eager's (they were 1.5e-3 apart while ApplyTemplate was not lifted).
    layer = torch.nn.Linear(16, 16)
    init(layer, torch.optim.SGD(layer.parameters(), lr=0.1), level)
    b = torch.randn(16)

    def forward(x):
        return _ScaledReluMatmul.apply(x, layer.weight, b)

    def run(fn):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out = fn(x)
        out.float().sum().backward()
        return out, x.grad

    eager_out, eager_grad = run(forward)
    torch._dynamo.reset()
    compiled_out, compiled_grad = run(torch.compile(forward, backend="aot_eager"))
    assert compiled_out.dtype == eager_out.dtype
    assert torch.equal(compiled_out, eager_out) and torch.equal(compiled_grad, eager_grad)


# ---- torch.func transforms ---------------------------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_per_sample_gradients_with_torch_func_through_an_initialized_model(fresh, level):
    # vmap(grad(...)) over functional_call (per-sample gradients, as differential-privacy
    # trainers compute them) ran into "Cannot access storage of TensorWrapper" at O2/O5: the
    # boundary's fp32 output kept a companion by storage, which functorch's wrappers lack. The
    # parameters functional_call is given are not the model's registered ones: at O2/O5 a layer
    # norm gets them in fp32 beside fp16 activations, which functorch's layer-norm backward
    # refused until such calls ran widened (2026-12-05).
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def per_sample(net):
        def loss(params, xi, yi):
            out = functional_call(net, params, (xi.unsqueeze(0),))
            return F.cross_entropy(out.float(), yi.unsqueeze(0))

        params = {k: v.detach() for k, v in net.named_parameters()}
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    grads = per_sample(model)
    with optamp.disable_casts():
        expected = per_sample(reference)
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    for name, value in grads.items():
        assert value.shape == (6, *dict(model.named_parameters())[name].shape)
        row = "train_bfloat16" if low == torch.bfloat16 else "train_float16"
        torch.testing.assert_close(value.float(), expected[name], **tol(row))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_torch_func_jvp_of_an_initialized_model_computes_as_its_eager_forward(fresh, level, norm):
    # MeanFlow- and consistency-model trainers take the network's time derivative with
    # torch.func.jvp and train through its primal output. functorch hands each op a wrapper
    # around the parameters the function captures; at O2/O5 the wrappers were weighed as fp32
    # beside the fp16 activations: a layer norm widened its input, then got the fp16 working
    # copies ("mixed dtype (CPU): expect parameter to have scalar type of Float"). Now the jvp's
    # primal is the eager
    # forward bit for bit, its tangent is fp32's within the level's tolerance, and a loss on the
    # primal gives the eager loss's gradients.
    def net():
        torch.manual_seed(0)
        middle = torch.nn.LayerNorm(32) if norm else torch.nn.Tanh()
        return torch.nn.Sequential(torch.nn.Linear(8, 32), middle, torch.nn.GELU(),
                                   torch.nn.Linear(32, 8))

    reference, model = net(), net()
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)

    primal, tangent = torch.func.jvp(model, (x,), (v,))
    primal.float().pow(2).sum().backward()
    jvp_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model(x)
    eager.float().pow(2).sum().backward()

    assert torch.equal(primal, eager)
    for through_jvp, p in zip(jvp_grads, model.parameters()):
        assert torch.equal(through_jvp, p.grad)
    with optamp.disable_casts():
        _, expected = torch.func.jvp(reference, (x,), (v,))
    torch.testing.assert_close(tangent.float(), expected, **tol(train_row(level)))


# ---- TorchScript models ------------------------------------------------------------------------


def _scripted_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4))
    reference = copy.deepcopy(net)
    return torch.jit.script(net), reference


def _scripted_batch(step):
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


@pytest.mark.parametrize("before", ["nothing", "evaluated", "trained"])
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_scripted_model_trains_as_its_eager_self(fresh, level, before):
    # TorchScript's optimizer differentiates a profiled function symbolically, assuming the
    # dtypes it recorded; optamp's casts below the graph broke its second training step
    # ("expected scalar type Half but found Float" in a batch norm's backward). While casting is
    # on, the thread runs TorchScript unoptimized, and initialize drops plans made before it.
    model, reference = _scripted_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3 if before != "nothing" else 0):
        x, y = _scripted_batch(100 + step)
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            if before == "evaluated":
                with torch.no_grad():
                    net(x)
            else:
                optimizer.zero_grad()
                F.cross_entropy(net(x), y).backward()
                optimizer.step()
    init(model, opt, level)
    assert not torch._C._get_graph_executor_optimize()
    assert "AutocastXLA" not in str(torch._C._dispatch_keys(model[1].weight))  # kept fp32
    for step in range(4):
        x, y = _scripted_batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        with optamp.disable_casts():
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
        tol = 2e-2 if level in ("O4", "O5") else 2e-3
        torch.testing.assert_close(loss.detach().float(), ref_loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean,
                               rtol=2e-2, atol=2e-3)
    optamp.reset()
    assert torch._C._get_graph_executor_optimize()  # the user's setting is back


def test_a_scripted_model_is_refused_where_the_model_is_cast_in_place(fresh):
    model, _ = _scripted_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"models\[0\] is a TorchScript module .* O2/O5"):
        optamp.initialize(model, opt, opt_level="O3", verbosity=0)
    assert not optamp.is_initialized() and model[0].weight.dtype == torch.float32


def _sgd_beside_fp32(model, level, lr, **init_kw):
    """SGD for ``model`` initialized at ``level``, and an fp32 twin (a deep copy taken first)
    with its own SGD: (opt, reference, ref_opt)."""
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    init(model, opt, level, **init_kw)
    return opt, reference, ref_opt


@pytest.mark.parametrize("op_lists", ["apex", "torch"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_fp32_tensor_made_in_the_forward_reaches_reduced_norm_weights(fresh, level, op_lists):
    # O2/O3/O5 leave the fp32 list out, and the fp16 embeddings plus the fp32 encoding are fp32:
    # the layer norm met fp32 input and fp16 weights and failed ("mixed dtype (CPU): expect
    # parameter to have scalar type of Float"; CUDA's "expected scalar type") where torch.autocast
    # runs layer norms in fp32. Such a call now runs widened, at the masters' values; with
    # torch's lists, which have no CPU row for layer_norm, at O2/O5 since 2026-12-07.
    torch.manual_seed(0)
    model = SinusoidalNet()
    opt, reference, ref_opt = _sgd_beside_fp32(model, level, lr=0.1, op_lists=op_lists)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        idx = torch.randint(0, 50, (4, 12), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten())
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        with optamp.disable_casts():
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(reference(idx).flatten(0, 1), idx.flatten())
            ref_loss.backward()
            ref_opt.step()
        torch.testing.assert_close(loss.detach().float(), ref_loss.detach(),
                                   **tol(train_row(level)))
    # A submodule called directly (past the model's boundary) with fp32 input: as native.
    x = torch.randn(4, 12, 16)
    with optamp.disable_casts():
        expected = reference.body(x)
    torch.testing.assert_close(model.body(x).float(), expected, **tol(train_row(level)))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_working_copy_model_runs_its_norms_in_an_autocast_region(fresh, level, grad):
    # In an amp.autocast() region the fp32 list applies at O2/O5 too: a layer norm widened its
    # fp16 input, but substitution then handed it the fp16 working copies of its weights
    # ("mixed dtype (CPU): expect parameter to have scalar type of Float"; seen generating
    # with a KV cache under no_grad inside a region). It reads the fp32 masters now.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16), torch.nn.GroupNorm(4, 16))
    reference = copy.deepcopy(model)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
    x = torch.randn(8, 16)
    low = torch.float16 if level == "O2" else torch.bfloat16
    with torch.set_grad_enabled(grad), optamp.autocast(dtype=low):
        out = model(x)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=low):
        expected = reference(x)  # the same model under native autocast
    torch.testing.assert_close(out.float(), expected.float(), **tol(
        "train_float16" if level == "O2" else "train_bfloat16"))


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_compiled_working_copy_model_reads_its_norms_masters_in_an_autocast_region(level):
    # Where a region applies the fp32 list, eager reads the norms' fp32 masters; the compiled
    # forward's mode handed them the rounded working copies until 2026-12-08 (outputs 8.8e-4 off
    # eager's at O2, 1.1e-2 at O5; gradients 2.4e-3 and 3.1e-2). It asks the kernel's plan now.
    runs = []
    for backend in [None, "aot_eager"]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                    torch.nn.GELU(), torch.nn.Linear(16, 16),
                                    torch.nn.GroupNorm(4, 16))
        with torch.no_grad():
            model[1].weight.fill_(1 / 3)  # not exact in fp16 or bf16
        init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)
        run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
        low = torch.float16 if level == "O2" else torch.bfloat16
        with optamp.autocast(dtype=low):
            out = run(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
        out.float().sum().backward()
        runs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
        optamp.reset()
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


class _WeightedClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_model_buffer_passed_to_an_fp32_loss_reaches_it_in_fp32(fresh, level):
    # A class-weight buffer handed to cross_entropy reached the fp32 loss as its fp16 working
    # copy ("expected scalar type Float but found Half"): the loss's cast kernel left the fp32
    # buffer as it was, and substitution below it then replaced it. It gets the buffer's own
    # data now (a copy: substitution replaces any view of a registered buffer).
    torch.manual_seed(0)
    model = _WeightedClassifier()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, level)
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    loss = F.cross_entropy(model(x), y, weight=model.class_weight)
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    with optamp.disable_casts():
        expected = F.cross_entropy(reference(x), y, weight=reference.class_weight)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), expected.detach(), **tol(
        "train_float16" if level == "O2" else "train_bfloat16"))
    assert model.class_weight.dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_a_model_with_complex_weights_and_ffts_trains_at_every_level(fresh, level):
    # Two gaps a spectral model (FNO, FNet, an audio front end) fell into: FFTs of fp16/bf16
    # tensors failed ("Unsupported dtype Half": ATen has no bf16 FFT and no fp16 one on the CPU)
    # and complex parameters were refused by loss scaling (torch's GradScaler fails on them
    # too). The FFTs now run widened to fp32 at every level; complex gradients are unscaled and
    # checked as their float pairs; an inf in an imaginary part skips the step bitwise.
    torch.manual_seed(0)
    model = SpectralNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    init(model, opt, level, **({"loss_scale": "dynamic", "init_scale": 2.0**8}
                               if level in ("O1", "O2") else {}))  # 2^16 overflows a bias here
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    loss = F.mse_loss(model(x), y)
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not optamp.loss_scaler(0).last_step_skipped
    F.mse_loss(reference(x), y).backward()
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    assert model.modes.dtype == torch.complex64
    torch.testing.assert_close(model.modes.grad, reference.modes.grad,
                               **tol("train_" + str(low).split(".")[1]))
    opt.step()
    stepped = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with optamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
        torch.view_as_real(model.modes.grad)[0, 1, 2, 1] = float("inf")
    assert optamp.loss_scaler(0).last_step_skipped
    opt.step()
    for before, after in zip(stepped, model.parameters()):
        assert torch.equal(before, after.detach())


def _one_step_matches_fp32(model, level, x, y, **init_kw):
    """One SGD step's loss and every gradient of ``model`` at ``level`` against an fp32 twin
    (a deep copy taken first), within the level's training tolerance; the step not skipped."""
    opt, reference, _ = _sgd_beside_fp32(model, level, 0.05, **init_kw)
    loss = F.mse_loss(model(x), y)
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not optamp.loss_scaler(0).last_step_skipped
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    row = train_row(level)
    torch.testing.assert_close(loss.detach(), expected.detach(), **tol(row))
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **tol(row), msg=name)
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_state_space_model_makes_its_complex_values_in_complex64(fresh, level):
    # S4D-style layers keep complex parameters as real pairs and make them complex in the forward.
    # At O2 the fp16 working copies made complex32 values (`view_as_complex` of the fp16 copy,
    # `1j * a_imag`), which the CPU cannot exponentiate ("exp_vml_cpu" not implemented for
    # 'ComplexHalf'); at O5 `view_as_complex` of the bf16 copy failed (there is no complex bf16).
    # view_as_complex and complex now widen reduced input, and a call with a complex argument
    # reads the fp32 masters: the kernel is computed in complex64 from the masters' values, as
    # native autocast computes it. (O3's model is fp16 itself: its complex values are complex32,
    # as under Apex's O3.)
    torch.manual_seed(0)
    model = DiagonalStateSpaceNet()
    # 2^16 overflows the one-output projection's weight gradient (48 positions summed in fp16)
    _one_step_matches_fp32(model, level, torch.randn(3, 16), torch.randn(3, 16),
                           **({"loss_scale": "dynamic", "init_scale": 2.0**8}
                              if level in ("O1", "O2") else {}))
    # The state matrix's imaginary parts (multiples of pi) enter the kernel as the masters' values:
    # bf16 would round 3 * pi to 9.4375.
    with torch.enable_grad():
        a = 1j * model.a_imag
    assert a.dtype == torch.complex64
    assert torch.equal(a.imag, model.a_imag.detach())
    assert torch.view_as_complex(model.c).dtype == torch.complex64


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_linear_recurrent_unit_trains_in_complex64(fresh, level):
    # The LRU's eigenvalues are `exp(-exp(nu_log) + 1j * exp(theta_log))`. At O2 the exp of the
    # fp16 working copy is an fp16 activation, and torch makes complex32 of fp16 and 1j (of bf16
    # it makes complex64): the exp of it failed ("exp_vml_cpu" not implemented for 'ComplexHalf').
    # A promote call (Apex's lists) now widens fp16 meeting a complex value.
    torch.manual_seed(0)
    _one_step_matches_fp32(LinearRecurrentNet(), level, torch.randn(3, 8, 2), torch.randn(3, 8))


@pytest.mark.parametrize("level", LEVELS)
def test_linear_algebra_of_reduced_tensors_runs_widened_at_every_level(fresh, level):
    # ATen has no fp16/bf16 decompositions, solvers, determinants or (on the CPU) cdist: the
    # flow's slogdet of an fp16 working copy failed at O2/O3/O5 ("Low precision dtypes not
    # supported"), the Householder product at O2/O3/O5 ("orgqr_cpu" not implemented for 'Half'),
    # the cdist of an fp16 activation at every level. They run widened to fp32 now.
    torch.manual_seed(0)
    model = LinalgNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, level)
    x = torch.randn(5, 4, 2)
    loss = model(x)
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not optamp.loss_scaler(0).last_step_skipped
    reference(x).backward()
    low = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    row = "train_" + str(low).split(".")[1]
    torch.testing.assert_close(loss.detach(), reference(x).detach(), **tol(row))
    torch.testing.assert_close(model.mix.grad.float(), reference.mix.grad, **tol(row))  # O3: fp16


@pytest.mark.parametrize("level", LEVELS)
def test_an_orthogonal_parametrization_trains_at_every_level(fresh, level):
    # orthogonal()'s default map for a square weight is the matrix exponential, whose fp16/bf16
    # CPU kernel returns NaN (torch 2.11). At O2/O3/O5 its input comes from the reduced working
    # copy: until 2026-12-06 every O2 step was skipped (29 of 30) and O5's forward went NaN from
    # the second step. matrix_exp runs widened to fp32 now, as the decompositions do.
    torch.manual_seed(0)
    model = orthogonal_classifier()
    opt, reference, ref_opt = _sgd_beside_fp32(model, level, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        with optamp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not optamp.loss_scaler(0).last_step_skipped
        ref_opt.zero_grad()
        with optamp.disable_casts():
            F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().float(), r.detach(), **tol(train_row(level)))


def _distribution_heads(a, b):
    """Scalar terms of torch.distributions' families over two linears' outputs (``a`` as
    locations and logits, ``softplus(a)`` as scales and concentrations, ``b`` as values): the
    heads of VAEs, policies and mixture density networks."""
    d = torch.distributions
    pos = F.softplus(a) + 0.1
    value = b.detach()
    return {
        "Normal": lambda: (d.Normal(a, pos).rsample().sum() + d.Normal(a, pos).log_prob(value).sum()
                           + d.kl_divergence(d.Normal(a, pos), d.Normal(0.0, 1.0)).sum()),
        "Beta": lambda: (d.Beta(pos, pos).rsample().sum()
                         + d.Beta(pos, pos).log_prob(torch.full_like(pos, 0.5)).sum()),
        "Gamma": lambda: d.Gamma(pos, pos).rsample().sum() + d.Gamma(pos, pos).entropy().sum(),
        "Dirichlet": lambda: (d.Dirichlet(pos).rsample().sum()
                              + d.Dirichlet(pos).log_prob(value.float().softmax(-1)).sum()),
        "Categorical": lambda: (d.Categorical(logits=a).entropy().sum()
                                + d.Categorical(logits=a).log_prob(torch.zeros(len(a),
                                                                               dtype=torch.long)).sum()),
        "RelaxedOneHotCategorical": lambda: d.RelaxedOneHotCategorical(
            torch.tensor(0.5), logits=a).rsample().sum(),
        "MultivariateNormal": lambda: d.MultivariateNormal(
            a, scale_tril=torch.diag_embed(pos)).log_prob(value).sum(),
        "StudentT": lambda: d.StudentT(pos + 2, a, pos).rsample().sum(),
        "Binomial": lambda: (d.Binomial(5, logits=a).log_prob(torch.ones_like(a)).sum()
                             + d.Binomial(5, logits=a).sample().sum()),
        "Kumaraswamy": lambda: d.Kumaraswamy(pos, pos).rsample().sum(),
        "TanhNormal": lambda: d.TransformedDistribution(
            d.Normal(a, pos), [d.transforms.TanhTransform()]).rsample().sum(),
        "MixtureSameFamily": lambda: d.MixtureSameFamily(
            d.Categorical(logits=a), d.Normal(a, pos)).log_prob(value[:, 0]).sum(),
    }


class _DistributionHead(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        self.loc, self.value, self.family = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), family

    def forward(self, x):
        return _distribution_heads(self.loc(x), self.value(x))[self.family]()


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O4", "O5"])
def test_distribution_heads_train_at_every_level(fresh, level):
    """torch.distributions' families with parameters from a model's linears (reduced at O2/O3/O5
    and where a lower op made them at O1/O4): sampling, rsample, log_prob, entropy, KL. The
    samplers the CPU has no reduced kernel for (Gamma, Beta, Dirichlet, Binomial) failed at
    O2/O3/O5 until 2026-12-06 (docs/casting.md, "On the CPU only"). One step each: it runs, its
    loss is finite, it is not skipped (a fixed scale of 64 at O1/O2: the step is checked, not
    the scale)."""
    failures = []
    for family in _distribution_heads(torch.zeros(1, 3), torch.zeros(1, 3)):
        optamp.reset()
        torch.manual_seed(0)
        model = _DistributionHead(family)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        init(model, opt, level, **({"loss_scale": 64.0} if level in ("O1", "O2") else {}))
        try:
            loss = model(torch.randn(5, 4)).float()
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if not torch.isfinite(loss) or optamp.loss_scaler().last_step_skipped:
                failures.append(f"{family}: loss {loss.item()}, skipped")
        except (RuntimeError, NotImplementedError) as e:
            failures.append(f"{family}: {str(e).splitlines()[0]}")
    assert not failures, failures
