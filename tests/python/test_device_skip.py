"""Steps that never wait for the device with optimizers that skip on it (torch's fused=True
Adam/AdamW/SGD): no host read during steps at O1-O5, an injected inf skipped bit-exactly, the
same training as the host-skipping path, several guards before one step, and on a GPU no
device->host sync at all (the C++ twin: tests/cpp/test_device_skip.cpp)."""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optamp
from common_utils import Mlp, init, tol

LEVELS = ["O1", "O2", "O3", "O4", "O5"]
HOST_READS = ("_local_scalar_dense", "is_nonzero", "item")


class ScalarReads(TorchDispatchMode):
    """Counts the top-level ops that read a tensor's value on the host (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def fused(kind, params, device_kw="fused"):
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, eps=1e-4, **{device_kw: True})
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, **{device_kw: True})
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, **{device_kw: True})


def batch(i, device="cpu"):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 4, generator=g).to(device)


def train_step(model, opt, i, device="cpu", poison=False, x=None):
    opt.zero_grad()
    x = batch(i, device) if x is None else x
    with optamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
        if poison:
            model.fc1.weight.grad[0, 0] = float("inf")
    opt.step()


def setup(level, kind, device="cpu", host_skip=False):
    model = Mlp().to(device)
    if host_skip:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, foreach=False)
    else:
        opt = fused(kind, model.parameters())
    model, opt = init(model, opt, opt_level=level)
    train_step(model, opt, 0, device)  # first step: state and caches get created
    return model, opt


def snapshot(model, opt):
    state = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return [p.detach().clone() for p in model.parameters()], state


def bit_equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("level", LEVELS)
def test_steps_read_nothing_on_the_host_with_a_fused_optimizer(fresh, level, kind):
    model, opt = setup(level, kind)
    scaler = optamp.loss_scaler()
    waits = scaler.host_waits
    with ScalarReads() as mode:
        for i in range(1, 5):
            train_step(model, opt, i)
    assert mode.reads == []
    assert scaler.host_waits == waits
    # Read afterwards, the results wait for the device and are right.
    assert scaler.skipped_steps == 0 and not scaler.last_step_skipped
    assert scaler.loss_scale() == scaler.scale_tensor.item()
    assert not hasattr(opt, "found_inf"), "the flag is dropped after the step"


@pytest.mark.parametrize("level", LEVELS)
def test_a_host_skipping_optimizer_waits_once_per_step(fresh, level):
    model, opt = setup(level, None, host_skip=True)
    scaler = optamp.loss_scaler()
    waits = scaler.host_waits
    for i in range(1, 5):
        train_step(model, opt, i)
    assert scaler.host_waits - waits == (4 if scaler.checks_overflow else 0)


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("level", LEVELS)
def test_injected_inf_is_skipped_on_the_device_bit_exactly(fresh, level, kind):
    model, opt = setup(level, kind)
    scaler = optamp.loss_scaler()
    train_step(model, opt, 1)
    params, state = snapshot(model, opt)
    scale = scaler.loss_scale()
    train_step(model, opt, 2, poison=True)
    assert model.fc1.weight.grad is not None, "the device skips; the host resets nothing"
    after_params, after_state = snapshot(model, opt)
    assert bit_equal(after_params, params)
    assert bit_equal(after_state, state), "moments and step counts unchanged"
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert scaler.loss_scale() == (scale / 2 if scaler.dynamic else scale)
    train_step(model, opt, 3)
    assert not scaler.last_step_skipped
    assert not bit_equal(snapshot(model, opt)[0], params)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_device_skip_trains_like_the_host_skip(fresh, level):
    """The same run, with one overflow, through fused AdamW (skips on the device) and the plain
    AdamW loop (the guard skips on the host): same parameters within float32 rounding."""
    results = []
    for use_fused in (True, False):
        optamp.reset()
        torch.manual_seed(0)
        model = Mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=use_fused,
                                foreach=False if not use_fused else None)
        model, opt = init(model, opt, opt_level=level)
        for i in range(6):
            train_step(model, opt, i, poison=(i == 2))
        results.append([p.detach().clone() for p in model.parameters()])
        assert optamp.loss_scaler().skipped_steps == 1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dampening", [0.0, 0.5])
@pytest.mark.parametrize("level", ["O1", "O2", "O4"])
def test_fused_sgd_through_a_skipped_first_step(fresh, level, dampening):
    """torch's SGD(fused=True) keeps the empty_like momentum buffers of a first step that
    found_inf skipped (uninitialized memory for the next step). Under a guard the first step's
    buffers are zeros (dampening 0, no host read) or not made at all (damped: the flag is read
    once), and the run trains as the host-skipping SGD loop does."""
    results = []
    for use_fused in (True, False):
        optamp.reset()
        torch.manual_seed(0)
        model = Mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=dampening,
                              weight_decay=1e-4, fused=use_fused,
                              foreach=False if not use_fused else None)
        model, opt = init(model, opt, opt_level=level)
        before = [p.detach().clone() for p in model.parameters()]
        with optamp.scale_loss(model(batch(0)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            model.fc1.weight.grad[0, 0] = float("inf")
        if use_fused and dampening == 0:  # made by the guard, before torch's step could
            buffers = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
            assert all(b is not None and torch.count_nonzero(b) == 0 for b in buffers)
        opt.step()
        assert bit_equal([p.detach() for p in model.parameters()], before)
        if dampening != 0:
            assert all(s.get("momentum_buffer") is None for s in opt.state.values()), \
                "a skipped damped first step makes no buffers"
        for i in range(1, 4):
            train_step(model, opt, i)
        results.append([p.detach().clone() for p in model.parameters()])
        assert optamp.loss_scaler().skipped_steps == 1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level, warns", [("O3", True), ("O1", False), ("O2", False)])
def test_fused_sgd_with_reduced_precision_cpu_parameters_warns(fresh, level, warns):
    """torch 2.11's fused CPU SGD kernel leaves fp16/bf16 parameters of 16 elements or more
    unchanged (the O3 run below would not train): initialize says so, naming the optimizer."""
    from optamp.frontend import _fused_sgd_leaves_cpu_params

    # initialize asks the kernel: a torch that is fixed gets no warning.
    warns = warns and _fused_sgd_leaves_cpu_params(torch.float16)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init(model, opt, opt_level=level)
    said = [str(w.message) for w in caught if "fused CPU kernel" in str(w.message)]
    if warns:
        assert len(said) == 1 and said[0].startswith("optimizer 0 (SGD with fused=True)"), said
        before = model.fc1.weight.detach().clone()
        train_step(model, opt, 1)
        assert torch.equal(model.fc1.weight, before), "what the warning is about"
    else:
        assert said == []


def test_an_overflow_in_any_guard_before_the_step_skips_it(fresh):
    model, opt = setup("O1", "adam")
    before = snapshot(model, opt)
    opt.zero_grad()
    with optamp.scale_loss(model(batch(1)).pow(2).mean(), opt) as scaled:
        scaled.backward()
        model.fc2.bias.grad[0] = float("inf")
    with optamp.scale_loss(model(batch(2)).pow(2).mean(), opt) as scaled:  # clean, accumulates
        scaled.backward()
    opt.step()
    assert bit_equal(snapshot(model, opt)[0], before[0])
    assert optamp.loss_scaler().skipped_steps == 1, "the stash's inf is not counted twice"
    train_step(model, opt, 3)
    assert not bit_equal(snapshot(model, opt)[0], before[0]), "the flag was consumed"


def test_a_guard_over_a_fused_and_a_plain_optimizer_skips_on_the_host(fresh):
    model = Mlp()
    opt_a = torch.optim.Adam(model.fc1.parameters(), lr=1e-3, fused=True)
    opt_b = torch.optim.Adam(model.fc2.parameters(), lr=1e-3)
    model, [opt_a, opt_b] = init(model, [opt_a, opt_b], opt_level="O1")
    waits = optamp.loss_scaler().host_waits
    with optamp.scale_loss(model(batch(0)).pow(2).mean(), [opt_a, opt_b]) as scaled:
        scaled.backward()
        model.fc1.weight.grad[0, 0] = float("inf")
    assert optamp.loss_scaler().host_waits - waits == 1
    assert model.fc1.weight.grad is None, "the host skip resets the grads"
    assert not hasattr(opt_a, "found_inf")


@pytest.mark.needs_cuda
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_steps_with_a_fused_optimizer_never_sync(fresh, level, kind):
    model, opt = setup(level, kind, device="cuda")
    # The inputs go to the GPU first: copying a pageable CPU tensor to the device is itself a
    # synchronizing copy (the first GPU run counted it, one per step, as optamp's).
    inputs = [batch(i, "cuda") for i in range(1, 4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, x in enumerate(inputs, start=1):
                train_step(model, opt, i, device="cuda", x=x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []
    assert optamp.loss_scaler().skipped_steps == 0


@pytest.mark.needs_cuda
@pytest.mark.parametrize("forward_before_capture", [False, True])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_cuda_graph_replays_match_eager_steps_bit_for_bit(fresh, level, forward_before_capture):
    """The recipe of docs/loss_scaling.md ("CUDA graphs"): the whole step (forward, scale_loss,
    backward, fused step) captured once and replayed gives the eager run's parameters and scale,
    bit for bit. With an eager forward on the default stream just before the capture, its cached
    copies (which hold the parameters' grad accumulators, made on that stream) are released
    before the capture makes its own: had the capture's copies taken those nodes over, the
    captured backward would accumulate on the default stream (torch warns of an AccumulateGrad
    node kept alive from before the iteration, and the capture breaks)."""
    batches = [batch(i, "cuda") for i in range(7)]

    def build():
        torch.manual_seed(0)
        model = Mlp().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
        return init(model, opt, opt_level=level)

    def make_step(model, opt, x):
        def step(zero_grad=True):
            with optamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            if zero_grad:
                opt.zero_grad(set_to_none=True)
        return step

    model, opt = build()
    for b in batches:
        make_step(model, opt, b)()
    eager = [p.detach().clone() for p in model.parameters()]
    eager_scale = optamp.loss_scaler().scale_tensor.clone()
    optamp.reset()

    model, opt = build()
    static_x = batches[0].clone()
    step = make_step(model, opt, static_x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in batches[:3]:
            static_x.copy_(b)
            step()
    torch.cuda.current_stream().wait_stream(side)
    if forward_before_capture:
        model(static_x).float().sum()  # a forward with grad, never stepped: its copies stay cached
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            step(zero_grad=False)
        for b in batches[3:]:
            static_x.copy_(b)
            graph.replay()
        torch.cuda.synchronize()
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager))
    assert torch.equal(optamp.loss_scaler().scale_tensor, eager_scale)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_make_graphed_callables_trains_as_the_eager_model(fresh, level):
    """``torch.cuda.make_graphed_callables`` captures the forward and backward after eager warm-up
    passes of the same step, and the optimizer steps eagerly. The captured forward must make its
    own working copies (a copy made by a warm-up pass would be baked into the graph and never
    refreshed by a step: the replays would train stale weights) and the eager code after the
    capture must not be served the capture's copies, which hold nothing until a replay.
    Its CPU twin: ``Initialize.O2CopiesAreServedOnlyInTheCaptureTheyWereMadeIn`` (C++)."""
    batches = [batch(i, "cuda") for i in range(6)]

    def build():
        torch.manual_seed(0)
        model = Mlp().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return init(model, opt, opt_level=level)

    def train(forward, opt):
        for x in batches:
            opt.zero_grad(set_to_none=True)
            with optamp.scale_loss(forward(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()

    model, opt = build()
    train(model, opt)
    eager = [p.detach().clone() for p in model.parameters()]
    optamp.reset()

    model, opt = build()
    graphed = torch.cuda.make_graphed_callables(model, (batches[0].clone(),))
    train(graphed, opt)
    # What the replays compute now is a forward of the stepped masters: the eager forward (the
    # graphed module runs its own forward in eval mode; this Mlp has nothing eval changes).
    # Copies made before the capture would still hold the first weights.
    low = torch.float16 if level == "O2" else torch.bfloat16  # the model's compute dtype
    x = batches[0]
    replayed = graphed(x).detach().clone()
    model.eval()
    eager_now = model(x).detach()
    torch.testing.assert_close(replayed, eager_now, **tol(low))
    row = "train_float16" if low == torch.float16 else "train_bfloat16"
    for got, want in zip(model.parameters(), eager):  # and it trains as the eager model did
        torch.testing.assert_close(got.detach(), want, **tol(row))



class WrappingOptimizer(torch.optim.Optimizer):
    """An optimizer wrapper as Accelerate's AcceleratedOptimizer and torch's
    PostLocalSGDOptimizer are: an Optimizer subclass that skips Optimizer.__init__ (so it has no
    step hooks) and steps the optimizer it wraps."""

    def __init__(self, optimizer):  # pylint: disable=super-init-not-called
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("kind", ["adam", None])  # None: foreach AdamW, skipped on the host
def test_a_wrapper_without_step_hooks_skips_through_the_optimizer_it_wraps(fresh, level, kind):
    # Before 2026-12-06 the first overflow raised AttributeError ('_optimizer_step_pre_hooks')
    # from the guard's skip hook, after the backward; and a fused optimizer behind a wrapper
    # was never handed found_inf.
    model = Mlp()
    inner = (fused(kind, model.parameters()) if kind else
             torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, foreach=True))
    model, opt = init(model, WrappingOptimizer(inner), opt_level=level)
    train_step(model, opt, 0)
    scaler = optamp.loss_scaler()
    waits = scaler.host_waits
    before = snapshot(model, inner)
    with ScalarReads() as mode:
        opt.zero_grad()
        with optamp.scale_loss(model(batch(1)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            model.fc2.bias.grad[0] = float("inf")
        with optamp.scale_loss(model(batch(2)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()  # a clean guard refills the grads: the hook must still skip
        opt.step()
    assert mode.reads == []
    assert scaler.host_waits - waits == (0 if kind else 2), "fused: skipped on the device"
    assert bit_equal(snapshot(model, inner)[0], before[0])
    assert bit_equal(snapshot(model, inner)[1], before[1])
    assert scaler.skipped_steps == 1
    train_step(model, opt, 3)
    assert not bit_equal(snapshot(model, inner)[0], before[0])


def test_a_wrapper_that_hides_its_optimizer_is_refused_before_anything_changes(fresh):
    class Opaque(WrappingOptimizer):
        def __init__(self, optimizer):  # pylint: disable=super-init-not-called
            self.optimizer = optimizer
            self._groups = [dict(g) for g in optimizer.param_groups]  # copies, not the same list

        @property
        def param_groups(self):
            return self._groups

    refusal = "optimizer Opaque subclasses torch.optim.Optimizer without running Optimizer.__init__"
    model = Mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=refusal):
        init(model, Opaque(inner), opt_level="O1")
    assert not optamp.is_initialized()
    model, inner = init(model, inner, opt_level="O1")
    loss = model(batch(0)).pow(2).mean()
    with pytest.raises(TypeError, match=refusal):
        with optamp.scale_loss(loss, Opaque(inner)) as scaled:
            scaled.backward()
    assert all(p.grad is None for p in model.parameters()), "refused before the backward"
    assert optamp.loss_scaler().loss_scale() == 65536.0


class DictCopyingWrapper:
    """An optimizer wrapper as Lightning's LightningOptimizer is: a class made for the wrapped
    optimizer's class that subclasses it, with a copy of that optimizer's ``__dict__`` (its step
    hooks and ``param_groups``: the same objects) and the optimizer in ``_optimizer``, whose
    ``step`` its own runs."""

    def __init__(self, optimizer):
        self.__class__ = type("Wrapped" + type(optimizer).__name__,
                              (DictCopyingWrapper, type(optimizer)), {})
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k != "step"}
        self._optimizer = optimizer

    def step(self, closure=None):
        return self._optimizer.step(closure)


@pytest.mark.parametrize("order", ["wrapped_after_initialize", "wrapped_before"])
@pytest.mark.parametrize("kind", ["adam", None])  # None: foreach AdamW, skipped on the host
def test_a_wrapper_with_a_copy_of_the_optimizers_dict_skips_through_it(fresh, order, kind):
    # Lightning's manual optimization: initialize in configure_optimizers, then
    # self.optimizers() is a LightningOptimizer. It has step hooks (copied references), so
    # before 2026-12-06 optamp took it for the optimizer itself and scale_loss refused it
    # ("must be an optimizer passed to amp::initialize").
    model = Mlp()
    inner = (fused(kind, model.parameters()) if kind else
             torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, foreach=True))
    if order == "wrapped_before":
        model, opt = init(model, DictCopyingWrapper(inner), opt_level="O2")
    else:
        model, _ = init(model, inner, opt_level="O2")
        opt = DictCopyingWrapper(inner)
    train_step(model, opt, 0)
    waits = optamp.loss_scaler().host_waits
    before = snapshot(model, inner)
    train_step(model, opt, 1, poison=True)
    assert optamp.loss_scaler().host_waits - waits == (0 if kind else 1), "fused: on the device"
    assert optamp.loss_scaler().last_step_skipped
    assert bit_equal(snapshot(model, inner)[0], before[0])
    assert bit_equal(snapshot(model, inner)[1], before[1])
    train_step(model, opt, 2)
    assert not bit_equal(snapshot(model, inner)[0], before[0])


def test_a_wrapper_made_after_initialize_is_the_optimizer_given_there(fresh):
    # accelerate's order: initialize, then accelerator.prepare(model, optimizer) wraps the
    # optimizer. Before 2026-12-06 scale_loss refused the wrapper ("must be an optimizer passed
    # to amp::initialize").
    model = Mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    model, inner = init(model, inner, opt_level="O2")
    opt = WrappingOptimizer(inner)
    train_step(model, opt, 0)
    before = snapshot(model, inner)
    train_step(model, opt, 1, poison=True)
    assert optamp.loss_scaler().last_step_skipped
    assert bit_equal(snapshot(model, inner)[0], before[0])
    train_step(model, inner, 2)  # the wrapped optimizer itself, as before
    assert not bit_equal(snapshot(model, inner)[0], before[0])
