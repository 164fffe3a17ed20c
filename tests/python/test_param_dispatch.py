"""O2/O5 substitution from Python: the key lives on the registered parameters, so only ops that
take one are substituted, `module.to()` / `p.data = x` keep it, and backward never reaches it."""
import pytest
import torch
from common_utils import tol, train_row

import optamp

_KEY = "AutocastXLA"


def _keys(t):
    return str(torch._C._dispatch_keys(t))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x).float())


def _init(model, level="O5"):
    optamp.reset()
    return optamp.initialize(model, opt_level=level, verbosity=0)


def test_only_registered_parameters_carry_the_key_until_reset():
    net = _init(_Net())
    try:
        assert _KEY in _keys(net.fc.weight) and _KEY in _keys(net.fc.bias)
        assert _KEY not in _keys(net.bn.weight)  # batch-norm stays fp32: not a source
        assert _KEY not in _keys(torch.randn(2))
    finally:
        optamp.reset()
    assert _KEY not in _keys(net.fc.weight)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_reading_and_comparing_a_parameters_values_sees_the_master(level):
    # What users write to inspect weights, in grad mode: tolist() printed fp16-rounded values of
    # an fp32 parameter, and allclose against a saved fp32 copy raised "Half did not match Float".
    net = _init(_Net(), level)
    try:
        w = net.fc.weight
        with torch.no_grad():
            w.copy_(torch.full_like(w, 1.0 / 3.0))
        saved = w.detach().clone()
        assert w.tolist() == saved.tolist() and w.tolist()[0][0] == saved[0, 0].item()
        assert torch.allclose(w, saved, rtol=0, atol=0)
        assert bool(torch.isclose(w, saved, rtol=0, atol=0).all())
        torch.testing.assert_close(w, saved, rtol=0, atol=0)
        assert (w * 1).dtype != torch.float32, "other ops still see the working copy"
    finally:
        optamp.reset()


class _Rotary(torch.nn.Module):
    """Hugging Face's rotary embedding (transformers 5): fp32 angles from a buffer it converts."""

    def __init__(self):
        super().__init__()
        self.inv_freq = torch.nn.Buffer(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)),
                                        persistent=False)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, position_ids, how):
        inv_freq = {"to": lambda f: f.to(device=x.device, dtype=torch.float),
                    "float": lambda f: f.float(), "type_as": lambda f: f.type_as(position_ids.float()),
                    "to_device": lambda f: f.to(x.device), "none": lambda f: f}[how](self.inv_freq)
        return self.lin(x), position_ids[..., None].float() * inv_freq


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_conversion_to_the_own_dtype_reads_the_master(level, backend):
    """``.float()``/``.to(dtype=torch.float)`` of an fp32 buffer needs no conversion and handed
    back the buffer, which the next op read as its working copy: the rotary angles at position
    4000 were 0.1 rad off at O2 and 0.4 at O5 in eager, exact compiled. Such a conversion of a
    buffer (also ``.to(device)`` and ``type_as``) hands back a copy of its own values now, eager
    and compiled alike; an op on the buffer itself still sees the working copy, as Apex's fp16
    model would. A parameter's stays the parameter: code reassigns ``p.to(device)`` to the
    module, which takes a Parameter only."""
    net = _init(_Rotary(), level)
    try:
        run = net if backend is None else torch.compile(net, backend=backend)
        x = torch.randn(2, 4, requires_grad=True)
        positions = torch.arange(3990, 4010)[None]
        exact = positions[..., None].float() * net.inv_freq.detach()
        for how in ("to", "float", "type_as", "to_device"):
            assert torch.equal(run(x, positions, how)[1], exact), how
        assert not torch.equal(run(x, positions, "none")[1], exact)
        assert net.lin.weight.to(x.device) is net.lin.weight
        net.lin.weight = net.lin.weight.to(x.device)  # what a Parameter-only setattr takes
    finally:
        optamp.reset()


class _Float64Table(torch.nn.Module):
    """A float64 buffer (a frequency table; diffusion noise schedules are kept so too) and a
    float8 weight for `_scaled_mm` beside an fp32 buffer: the float64 and float8 ones keep their
    dtypes at O2/O5, as native autocast leaves them."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("freqs", torch.tensor([1.0, 1e-3, 1e-6, 1.0 + 1e-9],
                                                   dtype=torch.float64))
        self.register_buffer("shift", torch.full((4,), 0.1))
        self.register_buffer("weight8", torch.eye(4).to(torch.float8_e4m3fn))

    def forward(self, x):
        self.angles = torch.arange(3, dtype=torch.float64)[:, None] * self.freqs
        one = torch.ones(())
        eight = torch._scaled_mm(x.float().to(torch.float8_e4m3fn), self.weight8.t(), one, one,
                                 out_dtype=torch.float32)
        return self.lin(x) + self.shift + eight  # (the boundary casts float64 outputs to fp32)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_float64_and_float8_buffers_are_not_read_as_working_copies(level, backend):
    """Until 2026-12-07 every floating buffer was registered as a working-copy source: `t * freqs`
    of a float64 table stayed float64 but with freqs rounded to fp16/bf16 (1 + 1e-9 became 1,
    1e-6 lost its digits), a precision loss neither fp32 training nor native autocast has, and
    `_scaled_mm` refused a float8 weight's fp16 copy ("Expected mat2 to be Float8 matrix")."""
    net = _init(_Float64Table(), level)
    try:
        run = net if backend is None else torch.compile(net, backend=backend)
        run(torch.randn(2, 4))
        assert net.angles.dtype == torch.float64
        assert torch.equal(net.angles[1], net.freqs)
        with torch.enable_grad():
            assert (net.shift * 1).dtype != torch.float32  # the fp32 buffer: its working copy
    finally:
        optamp.reset()


class _SelectiveDecay(torch.nn.Module):
    """Mamba's state matrix (Hugging Face's slow path): fp32 from a parameter it converts."""

    def __init__(self):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, 17).float()).repeat(8, 1))
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, how):
        A = -torch.exp({"float": lambda p: p.float(), "to": lambda p: p.to(torch.float32),
                        "type_as": lambda p: p.type_as(x.float())}[how](self.A_log))
        return self.lin(x), A


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_parameter_converted_to_its_own_dtype_reads_the_master(level, backend):
    """``-torch.exp(self.A_log.float())`` (Mamba; Gemma's ``1 + self.weight.float()``): the
    conversion needed none and handed back the parameter, so exp read its working copy and
    computed in fp16/bf16 in eager (A off by 1.6e-2 at O2, 0.125 at O5), while the compiled
    model read the master. A conversion that names only a dtype now hands back a copy of the
    parameter's values, whose gradient reaches the master; one that names a place (``to(device)``)
    is still the parameter, which a module takes back."""
    net = _init(_SelectiveDecay(), level)
    try:
        run = net if backend is None else torch.compile(net, backend=backend)
        x = torch.randn(2, 16)
        exact = -torch.exp(net.A_log.detach())
        for how in ("float", "to", "type_as"):
            net.A_log.grad = None
            _, A = run(x, how)
            assert A.dtype == torch.float32 and torch.equal(A, exact), how
            A.sum().backward()
            assert net.A_log.grad.dtype == torch.float32 and torch.equal(net.A_log.grad, exact), how
        assert net.A_log.to(x.device) is net.A_log
        assert net.A_log.exp().dtype != torch.float32, "the parameter itself: its working copy"
    finally:
        optamp.reset()


def test_a_flat_vector_of_the_parameters_under_no_grad_round_trips_the_masters():
    # torch.nn.utils.parameters_to_vector in grad mode views the working copies (fp16), and
    # vector_to_parameters of that vector replaced the fp32 masters' data: the next step says so,
    # naming the way out; under no_grad the vector is the masters'.
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    optamp.reset()
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    optamp.initialize(net, opt, opt_level="O2", verbosity=0)
    try:
        with torch.no_grad():
            flat = parameters_to_vector(net.parameters())
            vector_to_parameters(flat * 1, net.parameters())
        assert flat.dtype == torch.float32 and net[0].weight.dtype == torch.float32
        vector_to_parameters(parameters_to_vector(net.parameters()).detach(), net.parameters())
        with pytest.raises(ValueError, match="parameters_to_vector .* under no_grad"):
            with optamp.scale_loss(net(torch.randn(3, 4)).float().sum(), opt) as scaled:
                scaled.backward()
    finally:
        optamp.reset()


def test_module_to_and_data_assignment_keep_substitution():
    net = _init(_Net())
    try:
        x = torch.randn(3, 4)
        net.to("cpu")
        net.fc.weight.data = net.fc.weight.data.clone()  # set_data: a key set without the key
        assert _KEY in _keys(net.fc.weight)
        assert net.fc(x).dtype == torch.bfloat16
        net.double()  # a cast after initialize is still refused, with what to do
        try:
            net.fc(x.double())
        except ValueError as e:
            assert "cast after initialize" in str(e)
        else:
            raise AssertionError("a model cast after initialize must be refused")
    finally:
        optamp.reset()


def test_backward_matches_o4_up_to_the_working_copies():
    # Same model and data at O4 (casts per op) and O5 (working copies): the gradients reach the
    # fp32 masters either way, and agree to bf16 precision.
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    grads = {}
    for level in ("O4", "O5"):
        model = _init(_clone(base), level)
        try:
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            grads[level] = [p.grad for p in model.parameters()]
            assert all(g.dtype == torch.float32 for g in grads[level])
        finally:
            optamp.reset()
    for a, b in zip(grads["O4"], grads["O5"]):
        torch.testing.assert_close(a, b, **tol("train_bfloat16"))


def _clone(module):
    import copy
    return copy.deepcopy(module)


@pytest.mark.parametrize("level,low", [("O2", torch.float16), ("O5", torch.bfloat16)])
def test_working_copies_of_a_step_are_made_together(level, low):
    # From the second step on, the copies the step before used are made together at the first
    # use of any of them (one block, one multi-tensor copy), holding the stepped masters rounded
    # (torch's optimizers step in place, bumping the versions).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optamp.reset()
    model, opt = optamp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        x = torch.randn(32, 8)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            # a view is substituted: it shows the working copy the forward used
            copies = [p.view(p.shape) for p in model.parameters()]
            blocks = {c.untyped_storage().data_ptr() for c in copies}
            assert len(blocks) == (4 if step == 0 else 1), step
            for p, c in zip(model.parameters(), copies):
                assert torch.equal(c, p.detach().to(low))
            del copies
            with optamp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    finally:
        optamp.reset()


class _MaskedConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 1)
        self.register_buffer("mask", torch.rand(1, 2, 3, 3))

    def forward(self, x):
        return self.conv(x) * self.mask


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_module_conversions_after_initialize_keep_the_registered_tensors(level, gate):
    """``model.to(device)`` on its own device (as Lightning and Accelerate call it), ``.float()``,
    ``.cpu()``: torch hands each tensor back and the module keeps it. Since a no-op conversion of
    a registered buffer in grad mode returns a copy of its values, ``_apply`` stored those copies:
    the buffers were no longer registered (ops read them as fp32) and, with rules_under_no_grad,
    the parameters got new storage. A real conversion (channels_last here, a device move on a
    GPU) replaced the buffers with unregistered tensors too. Both keep them now."""
    optamp.reset()
    net = _MaskedConv()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    optamp.initialize(net, opt, opt_level=level, verbosity=0, rules_under_no_grad=gate)
    low = torch.float16 if level == "O2" else torch.bfloat16
    try:
        mask, weight, storage = net.mask, net.conv.weight, net.conv.weight.data_ptr()
        for convert in (lambda m: m.to("cpu"), lambda m: m.float(), lambda m: m.cpu(),
                        lambda m: m.to(torch.float32)):
            convert(net)
            assert net.mask is mask and net.conv.weight is weight
            assert net.conv.weight.data_ptr() == storage and (net.mask * 1).dtype == low
        net.to(memory_format=torch.channels_last)
        assert net.mask is mask and net.mask.is_contiguous(memory_format=torch.channels_last)
        assert (net.mask * 1).dtype == low, "still a registered buffer: its working copy"
        x = torch.randn(2, 2, 3, 3)
        with optamp.scale_loss(net(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert net.mask.dtype == torch.float32 and torch.isfinite(net.conv.weight).all()
    finally:
        optamp.reset()


@pytest.fixture
def swap_module_params():
    """``torch.__future__.set_swap_module_params_on_conversion(True)``: ``Module.to()`` and
    ``load_state_dict()`` exchange each parameter's TensorImpl through
    ``torch.utils.swap_tensors`` (announced as a future default; DTensor parameters always)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def _train_with_a_conversion_and_a_load(level, swap):
    """Five fused-AdamW steps at ``level`` (the fourth overflows and is skipped), with
    ``model.to("cpu")``, ``.float()`` (not at O3) and a ``load_state_dict`` of the model's own state
    after the second."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 4))
        net.register_buffer("shift", torch.linspace(0, 1, 4))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-4, fused=True)
        optamp.reset()
        net, opt = optamp.initialize(net, opt, opt_level=level, verbosity=0)
        losses = []
        for step in range(5):
            torch.manual_seed(step)
            x = torch.randn(6, 8)
            if step == 3:
                x[0, 0] = float("inf")
            opt.zero_grad()
            loss = (net(x).float() + net.shift.float()).pow(2).mean()
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.detach())
            if step == 1:
                state = {k: v.clone() for k, v in net.state_dict().items()}
                net.to("cpu")
                if level != "O3":
                    net.float()
                net.load_state_dict(state)
        return (torch.stack(losses), [p.detach().clone() for p in net.parameters()],
                optamp.state_dict(), [opt.state[p]["exp_avg"].clone() for p in net.parameters()])
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
        optamp.reset()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_swapping_conversions_and_loads_after_initialize_train_as_in_place_ones(level):
    """Under the swap flag (or for DTensor parameters) ``Module.to()``, ``.float()`` and
    ``load_state_dict()`` swap each parameter's TensorImpl, which torch refuses while anything
    holds a weak reference to it; optamp's records did, so every such call after ``initialize``
    failed at every level ("Expected no weakrefs to t1's Tensor object"), the Apex resume recipe
    (initialize, then load the checkpoint) among them. The records now follow the parameter to its
    new TensorImpl: the run equals the one whose conversions and load work in place, bit for bit,
    an overflow skipped on both."""
    expected = _train_with_a_conversion_and_a_load(level, swap=False)
    got = _train_with_a_conversion_and_a_load(level, swap=True)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, equal_nan=True)
    for a, b in zip(got[1] + got[3], expected[1] + expected[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[2].keys() == expected[2].keys()
    for key in got[2]:
        assert torch.equal(got[2][key], expected[2][key]), key
    assert int(got[2]["loss_scaler0.skipped"]) == 1, "the overflowing step was skipped"


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_refused_swap_leaves_the_records_as_they_were(level, swap_module_params):
    """A swap torch refuses (here: the user holds a weak reference to the parameter) raises
    torch's error and leaves optamp's records on the tensors they were on: the parameter still
    carries the key (ops read its working copy) and trains."""
    import weakref

    optamp.reset()
    net = _MaskedConv()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    optamp.initialize(net, opt, opt_level=level, verbosity=0)
    low = torch.float16 if level == "O2" else torch.bfloat16
    try:
        ref = weakref.ref(net.conv.weight)
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            net.to(torch.float32)
        del ref
        assert _KEY in _keys(net.conv.weight) and (net.conv.weight * 1).dtype == low
        net.to(torch.float32)  # no weak reference now: swapped
        assert _KEY in _keys(net.conv.weight) and (net.conv.weight * 1).dtype == low
        assert (net.mask * 1).dtype == low, "a buffer is replaced, not swapped: still registered"
        with optamp.scale_loss(net(torch.randn(2, 2, 3, 3)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert net.conv.weight.dtype == torch.float32 and torch.isfinite(net.conv.weight).all()
    finally:
        optamp.reset()


class _Symmetric(torch.nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def _train_registering_parametrizations_after_the_first_step(level):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if level is not None:
        optamp.reset()
        net, opt = optamp.initialize(net, opt, opt_level=level, verbosity=0)
    losses = []
    for step in range(4):
        torch.manual_seed(step)
        loss = net(torch.randn(4, 6)).float().pow(2).mean()
        if level is None:
            loss.backward()
        else:
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if step == 0:
            torch.nn.utils.parametrize.register_parametrization(net[0], "weight", _Symmetric())
            torch.nn.utils.parametrizations.weight_norm(net[2])
            opt.add_param_group({"params": [net[2].parametrizations.weight.original0]})
    return torch.stack(losses), net


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_parametrizations_registered_after_initialize_train(level):
    """``register_parametrization`` checks that the parametrized tensor keeps the original's dtype
    (and runs ``right_inverse``, here weight norm's split into g and v): at O2/O5 it read the
    original as its working copy, so every parametrization registered after ``initialize``
    failed ("Registering a parametrization may not change the dtype of the tensor"). It runs
    with optamp's rules off now: the originals stay the fp32 parameters the optimizer steps, and
    the forward reads them as before (at O2/O5 as working copies)."""
    try:
        got, net = _train_registering_parametrizations_after_the_first_step(level)
        original = net[0].parametrizations.weight.original
        assert original.dtype == torch.float32
        if level in ("O2", "O5"):
            assert _KEY in _keys(original), "the same parameter: still a working-copy source"
    finally:
        optamp.reset()
    expected, _ = _train_registering_parametrizations_after_the_first_step(None)
    torch.testing.assert_close(got, expected, **tol(train_row(level)))
