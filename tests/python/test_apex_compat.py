"""A script written for NVIDIA Apex runs with ``import optamp as amp``: every option value Apex's
``amp.initialize`` accepted, Apex-format ``amp.state_dict()`` checkpoints, and Apex-style
training end to end (several models, optimizers and losses, ``add_param_group``, a checkpoint
saved in one process and loaded in another) at O0-O3."""
import sys

import pytest
import torch

import optamp
from common_utils import Mlp, TinyNet, env, init, tol

pytestmark = pytest.mark.usefixtures("fresh")


# ---- 1. every option value Apex accepted ---------------------------------------------------
# Apex's Properties.__setattr__ and initialize(): keep_batchnorm_fp32 as "True"/"False",
# loss_scale through float() (numbers, numeric strings, numpy scalars, a 0-dim tensor),
# cast_model_type=False for "do not cast", truthy flags, and no validation at all with
# enabled=False (so opt_level=None passes).

APEX_VALUES = [
    ("O1", dict(enabled=1)),
    ("O1", dict(cast_model_type=False)),
    ("O1", dict(cast_model_type=torch.float32)),
    ("O2", dict(keep_batchnorm_fp32="False")),
    ("O3", dict(keep_batchnorm_fp32="True")),
    ("O2", dict(master_weights=False)),
    ("O3", dict(master_weights=True)),
    ("O2", dict(cast_model_type=False)),
    ("O2", dict(cast_model_type=torch.float32)),
    ("O0", dict(cast_model_type=torch.float16)),
    ("O1", dict(patch_torch_functions=True)),
    ("O2", dict(patch_torch_functions=False)),
    ("O1", dict(loss_scale="128.0")),
    ("O1", dict(loss_scale="128")),
    ("O1", dict(loss_scale=128)),
    ("O1", dict(loss_scale=torch.tensor(4.0))),
    ("O3", dict(loss_scale="dynamic")),
    ("O0", dict(loss_scale="dynamic")),
    ("O1", dict(min_loss_scale=1, max_loss_scale=2**24)),
    ("O1", dict(verbosity=False)),
    ("O1", dict(cast_model_outputs=torch.float16)),
]


# numpy scalars (numpy is optional: these cases skip without it): option, numpy type, value.
APEX_NUMPY_VALUES = [
    ("O1", "enabled", "bool_", True),
    ("O1", "loss_scale", "float32", 8.0),
    ("O1", "min_loss_scale", "float64", 0.5),
    ("O1", "num_losses", "int64", 3),
]


@pytest.mark.parametrize("level,kwargs", APEX_VALUES, ids=lambda v: repr(v))
def test_every_value_apex_accepted_initializes(level, kwargs):
    _initialize_and_step(level, kwargs)


@pytest.mark.parametrize("level,option,numpy_type,value", APEX_NUMPY_VALUES)
def test_every_numpy_value_apex_accepted_initializes(level, option, numpy_type, value):
    np = pytest.importorskip("numpy")
    _initialize_and_step(level, {option: getattr(np, numpy_type)(value)})


def _initialize_and_step(level, kwargs):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"verbosity": 0, **kwargs}
    m, o = optamp.initialize(model, opt, opt_level=level, **kwargs)
    assert m is model and o is opt
    loss = m(torch.randn(2, 1, 4, 4)).float().sum()
    with optamp.scale_loss(loss, o) as scaled:
        scaled.backward()
    o.step()


def test_values_read_as_apex_read_them():
    p = optamp.resolve("O1", enabled=0, loss_scale="128", num_losses=2, verbosity=False)
    assert p.enabled is False and p.loss_scale == 128.0 and p.num_losses == 2 and p.verbosity == 0
    assert optamp.resolve("O1", loss_scale=torch.tensor(4.0)).loss_scale == 4.0
    assert optamp.resolve("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    assert optamp.resolve("O2", cast_model_type=False).cast_model_type is None


@pytest.mark.parametrize(
    "level,kwargs,model_cast,casts",
    [
        ("O2", {}, "working copies", True),
        ("O2", dict(master_weights=False), "cast in place", True),
        ("O2", dict(cast_model_type=False), "not cast", False),
        ("O3", {}, "cast in place", True),
        ("O3", dict(master_weights=True), "working copies", True),
        ("O3", dict(cast_model_type=torch.float32), "not cast", False),
        ("O0", dict(cast_model_type=torch.float16), "cast in place", True),
        ("O1", dict(cast_model_type=False), "not cast", True),
    ],
)
def test_model_overrides_do_what_apex_did_to_the_model(level, kwargs, model_cast, casts):
    props = optamp.resolve(level, **kwargs)
    assert (props.model_cast, props.casts) == (model_cast, casts)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, level, **kwargs)
    expected = {"not cast": torch.float32, "working copies": torch.float32,
                "cast in place": torch.float16}[model_cast]
    assert model.conv.weight.dtype == expected
    seen = {}
    model.conv.register_forward_hook(lambda m, i, o: seen.update(conv=o.dtype))
    out = model(torch.randn(2, 1, 4, 4))
    assert seen["conv"] == (torch.float16 if casts else torch.float32)
    # Apex's patched forward: where cast_model_type is set, outputs leave the model as fp32
    assert out.dtype == (torch.float16 if casts and props.cast_model_type is None
                         else torch.float32)


def test_disabled_run_accepts_opt_level_none():
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = optamp.initialize(model, opt, opt_level=None, enabled=False, verbosity=0)
    assert m is model and o is opt and optamp.properties().enabled is False
    loss = m(torch.randn(2, 4)).sum()
    with optamp.scale_loss(loss, o) as scaled:
        assert torch.equal(scaled, loss.float())


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(opt_level=None), TypeError, "opt_level must be a str"),
        (dict(cast_model_type=True), TypeError, r"cast_model_type must be a torch.dtype, False"),
        (dict(cast_model_type="half"), TypeError, r"cast_model_type must be a torch.dtype, False"),
        (dict(enabled=2), ValueError, r"enabled must be True, False, .* got 2"),
        (dict(enabled="yes"), ValueError, r"enabled must be True, False"),
        (dict(loss_scale=True), TypeError, "loss_scale must be a number, got bool"),
        (dict(loss_scale=[1.0]), TypeError, "loss_scale must be a number, got list"),
        (dict(num_losses=1.5), TypeError, "num_losses must be an int, got float"),
        (dict(opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=True),
         ValueError, "patch_torch_functions=True is only valid"),
    ],
)
def test_values_apex_refused_or_misread_are_refused(kwargs, error, message):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=message):
        optamp.initialize(model, opt, **{"opt_level": "O1", "verbosity": 0, **kwargs})
    assert not optamp.is_initialized()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---- 2. Apex-format checkpoints --------------------------------------------------------------
# apex.amp.state_dict() wrote {"loss_scaler<i>": {"loss_scale": float, "unskipped": int}}; a run
# trained with Apex resumes from it here.

def _apex_state(*pairs):
    from collections import OrderedDict

    return OrderedDict((f"loss_scaler{i}", {"loss_scale": scale, "unskipped": unskipped})
                       for i, (scale, unskipped) in enumerate(pairs))


def _clean_step(model, opt, loss_id=0):
    opt.zero_grad()
    loss = model(torch.randn(4, 4)).float().pow(2).mean()
    with optamp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def test_apex_layout_resumes_scale_and_growth_count():
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, "O1", num_losses=2)
    optamp.load_state_dict(_apex_state((1024.0, 1998), (2.0**15, 0)))
    s0, s1 = optamp.loss_scaler(0), optamp.loss_scaler(1)
    assert (s0.loss_scale(), int(s0.growth_tracker)) == (1024.0, 1998)
    assert (s1.loss_scale(), int(s1.growth_tracker)) == (2.0**15, 0)
    assert int(s0.hysteresis_tracker) == optamp.properties().hysteresis and s0.skipped_steps == 0
    # Apex doubled the scale when "unskipped" reached its window of 2000: so does optamp.
    _clean_step(model, opt)
    assert s0.loss_scale() == 1024.0
    _clean_step(model, opt)
    assert s0.loss_scale() == 2048.0 and int(s0.growth_tracker) == 0
    # optamp's own layout is what it writes, and it round-trips.
    saved = optamp.state_dict()
    assert set(saved) == {f"loss_scaler{i}.{e}" for i in range(2)
                          for e in ("scale", "growth_tracker", "hysteresis", "skipped",
                                    "floor_skips", "dynamic")}


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_apex_layout_of_a_fixed_scale_loads(level):
    # Apex kept counting "unskipped" past its window for a static scaler; nothing grows here.
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, level)
    optamp.load_state_dict(_apex_state((1.0, 5000)))
    assert optamp.loss_scaler(0).loss_scale() == 1.0
    assert int(optamp.loss_scaler(0).growth_tracker) == 0


def test_numpy_integers_read_as_apex_read_them():
    np = pytest.importorskip("numpy")
    assert optamp.resolve("O1", num_losses=np.int64(2)).num_losses == 2


def test_apex_layout_values_apex_wrote_as_tensors_and_numpy_load():
    np = pytest.importorskip("numpy")
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, "O2")
    optamp.load_state_dict(_apex_state((torch.tensor(512.0), np.int64(3))))
    assert optamp.loss_scaler(0).loss_scale() == 512.0
    assert int(optamp.loss_scaler(0).growth_tracker) == 3


@pytest.mark.parametrize(
    "state,error,message",
    [
        (_apex_state((1024.0, 0)), ValueError,
         r"must hold the 2 loss scaler\(s\) initialize configured \(num_losses=2: "
         r"loss_scaler0, loss_scaler1\), got loss_scaler0"),
        (_apex_state((1024.0, 2000), (1.0, 0)), ValueError,
         r"state_dict\['loss_scaler0'\]\['unskipped'\] must lie within \[0, 1999\]"),
        (_apex_state((1e30, 0), (1.0, 0)), ValueError,
         r"state_dict\['loss_scaler0'\]\['loss_scale'\] must lie within"),
        (_apex_state((1.0, 0), (-4.0, 0)), ValueError,
         r"state_dict\['loss_scaler1'\]\['loss_scale'\] must lie within"),
        ({"loss_scaler0": {"loss_scale": 8.0}, "loss_scaler1": {"loss_scale": 8.0,
                                                                "unskipped": 0}},
         ValueError, r"state_dict\['loss_scaler0'\] must hold exactly 'loss_scale' and "
                     r"'unskipped'"),
        ({"loss_scaler0": {"loss_scale": "8", "unskipped": 0}}, TypeError,
         r"state_dict\['loss_scaler0'\]\['loss_scale'\] must be a number, got str"),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1.5}}, TypeError,
         r"\['unskipped'\] must be an int, got float"),
        ({"epoch": {"n": 1}}, ValueError, r"only 'loss_scaler<i>' entries .* got 'epoch'"),
    ],
)
def test_bad_apex_layout_is_refused_by_its_apex_keys_and_changes_nothing(state, error,
                                                                         message):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, "O1", num_losses=2)
    before = {k: v.clone() for k, v in optamp.state_dict().items()}
    with pytest.raises(error, match=message):
        optamp.load_state_dict(state)
    after = optamp.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_dict_fills_apexs_destination_argument():
    from collections import OrderedDict

    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    init(model, opt, "O1")
    dest = OrderedDict(kept=1)
    assert optamp.state_dict(destination=dest) is dest
    assert dest["kept"] == 1 and "loss_scaler0.scale" in dest
    with pytest.raises(TypeError, match="destination must be a mutable mapping"):
        optamp.state_dict(destination=[])


# ---- 3. what Apex's casting tests expect (test_rnn.py, test_basic_casts.py) ----------------
# Apex's amp.init() becomes an optamp.autocast(float16) region; each case trains a step.

RNN_CONFIGS = [(1, False), (2, False), (2, True)]  # (layers, bidirectional), Apex's


@pytest.mark.parametrize("cls", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
@pytest.mark.parametrize("layers,bidir", RNN_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_rnn_layers_run_in_fp16_as_in_apex(cls, layers, bidir, dtype):
    rnn = cls(input_size=6, hidden_size=6, num_layers=layers, bidirectional=bidir)
    x = torch.randn(4, 3, 6, dtype=dtype, requires_grad=True)
    h = torch.zeros(layers * (2 if bidir else 1), 3, 6, dtype=dtype)
    with optamp.autocast(dtype=torch.float16):
        out, _ = rnn(x, (h, h.clone()) if cls is torch.nn.LSTM else h)
    assert out.dtype == torch.float16
    out[-1].float().sum().backward()
    assert x.grad.dtype == dtype
    assert all(p.grad.dtype == torch.float32 for p in rnn.parameters())


@pytest.mark.parametrize("cls", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
def test_packed_sequences_run_in_fp16_too(cls):
    rnn = cls(input_size=6, hidden_size=6, num_layers=2)
    x = torch.randn(5, 3, 6, requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 4, 2]))
    with optamp.autocast(dtype=torch.float16):
        out, _ = rnn(packed)
    assert out.data.dtype == torch.float16
    out.data.float().sum().backward()
    assert x.grad.dtype == torch.float32


@pytest.mark.parametrize("cls", [torch.nn.RNNCell, torch.nn.GRUCell, torch.nn.LSTMCell])
def test_rnn_cells_run_in_fp16_as_in_apex(cls):
    cell = cls(6, 6)
    for dtype in (torch.float32, torch.float16):
        xs = [torch.randn(3, 6, dtype=dtype, requires_grad=True) for _ in range(3)]
        hidden = torch.zeros(3, 6, dtype=dtype)
        hidden = (hidden, hidden.clone()) if cls is torch.nn.LSTMCell else hidden
        with optamp.autocast(dtype=torch.float16):
            for x in xs:
                hidden = cell(x, hidden)
        out = hidden[0] if cls is torch.nn.LSTMCell else hidden
        assert out.dtype == torch.float16
        out.float().sum().backward()
        assert all(x.grad.dtype == dtype for x in xs)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_rnn_layers_at_the_op_levels_train(level):
    model = torch.nn.LSTM(6, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, level)
    low = optamp.properties().low_dtype
    out, _ = model(torch.randn(4, 3, 6))
    assert out.dtype == low
    with optamp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cpu_keeps_the_dtype_unlike_apex():
    # Apex listed Tensor.cpu as an fp32 function (CPUs had no fp16 kernels then). .cpu() is
    # aten::_to_copy, the op every cast is made of; optamp leaves it alone (docs/python.md).
    init(Mlp(), None, "O1")
    x = torch.randn(2, 3, requires_grad=True)
    with optamp.autocast(dtype=torch.float16):
        assert x.half().cpu().dtype == torch.float16
        assert x.cpu().dtype == torch.float32


FP32_INPLACE = ["exp_", "log_", "log2_", "log10_", "log1p_", "expm1_", "reciprocal_", "rsqrt_",
                "sinh_", "cosh_", "tan_", "asin_", "acos_", "erfinv_"]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_inplace_fp32_list_ops_on_reduced_tensors_run_as_if_in_fp32(low):
    # Apex raised on exp_ & co. applied to an fp16 tensor under O1: an in-place op cannot return
    # fp32. optamp runs them, as native autocast does, and the result is what computing in fp32
    # and storing in the tensor's dtype gives: ATen's reduced-precision kernels compute in fp32
    # (opmath) and round once.
    init(Mlp(), None, "O1" if low == torch.float16 else "O4")
    base = (torch.rand(512) * 0.9 + 0.05).to(low)
    with torch.enable_grad():
        for name in FP32_INPLACE:
            got = getattr(base.clone(), name)()
            want = getattr(base.float(), name[:-1])().to(low)
            assert got.dtype == low
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
        for name, args in [("pow_", (2.5,)), ("cumsum_", (0,)), ("cumprod_", (0,))]:
            got = getattr(base[:32].clone(), name)(*args)
            want = getattr(base[:32].float(), name[:-1])(*args).to(low)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


# ---- 4. torch code that reads torch._C._is_any_autocast_enabled() --------------------------
# optamp installs a version that is True where ops are cast now (native autocast, or optamp's
# rules), not merely where an autocast key is on (see python/optamp/_autocast_flag.py).

def _bf16_lstm():
    return torch.nn.LSTM(6, 6).bfloat16()


def test_flag_is_true_exactly_where_ops_are_cast():
    flag = torch._C._is_any_autocast_enabled
    assert not flag()
    init(Mlp(), None, "O1")
    assert flag()
    with optamp.disable_casts():
        assert not flag()
    with optamp.autocast(enabled=False):
        assert not flag()
    with torch.no_grad():
        assert not flag()  # optamp's no_grad gate: nothing is cast
        with optamp.autocast(dtype=torch.bfloat16):
            assert flag()
    with optamp.disable_casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert flag()  # native autocast still counts
    optamp.reset()
    assert not flag()


def test_rnn_dtype_check_behaves_as_under_native_autocast_where_optamp_casts():
    x = torch.randn(4, 3, 6)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            native = _bf16_lstm()(x)[0].dtype
    except RuntimeError as e:
        # CPUs without AVX-512 (an AVX2-only EPYC): native autocast routes a bf16 LSTM to
        # oneDNN, which has no primitive for it there. optamp casts the same inputs, but torch's
        # RNN picks oneDNN only when native autocast is on, so it runs ATen's own bf16 LSTM.
        assert "LSTM forward propagation primitive" in str(e), e
        init(Mlp(), None, "O4")
        assert _bf16_lstm()(x)[0].dtype == torch.bfloat16
        return
    init(Mlp(), None, "O4")
    assert _bf16_lstm()(x)[0].dtype == native == torch.bfloat16


@pytest.mark.parametrize("where", ["disable_casts", "autocast(enabled=False)", "no_grad"])
def test_rnn_dtype_check_behaves_as_without_optamp_where_it_does_not_cast(where):
    x = torch.randn(4, 3, 6)
    with pytest.raises(ValueError, match=r"RNN input dtype \(torch.float32\) does not match "
                                         r"weight dtype \(torch.bfloat16\)") as plain:
        _bf16_lstm()(x)
    init(Mlp(), None, "O4")
    ctx = {"disable_casts": optamp.disable_casts, "no_grad": torch.no_grad,
           "autocast(enabled=False)": lambda: optamp.autocast(enabled=False)}[where]
    with ctx(), pytest.raises(ValueError) as under_optamp:
        _bf16_lstm()(x)
    assert str(under_optamp.value) == str(plain.value)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_aot_runs_a_compiled_graph_with_casting_off_as_under_native_autocast(level):
    # The graph already holds the casts it was traced with; AOTAutograd disables autocast
    # around it when the flag was True at compile time. So a compiled call makes no casts of
    # its own where the eager call makes some, and returns the same dtype.
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    init(net, None, level)
    x = torch.randn(5, 8)
    compiled = torch.compile(net, backend="aot_eager")
    compiled(x)
    before = optamp.cast_count()
    out = compiled(x)
    assert optamp.cast_count() == before
    eager_before = optamp.cast_count()
    assert net(x).dtype == out.dtype == optamp.properties().low_dtype
    assert optamp.cast_count() > eager_before
    with optamp.disable_casts():
        assert compiled(x).dtype == torch.float32


def test_flag_carries_exactly_what_dynamos_constant_decorator_adds():
    # optamp marks its flag itself so that `import optamp` does not import torch._dynamo (1.7 s);
    # the mark must stay what torch.compiler.assume_constant_result sets, whatever torch's version.
    from optamp import _autocast_flag

    def plain():
        return True

    before = dict(vars(plain))
    decorated = torch.compiler.assume_constant_result(plain)
    added = {k: v for k, v in vars(decorated).items() if before.get(k, object()) is not v}
    assert added == {_autocast_flag.DYNAMO_CONSTANT_MARK: True}
    flag = _autocast_flag._is_any_autocast_enabled
    assert {k: getattr(flag, k, None) for k in added} == added


_READS_THE_FLAG = """
def fn(x):
    return x * 2 if torch._C._is_any_autocast_enabled() else x - 1

compiled = torch.compile(fn, fullgraph=True, backend="eager")
x = torch.ones(3)
optamp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
assert torch.equal(compiled(x), x * 2)
with optamp.disable_casts():
    assert torch.equal(compiled(x), x - 1)
assert torch.equal(compiled(x), x * 2)
print("ok")
"""


@pytest.mark.parametrize("first", ["optamp", "torch._dynamo"])
def test_compiled_code_reading_the_flag_folds_it_and_recompiles_when_casting_changes(first):
    # fullgraph: the flag is a constant to Dynamo (no graph break on the `if`), and optamp's state
    # is in the guards, so disable_casts gets the other branch. Imported first, Dynamo's list of
    # functions to fold holds torch's own flag, and only the mark makes it fold optamp's.
    import subprocess
    second = "torch._dynamo" if first == "optamp" else "optamp"
    code = f"import torch, {first}, {second}\n" + _READS_THE_FLAG
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---- 5. Apex-style training end to end -------------------------------------------------------
# Apex's "multiple models/optimizers/losses" recipe: two models, two optimizers, three losses
# (one per model, one through both), a parameter group added after initialize (Apex's
# add_param_group test), an injected overflow, and a checkpoint saved in one process and
# resumed in another, in optamp's layout and in Apex's.

RESUME_LEVELS = ["O0", "O1", "O2", "O3"]
STEPS_BEFORE, STEPS_AFTER, OVERFLOW_STEP = 3, 3, 1


def _models():
    torch.manual_seed(7)
    return Mlp(4, 8, 3), Mlp(4, 8, 3), torch.nn.Linear(3, 3)


def _build(level):
    """Models and optimizers as an Apex script builds them, initialized at ``level``."""
    model0, model1, head = _models()
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05, momentum=0.9)
    opt1 = torch.optim.Adam(model1.parameters(), lr=1e-3, eps=1e-4)
    [model0, model1, head], [opt0, opt1] = optamp.initialize(
        [model0, model1, head], [opt0, opt1], opt_level=level, num_losses=3, verbosity=0)
    # Apex's add_param_group test: a model known to initialize joins an optimizer later.
    opt0.add_param_group({"params": head.parameters(), "lr": 0.02})
    return (model0, model1, head), (opt0, opt1)


def _step(models, opts, step):
    model0, model1, head = models
    opt0, opt1 = opts
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    for opt in opts:
        opt.zero_grad()
    loss0 = torch.nn.functional.cross_entropy(head(model0(x)), y)
    loss1 = torch.nn.functional.cross_entropy(model1(x), y)
    if step == OVERFLOW_STEP:
        loss1 = loss1 * float("inf")  # this step's loss 1 overflows: both optimizers skip
    loss2 = (model0(x).float() - model1(x).float()).pow(2).mean()
    with optamp.scale_loss(loss0, opt0, loss_id=0) as scaled:
        scaled.backward()
    with optamp.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
        scaled.backward()
    with optamp.scale_loss(loss2, [opt0, opt1], loss_id=2) as scaled:
        scaled.backward()
    opt0.step()
    opt1.step()


def _train(level, first, last, models=None, opts=None):
    if models is None:
        models, opts = _build(level)
    for step in range(first, last):
        _step(models, opts, step)
    return models, opts


def _to_apex_layout(flat):
    """optamp's flat amp state as apex.amp.state_dict() would have written it."""
    return {f"loss_scaler{i}": {"loss_scale": float(flat[f"loss_scaler{i}.scale"]),
                                "unskipped": int(flat[f"loss_scaler{i}.growth_tracker"])}
            for i in range(3)}


def _snapshot(models, opts):
    return {"models": [m.state_dict() for m in models],
            "optimizers": [o.state_dict() for o in opts],
            "amp": optamp.state_dict()}


def resume_in_this_process(checkpoints, out_path):
    """What the second process runs: per level, build as the script did, load the checkpoint
    the way Apex documents (initialize, then the models', optimizers' and amp's state), train
    the remaining steps and save the result."""
    results = {}
    for key, path in checkpoints.items():
        level = key.split("-")[0]
        optamp.reset()
        ckpt = torch.load(path, weights_only=False)
        models, opts = _build(level)
        for m, sd in zip(models, ckpt["models"]):
            m.load_state_dict(sd)
        for o, sd in zip(opts, ckpt["optimizers"]):
            o.load_state_dict(sd)
        optamp.load_state_dict(ckpt["amp"])
        _train(level, STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER, models, opts)
        results[key] = _snapshot(models, opts)
    optamp.reset()
    torch.save(results, out_path)


def test_apex_style_training_resumes_bit_exactly_in_a_new_process(tmp_path):
    import os
    import subprocess
    import sys

    checkpoints, uninterrupted = {}, {}
    for level in RESUME_LEVELS:
        optamp.reset()
        uninterrupted[level] = _snapshot(*_train(level, 0, STEPS_BEFORE + STEPS_AFTER))
        optamp.reset()
        first = _snapshot(*_train(level, 0, STEPS_BEFORE))
        if optamp.properties().loss_scale == "dynamic":
            assert optamp.loss_scaler(1).skipped_steps == 1  # the injected overflow
        for layout in ("optamp", "apex"):
            ckpt = dict(first, amp=first["amp"] if layout == "optamp"
                        else _to_apex_layout(first["amp"]))
            checkpoints[f"{level}-{layout}"] = str(tmp_path / f"{level}-{layout}.pt")
            torch.save(ckpt, checkpoints[f"{level}-{layout}"])
    optamp.reset()

    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.join(here, "..", "..", "python")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package, here, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "resumed.pt"
    code = ("import sys, test_apex_compat as t; "
            f"t.resume_in_this_process({checkpoints!r}, {str(out)!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(out, weights_only=False)

    for key, got in resumed.items():
        level, layout = key.split("-")
        want = uninterrupted[level]
        for m_got, m_want in zip(got["models"], want["models"]):
            for name in m_want:
                torch.testing.assert_close(m_got[name], m_want[name], rtol=0, atol=0,
                                           msg=f"{key} {name}")
        for o_got, o_want in zip(got["optimizers"], want["optimizers"]):
            for pid, state in o_want["state"].items():
                for name, value in state.items():
                    torch.testing.assert_close(o_got["state"][pid][name], value, rtol=0, atol=0,
                                               msg=f"{key} optimizer state {pid}.{name}")
        for name, value in want["amp"].items():
            if layout == "apex" and name.endswith(("skipped", "floor_skips", "hysteresis")):
                # Not in Apex's layout: the counters restart at 0 and the hysteresis tracker
                # is full; with hysteresis=1 (Apex had none) 0 and 1 both back off at the next
                # overflow, so training is the same, as the weights above show.
                continue
            torch.testing.assert_close(got["amp"][name], value, rtol=0, atol=0,
                                       msg=f"{key} {name}")


@pytest.mark.parametrize("level", RESUME_LEVELS)
def test_apex_style_training_stays_close_to_fp32(level):
    reference = _train("O0", 0, 6)[0]
    optamp.reset()
    models = _train(level, 0, 6)[0]
    with torch.no_grad():  # at O2, ops outside no_grad see the working copies (casting.md)
        for m_ref, m in zip(reference, models):
            for p_ref, p in zip(m_ref.parameters(), m.parameters()):
                assert torch.isfinite(p).all()
                if level == "O3":
                    # Pure fp16 Adam: v = grad^2 underflows to 0 for grads below ~2.4e-4 and the
                    # step becomes lr * m / eps (Apex's O3 does the same): not comparable.
                    continue
                torch.testing.assert_close(p.float(), p_ref, **(
                    tol("float32") if level == "O0" else tol("train_float16")))


@pytest.mark.parametrize("level", RESUME_LEVELS)
@pytest.mark.parametrize("zero_before_add", [True, False])
def test_apex_add_param_group_with_a_mixed_precision_model(level, zero_before_add):
    # Apex's test_add_param_group: a model with an fp32 and an fp16 parameter, initialized with
    # cast_model_type=False (nothing cast), one group added after a step; the result must
    # equal plain torch training of the same schedule.
    class Mixed(torch.nn.Module):
        def __init__(self, unique):
            super().__init__()
            self.weight0 = torch.nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
            self.weight1 = torch.nn.Parameter(1.0 + unique + torch.arange(2,
                                                                          dtype=torch.float16))

        def forward(self, x):
            return (x * self.weight0.float() * self.weight1.float()).sum()

    x = torch.ones(2)

    def run(use_amp):
        model0, model1 = Mixed(1), Mixed(2)
        opt = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
        if use_amp:
            [model0, model1], opt = optamp.initialize([model0, model1], opt, opt_level=level,
                                                      cast_model_type=False, verbosity=0,
                                                      loss_scale=4.0)

        def backward(loss):
            if not use_amp:
                return loss.backward()
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()

        opt.zero_grad()
        backward(model0(x))
        opt.step()
        if zero_before_add:
            opt.zero_grad()
        opt.add_param_group({"params": model1.parameters(), "lr": 0.5})
        if not zero_before_add:
            opt.zero_grad()
        for _ in range(2):
            backward(model0(x) + model1(x))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for m in (model0, model1) for p in m.parameters()]

    reference = run(False)
    final = run(True)
    for want, got in zip(reference, final):
        torch.testing.assert_close(got, want.to(got.dtype))


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_model_halved_before_initialize_is_refused_as_in_apex(level):
    model = Mlp().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"trainable parameters must be torch.float32 at "
                                         rf"opt_level {level}, got parameter fc1.weight \(Half\[8, 4\]\) "
                                         r"of torch.float16"):
        optamp.initialize(model, opt, opt_level=level, verbosity=0)
    assert not optamp.is_initialized() and model.fc1.weight.dtype == torch.float16
    # What Apex's tests did with allow_incoming_model_not_fp32: nothing cast, any dtype.
    optamp.initialize(model, opt, opt_level=level, cast_model_type=False, verbosity=0)


def test_banned_loss_raises_not_implemented_error_as_in_apex():
    init(Mlp(), None, "O1")
    x = torch.rand(2, 3, dtype=torch.float16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
        torch.nn.functional.binary_cross_entropy(x, torch.rand(2, 3))
    with optamp.disable_casts():  # Apex's allow_banned=True, for one call
        torch.nn.functional.binary_cross_entropy(x.float(), torch.rand(2, 3))


@pytest.mark.parametrize("level,kwargs", [("O3", {}), ("O2", dict(master_weights=False)),
                                          ("O3", dict(cast_model_type=torch.bfloat16))])
def test_a_model_cast_in_place_saves_fp32_state_as_apex_did(level, kwargs):
    # Apex's O2StateDictHook: checkpoints of an fp16 model hold fp32 tensors, and load back
    # into it exactly.
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, level, **kwargs)
    model(torch.randn(2, 1, 4, 4)).float().sum().backward()
    opt.step()
    sd = model.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values()), \
        {k: v.dtype for k, v in sd.items()}
    assert torch.nn.Sequential(model).state_dict()["0.conv.weight"].dtype == torch.float32
    raw = model.state_dict(keep_vars=True)  # the tensors themselves, as asked
    assert raw["conv.weight"] is model.conv.weight and raw["conv.weight"].dtype != torch.float32
    optamp.reset()
    other = TinyNet()
    init(other, torch.optim.SGD(other.parameters(), lr=0.1), level, **kwargs)
    other.load_state_dict(sd)
    for name, t in other.state_dict(keep_vars=True).items():
        torch.testing.assert_close(t, raw[name], rtol=0, atol=0, msg=name)
    optamp.reset()
    assert model.state_dict()["conv.weight"].dtype == model.conv.weight.dtype  # hook removed


@pytest.mark.parametrize("level,kwargs,expected", [
    ("O1", {}, optamp.ModelCast.NONE),
    ("O2", {}, optamp.ModelCast.WORKING_COPIES),
    ("O3", {}, optamp.ModelCast.IN_PLACE),
    ("O2", {"master_weights": False}, optamp.ModelCast.IN_PLACE),
    ("O3", {"cast_model_type": torch.float32}, optamp.ModelCast.NONE),
])
def test_model_cast_is_one_name_in_cpp_and_python(level, kwargs, expected):
    """Properties.model_cast holds C++'s to_string(ModelCast); optamp.ModelCast names its values."""
    props = optamp.resolve(level, **kwargs)
    assert optamp.ModelCast(props.model_cast) is expected
    assert props.model_cast == expected
