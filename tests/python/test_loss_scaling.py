"""Loss scaling from Python: a differential test against torch.amp.GradScaler, the
optamp.scale_loss context manager, the torch.ops.optamp kernels, errors and state_dict."""
import math
import weakref

import pytest
import torch

import optamp
from optamp import _C

GROWTH_INTERVAL = 3


@pytest.fixture(autouse=True)
def _fresh_scalers():
    _C.reset_loss_scalers()
    yield
    _C.reset_loss_scalers()


def configure(**overrides):
    overrides.setdefault("verbosity", 0)
    _C.configure_loss_scalers(optamp.resolve("O1", **overrides))


# float64: a parameter kept in double (torch.amp trains it; optamp refused it until 2026-12-07).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_torch_grad_scaler_trajectory_and_unscaled_grads_bitwise(dtype):
    configure(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
              growth_interval=GROWTH_INTERVAL, hysteresis=1, max_loss_scale=2.0**60)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=GROWTH_INTERVAL)
    gen = torch.Generator().manual_seed(7)
    shapes = [(7, 5), (5,), (1,), (33, 3)]
    ours = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
    theirs = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
    opt_ours = torch.optim.SGD(ours, lr=0.0)
    opt_theirs = torch.optim.SGD(theirs, lr=0.0)
    bad_steps = {2: math.inf, 3: math.nan, 4: -math.inf, 11: math.inf, 12: math.inf, 20: math.nan}
    for step in range(30):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        if step in bad_steps:
            grads[step % len(grads)].view(-1)[0] = bad_steps[step]
        scale_before = scaler.get_scale()
        assert optamp.loss_scaler().loss_scale() == scale_before
        # optamp: the loss sum(p * g) gives p.grad = scale * g exactly.
        for p in ours:
            p.grad = None
        loss = sum((p * g).sum() for p, g in zip(ours, grads))
        with optamp.scale_loss(loss, opt_ours) as scaled:
            scaled.backward()
        # torch: the same scaled grads, then unscale_ / step / update.
        for p, g in zip(theirs, grads):
            p.grad = scaler.scale(g)
        scaler.unscale_(opt_theirs)
        found = sum(v.item() for v in scaler._per_optimizer_states[id(opt_theirs)]
                    ["found_inf_per_device"].values())
        assert optamp.loss_scaler().last_step_skipped == bool(found), step
        if not found:
            for a, b in zip(ours, theirs):
                assert torch.equal(a.grad, b.grad), step
        else:
            assert all(p.grad is None for p in ours)
        scaler.step(opt_theirs)
        scaler.update()
        assert optamp.loss_scaler().loss_scale() == scaler.get_scale(), step
        assert torch.equal(optamp.loss_scaler().scale_tensor.reshape(1), scaler._scale.reshape(1))
    assert optamp.loss_scaler().skipped_steps == len(bad_steps)


def test_python_optimizers_skip_overflowing_steps():
    configure()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with optamp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    with optamp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
        model.weight.grad[0, 0] = float("nan")
    assert optamp.loss_scaler().last_step_skipped
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, state[k][n])


@pytest.mark.parametrize("pattern", ["two_losses", "accumulation"])
def test_an_earlier_guards_overflow_skips_the_plain_step_as_in_apex(pattern):
    configure(num_losses=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs = [torch.randn(8, 4) for _ in range(3)]
    ids = [0, 1, 1] if pattern == "two_losses" else [0, 0, 0]
    before = [p.detach().clone() for p in model.parameters()]
    for i, (x, loss_id) in enumerate(zip(xs, ids)):
        with optamp.scale_loss(model(x).pow(2).mean(), opt, loss_id=loss_id) as scaled:
            scaled.backward()
            if i == 0:
                model.weight.grad[1, 2] = float("inf")
    assert not optamp.loss_scaler(ids[-1]).last_step_skipped
    assert all(p.grad is not None for p in model.parameters()), "refilled by later guards"
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert not opt.state, "momentum buffers must not have been created"
    # One-shot: the next clean step runs.
    with optamp.scale_loss(model(xs[0]).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_accumulation_with_and_without_delay_unscale_equals_unscaled_sum():
    configure()
    torch.manual_seed(0)
    xs = [torch.randn(5, 4) for _ in range(3)]
    ref = torch.nn.Linear(4, 2)
    for x in xs:
        ref(x).pow(2).mean().backward()
    for delay in (True, False):
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(ref.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, x in enumerate(xs):
            with optamp.scale_loss(model(x).pow(2).mean(), opt,
                                   delay_unscale=delay and i < 2) as scaled:
                scaled.backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            # Bitwise: power-of-two scaling commutes with fp32 rounding.
            assert torch.equal(p.grad, r.grad), delay


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real one-process gloo group whose all_reduce is replaced by a stand-in for the other
    ranks: ``remote[0]`` is their overflow flag (1 or 0). Yields (group, calls, remote)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls, remote = [], [0.0]

    def all_reduce(tensor, op=None, group=None):
        assert op == dist.ReduceOp.MAX and group is dist.group.WORLD
        calls.append((tensor.device, tensor.dtype, tuple(tensor.shape)))
        tensor.clamp_(min=remote[0])

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    try:
        yield dist.group.WORLD, calls, remote
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("remote_overflow", [True, False])
def test_process_group_flag_skips_on_a_remote_overflow_with_any_grad_layout(
        one_rank_group, remote_overflow):
    """scale_loss(process_group=): the scaler's found-inf flag itself (a float32 one-element
    tensor on the scale's device) is max-reduced before the scale update; no second check of
    the grads in Python, any gradient layout."""
    group, calls, remote = one_rank_group
    remote[0] = float(remote_overflow)
    configure()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with optamp.scale_loss(model(torch.randn(2, 4)).sum(), opt, process_group=group) as scaled:
        scaled.backward()
        grad = model.weight.grad  # same values, column-major
        model.weight.grad = grad.t().contiguous().t()
    opt.step()
    assert calls == [(torch.device("cpu"), torch.float32, (1,))]
    assert optamp.loss_scaler().last_step_skipped == remote_overflow
    assert optamp.loss_scaler().loss_scale() == (2.0**15 if remote_overflow else 2.0**16)
    changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    assert changed == [not remote_overflow] * 2
    # Per call only: the next guard without process_group reduces nothing.
    assert not optamp.loss_scaler().has_found_inf_reducer
    opt.zero_grad()
    with optamp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()
    assert len(calls) == 1


def test_initialize_process_group_reduces_every_step_of_every_scaler(one_rank_group):
    group, calls, remote = one_rank_group
    optamp.reset()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        optamp.initialize(model, opt, opt_level="O4", loss_scale="dynamic", num_losses=2,
                          verbosity=0, process_group=group)
        for loss_id in (0, 1):
            assert optamp.loss_scaler(loss_id).has_found_inf_reducer
        skipped = []
        for step in range(3):
            remote[0] = 1.0 if step == 1 else 0.0
            opt.zero_grad()
            with optamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            skipped.append(optamp.loss_scaler().last_step_skipped)
        assert skipped == [False, True, False] and len(calls) == 3
        optamp.reset()  # the scalers and their reducers go; a new initialize starts clean
        optamp.initialize(model, opt, opt_level="O4", loss_scale="dynamic", verbosity=0)
        assert not optamp.loss_scaler().has_found_inf_reducer
    finally:
        optamp.reset()


def test_zero_overlapped_with_ddp_is_refused(one_rank_group):
    # overlap_with_ddp steps each bucket's parameters inside DDP's backward, on the scaled
    # gradients, before the guard could unscale or check them (torch's GradScaler cannot skip it
    # either).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(4, 3)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                  overlap_with_ddp=True)
    optamp.reset()
    try:
        with pytest.raises(ValueError, match=r"optimizer 0 \(ZeroRedundancyOptimizer\) has "
                           "overlap_with_ddp=True: it steps inside DDP's backward"):
            optamp.initialize(model, opt, opt_level="O1", verbosity=0)
        assert not optamp.is_initialized()
    finally:
        optamp.reset()


def test_process_group_must_be_a_process_group():
    configure()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed"
                                        ".ProcessGroup .* got str"):
        with optamp.scale_loss(model(torch.ones(1, 2)).sum(), opt, process_group="world"):
            pass
    optamp.reset()
    with pytest.raises(TypeError, match="got int"):
        optamp.initialize(model, opt, opt_level="O1", verbosity=0, process_group=3)
    assert not optamp.is_initialized()  # nothing changed
    configure()
    with pytest.raises(TypeError, match="found_inf reducer must be callable or None, got int"):
        _C.loss_scaler().set_found_inf_reducer(3)
    assert not _C.loss_scaler().has_found_inf_reducer


def test_exception_inside_the_context_propagates_and_releases_the_guard():
    configure()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyError):
        with optamp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as scaled:
            scaled.backward()
            raise KeyError("boom")
    with optamp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as scaled:
        scaled.backward()
    assert model.weight.grad is not None


def test_errors_are_python_exceptions_with_clear_messages():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match="call amp::initialize first"):
        with optamp.scale_loss(loss, opt):
            pass
    configure(num_losses=2)
    with pytest.raises(ValueError, match=r"loss_id must be in \[0, 2\)"):
        with optamp.scale_loss(loss, opt, loss_id=2):
            pass
    with pytest.raises(ValueError, match="floating-point tensor with at least one element"):
        with optamp.scale_loss(torch.ones(0, requires_grad=True), opt):
            pass
    with pytest.raises(ValueError, match="floating-point tensor"):
        with optamp.scale_loss(torch.ones(3, dtype=torch.long), opt):
            pass
    with pytest.raises(ValueError, match="grad_fn"):
        with optamp.scale_loss(loss.detach(), opt):
            pass
    with pytest.raises(ValueError, match="scale_loss must be entered with grad mode on"):
        with torch.no_grad(), optamp.scale_loss(loss, opt):
            pass
    with pytest.raises(ValueError, match="at least one parameter"):
        with optamp.scale_loss(loss, []):
            pass
    with optamp.scale_loss(loss, opt) as scaled:
        with pytest.raises(RuntimeError, match="must not be nested"):
            with optamp.scale_loss(loss, opt):
                pass
        scaled.backward()
    assert optamp.loss_scaler(0).loss_scale() == 2.0**16


def test_state_dict_round_trip_is_bit_exact_and_validated():
    configure(num_losses=2, init_scale=3.0, hysteresis=2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for loss_id in (0, 1, 1):
        with optamp.scale_loss(model(torch.ones(1, 2)).sum() * math.inf, opt,
                               loss_id=loss_id) as scaled:
            scaled.backward()
    saved = optamp.state_dict()
    assert list(saved) == [f"loss_scaler{i}.{n}" for i in (0, 1) for n in
                           ("scale", "growth_tracker", "hysteresis", "skipped", "floor_skips",
                            "dynamic")]
    assert saved["loss_scaler0.dynamic"].dtype == torch.bool and saved["loss_scaler0.dynamic"]
    with optamp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as scaled:
        scaled.backward()
    optamp.load_state_dict(saved)
    again = optamp.state_dict()
    for k in saved:
        assert torch.equal(again[k], saved[k]) and again[k].dtype == saved[k].dtype
    assert optamp.loss_scaler(1).loss_scale() == 1.5
    broken = dict(saved)
    del broken["loss_scaler1.hysteresis"]
    with pytest.raises(ValueError, match="loss_scaler1.hysteresis"):
        optamp.load_state_dict(broken)
    assert all(torch.equal(optamp.state_dict()[k], saved[k]) for k in saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ops_match_torch_foreach_unscale(dtype):
    tensors = [torch.randn(n).to(dtype) for n in (0, 1, 3, 1000)]
    ref = [t.clone() for t in tensors]
    found, ref_found = torch.zeros(1), torch.zeros(1)
    inv = torch.full((1,), 0.125)
    torch.ops.optamp.unscale_check_(tensors, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)
    assert all(torch.equal(a, b) for a, b in zip(tensors, ref))
    assert found.item() == 0.0
    tensors[2][1] = math.nan
    torch.ops.optamp.unscale_check_(tensors, found, inv)
    assert found.item() == 1.0
    out = torch.empty(10, dtype=dtype)
    x, y = torch.randn(10).to(dtype), torch.randn(10).to(dtype)
    torch.ops.optamp.axpby_check_([out], [x], [y], torch.full((1,), 0.5), 2.0, found.zero_())
    assert torch.equal(out, (x.float() * 0.5 + y.float() * 2.0).to(dtype))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_ops_match_cpu(dtype):
    cpu = [torch.randn(n).to(dtype) for n in (0, 1, 3, 2**20 + 3)]
    cuda = [t.cuda() for t in cpu]
    fc, fg = torch.zeros(1), torch.zeros(1, device="cuda")
    torch.ops.optamp.unscale_check_(cpu, fc, torch.full((1,), 0.25))
    torch.ops.optamp.unscale_check_(cuda, fg, torch.full((1,), 0.25, device="cuda"))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, cuda))
    cuda[3][-1] = math.inf
    torch.ops.optamp.unscale_check_(cuda, fg, torch.ones(1, device="cuda"))
    assert fg.item() == 1.0


@pytest.mark.needs_cuda
def test_scale_loss_on_cuda_skips_overflow():
    configure()
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with optamp.scale_loss(model(torch.randn(3, 4, device="cuda")).sum(), opt) as scaled:
        scaled.backward()
        model.bias.grad[0] = math.inf
    assert optamp.loss_scaler().last_step_skipped
    assert optamp.loss_scaler().scale_tensor.is_cuda


def test_low_level_scaler_unscale_with_stash_and_update():
    configure(init_scale=4.0)
    scaler = optamp.loss_scaler()
    g = torch.tensor([4.0, 8.0])
    stash = torch.tensor([1.0, 1.0])
    plain = torch.tensor([2.0])
    scaler.unscale([g, plain], [stash, None])
    assert scaler.update() is False
    assert torch.equal(g, torch.tensor([2.0, 3.0])) and torch.equal(plain, torch.tensor([0.5]))
    scaler.unscale([torch.tensor([math.inf])])
    assert scaler.update() is True
    assert scaler.loss_scale() == 2.0 and scaler.skipped_steps == 1
    _C.reset_loss_scalers()
    assert scaler.loss_scale() == 2.0  # a held scaler outlives reconfiguration


def test_enabled_false_returns_objects_untouched_and_scale_loss_scales_by_one():
    """Apex's enabled=False: same objects back, no casting, scale_loss yields loss * 1. It still
    counts as the process's one initialize (reset() before initializing again)."""
    optamp.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        m, o = optamp.initialize(model, opt, opt_level="O2", enabled=False, verbosity=0)
        assert m is model and o is opt
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        x = torch.randn(2, 4)
        out = model(x)
        assert out.dtype == torch.float32 and torch.equal(out, x @ model.weight.t() + model.bias)
        loss = out.sum()
        with optamp.scale_loss(loss, opt) as scaled:
            assert torch.equal(scaled, loss)
            scaled.backward()
        assert not optamp.loss_scaler().dynamic and optamp.loss_scaler().loss_scale() == 1.0
        with pytest.raises(ValueError, match="call amp::reset"):
            optamp.initialize(model, opt, opt_level="O1", verbosity=0)
        optamp.reset()
        optamp.initialize(model, opt, opt_level="O1", verbosity=0)  # after reset: fine
        assert optamp.properties().enabled
    finally:
        optamp.reset()


def test_the_flag_a_reducer_was_handed_is_kept_until_the_next_reduction_or_reset():
    """A collective backend may drop its own reference to the flag on a worker thread after the
    collective returned (gloo's run loop). In torch 2.11 the C++ reference that brings a tensor's
    count back to one (its Python object's own) releases the Python object and takes the GIL,
    and while the interpreter shuts down a thread that takes it is ended instead, inside a
    destructor: std::terminate. (A rank of test_ddp's model-parallel test aborted so at exit,
    about once in 10 runs.) optamp keeps the flag and a C++ reference to it until the next
    reduction or reset(), never releasing it at exit, so a backend's is never that one."""
    configure()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handed = []
    _C.loss_scaler().set_found_inf_reducer(lambda found_inf: handed.append(weakref.ref(found_inf)))
    for _ in range(2):
        with optamp.scale_loss(model(torch.ones(1, 2)).sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert handed[-1]() is not None, "the flag must outlive the step"
        assert handed[-1]()._use_count() >= 2, "a C++ reference besides its Python object's"
    assert handed[0]() is None or handed[0]() is handed[1](), "released at the next reduction"
    optamp.reset()
    assert handed[1]() is None, "released by reset"


def test_reducers_are_released_before_the_interpreter_exits():
    """The scalers live in a C++ static that outlives Python; a reducer left there would keep
    its process group (and the backend's threads) alive through teardown. optamp drops them at
    exit, while Python still runs: the reducer's captured objects are released then."""
    import os
    import subprocess
    import sys

    code = (
        "import optamp, torch\n"
        "from optamp import _C\n"
        "class Group:\n"
        "    def __del__(self):\n"
        "        print('group released', flush=True)\n"
        "_C.configure_loss_scalers(optamp.resolve('O1', verbosity=0))\n"
        "group = Group()\n"
        "_C.loss_scaler(0).set_found_inf_reducer(lambda f, g=group: None)\n"
        "del group\n"
        "print('exiting', flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["exiting", "group", "released"], proc.stdout


class _SparseModel(torch.nn.Module):
    """An nn.Embedding(sparse=True) (word2vec-style, recommendation models) and a dense head."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1))


def _sparse_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 50, (6, 4), generator=gen), torch.randint(0, 3, (6,), generator=gen)


# The embedding's gradient at each level against fp32's (its rows: the table's own dtype).
SPARSE_TOLERANCE = {"O1": 2e-3, "O2": 2e-3, "O3": 2e-2, "O4": 2e-2, "O5": 2e-2}


@pytest.mark.parametrize("level", list(SPARSE_TOLERANCE))
def test_sparse_gradients_are_unscaled_as_torch_grad_scaler_does(fresh, level):
    # Refused with a ValueError until 2026-12-05 ("sparse gradients are not supported"), where
    # torch.amp.GradScaler unscales their values.
    model = _SparseModel()
    reference = _SparseModel()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    optamp.initialize(model, opt, opt_level=level, verbosity=0)
    for step in range(3):
        ids, target = _sparse_batch(step)
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(ids), target).backward()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids), target)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grad = model.table.weight.grad
        assert grad.is_sparse and not optamp.loss_scaler().last_step_skipped
        if grad.dtype == torch.float16:
            assert grad.is_coalesced()  # as GradScaler: duplicates summed before the check
        tol = SPARSE_TOLERANCE[level]
        torch.testing.assert_close(grad.to_dense().float(), reference.table.weight.grad.to_dense(),
                                   rtol=tol, atol=tol * 1e-1)
        untouched = model.table.weight.detach().clone()
        opt.step()
        rows = torch.zeros(50, dtype=torch.bool)
        rows[ids.flatten()] = True
        assert torch.equal(model.table.weight.detach()[~rows], untouched[~rows])
        assert not torch.equal(model.table.weight.detach()[rows], untouched[rows])
        with torch.no_grad():
            reference.table.weight.copy_(model.table.weight.float())
            reference.head.weight.copy_(model.head.weight.float())
            reference.head.bias.copy_(model.head.bias.float())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_sparse_gradients_skip_an_overflow_and_accumulate(fresh, cpu_buckets, level):
    model = _SparseModel()
    opt = torch.optim.SparseAdam(list(model.table.parameters()), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    optamp.initialize(model, [opt, head], opt_level=level, verbosity=0)
    for step in range(2):  # the second step's copies come from the step's batch (buckets)
        ids, target = _sparse_batch(step)
        for opts in (opt, head):
            opts.zero_grad()
        before = model.table.weight.detach().clone()
        loss = torch.nn.functional.cross_entropy(model(ids), target)
        with optamp.scale_loss(loss * math.inf, [opt, head]) as scaled:
            scaled.backward()
        assert optamp.loss_scaler().last_step_skipped and model.table.weight.grad is None
        opt.step()
        assert torch.equal(model.table.weight.detach(), before)
        # Two micro-batches, the first's gradient stashed by the second guard: their sum.
        parts = []
        for micro in range(2):
            ids, target = _sparse_batch(10 + micro)
            loss = torch.nn.functional.cross_entropy(model(ids), target)
            with optamp.scale_loss(loss, [opt, head]) as scaled:
                scaled.backward()
            parts.append(model.table.weight.grad.to_dense().clone())
        assert not optamp.loss_scaler().last_step_skipped
        torch.testing.assert_close(parts[1] - parts[0], _grad_of_batch(model, 11),
                                   rtol=2e-2, atol=1e-4)
        opt.step()
        head.step()
        assert not torch.equal(model.table.weight.detach(), before)


def _grad_of_batch(model, step):
    """The table's gradient for one batch alone, unscaled (the same level's casts)."""
    saved = model.table.weight.grad
    model.table.weight.grad = None
    ids, target = _sparse_batch(step)
    loss = torch.nn.functional.cross_entropy(model(ids), target)
    loss.backward()
    grad = model.table.weight.grad.to_dense().clone()
    model.table.weight.grad = saved
    model.head.weight.grad = None
    model.head.bias.grad = None
    return grad


def test_backward_on_the_loss_instead_of_the_scaled_loss_warns(fresh):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    optamp.initialize(model, opt, opt_level="O1", verbosity=0)
    loss = model(torch.randn(3, 4)).float().pow(2).mean()
    with pytest.warns(UserWarning, match="without a backward through its scaled loss, but 2 of"):
        with optamp.scale_loss(loss, opt):
            loss.backward()  # the slip: the gradients are not scaled
    opt.zero_grad()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with optamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
