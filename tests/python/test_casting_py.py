"""The C++ table-driven dtype tests (tests/cpp/test_casting.cpp), mirrored from Python through
optamp.initialize on a tiny model, plus the per-thread guards and custom functions."""
import threading

import pytest
import torch
import torch.nn.functional as F

import optamp
from _amp_helpers import Mlp, fresh, init  # noqa: F401

LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}


def r(*shape, dtype=torch.float32):
    return torch.rand(*shape, dtype=dtype) + 0.5


LOWER = {
    "conv2d": lambda t: F.conv2d(r(1, 1, 4, 4, dtype=t), r(2, 1, 3, 3, dtype=t)),
    "linear": lambda t: F.linear(r(2, 3, dtype=t), r(4, 3, dtype=t)),
    "matmul": lambda t: torch.matmul(r(2, 3, dtype=t), r(3, 2, dtype=t)),
    "mm": lambda t: torch.mm(r(2, 3, dtype=t), r(3, 2, dtype=t)),
    "bmm": lambda t: torch.bmm(r(2, 2, 3, dtype=t), r(2, 3, 2, dtype=t)),
    "addmm": lambda t: torch.addmm(r(2, 2, dtype=t), r(2, 3, dtype=t), r(3, 2, dtype=t)),
    "einsum": lambda t: torch.einsum("ij,jk->ik", r(2, 3, dtype=t), r(3, 2, dtype=t)),
    "prelu": lambda t: F.prelu(r(2, 3, dtype=t), r(1, dtype=t)),
    "sdpa": lambda t: F.scaled_dot_product_attention(
        r(1, 2, 3, dtype=t), r(1, 2, 3, dtype=t), r(1, 2, 3, dtype=t)),
}
FP32 = {
    "softmax": lambda t: torch.softmax(r(2, 3, dtype=t), 1),
    "log_softmax": lambda t: F.log_softmax(r(2, 3, dtype=t), 1),
    "gelu": lambda t: F.gelu(r(2, 3, dtype=t)),
    "layer_norm": lambda t: F.layer_norm(r(2, 3, dtype=t), (3,)),
    "exp": lambda t: torch.exp(r(3, dtype=t)),
    "sum": lambda t: torch.sum(r(3, dtype=t)),
    "pow": lambda t: torch.pow(r(3, dtype=t), 2),
    "cumsum": lambda t: torch.cumsum(r(3, dtype=t), 0),
    "mse_loss": lambda t: F.mse_loss(r(4, dtype=t), r(4, dtype=t)),
    "cross_entropy": lambda t: F.cross_entropy(r(2, 3, dtype=t), torch.tensor([0, 2])),
    "interpolate_nearest": lambda t: F.interpolate(r(1, 1, 4, 4, dtype=t), scale_factor=2.0),
    "interpolate_nearest_exact": lambda t: F.interpolate(
        r(1, 1, 4, 4, dtype=t), scale_factor=2.0, mode="nearest-exact"),
    "interpolate_nearest_exact_1d": lambda t: F.interpolate(
        r(1, 1, 4, dtype=t), size=7, mode="nearest-exact"),
    "interpolate_bilinear": lambda t: F.interpolate(
        r(1, 1, 4, 4, dtype=t), size=(3, 5), mode="bilinear"),
    "interpolate_bilinear_antialias": lambda t: F.interpolate(
        r(1, 1, 4, 4, dtype=t), size=(2, 3), mode="bilinear", antialias=True),
    "interpolate_bicubic_antialias": lambda t: F.interpolate(
        r(1, 1, 4, 4, dtype=t), size=(2, 3), mode="bicubic", antialias=True),
}
PROMOTE = {
    "dot": lambda t: torch.dot(r(3, dtype=t), r(3)),
    "addcmul": lambda t: torch.addcmul(r(3, dtype=t), r(3), r(3, dtype=t)),
    "cross": lambda t: torch.linalg.cross(r(2, 3, dtype=t), r(2, 3)),
    "add": lambda t: torch.add(r(3, dtype=t), r(3)),
    "cat": lambda t: torch.cat([r(3, dtype=t), r(3)]),
    "stack": lambda t: torch.stack([r(3, dtype=t), r(3)]),
}


@pytest.mark.parametrize("level", list(LEVELS))
def test_tables_through_initialize(fresh, level):  # noqa: F811
    low = LEVELS[level]
    init(Mlp(), opt_level=level)
    for name, run in LOWER.items():
        assert run(torch.float32).dtype == low, name
        assert run(low).dtype == low, name
    for name, run in FP32.items():
        assert run(low).dtype == torch.float32, name
        assert run(torch.float32).dtype == torch.float32, name
    for name, run in PROMOTE.items():
        assert run(low).dtype == torch.float32, name
    a = r(3, dtype=low)
    assert torch.add(a, a).dtype == low
    p = torch.rand(4).clamp(0.1, 0.9)
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(p, p)


def test_doubles_ints_and_no_grad_are_left_alone(fresh):  # noqa: F811
    init(Mlp(), opt_level="O1")
    d = torch.rand(2, 2, dtype=torch.float64)
    assert torch.mm(d, d).dtype == torch.float64
    i = torch.ones(2, 2, dtype=torch.int64)
    assert torch.mm(i, i).dtype == torch.int64
    x = r(2, 2)
    with torch.no_grad():
        assert torch.mm(x, x).dtype == torch.float32  # validation stays fp32
        with optamp.autocast():
            assert torch.mm(x, x).dtype == torch.float16
        with optamp.autocast(dtype=torch.bfloat16):
            assert torch.mm(x, x).dtype == torch.bfloat16


def test_grads_flow_back_in_fp32(fresh):  # noqa: F811
    model = Mlp()
    init(model, opt_level="O1")
    out = model(torch.randn(5, 4))
    assert out.dtype == torch.float16
    F.cross_entropy(out, torch.tensor([0, 1, 2, 0, 1])).backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_disable_casts_and_autocast_are_context_managers(fresh):  # noqa: F811
    x = r(2, 2)
    assert not optamp.is_casting_enabled()
    with optamp.autocast(dtype=torch.bfloat16):
        assert optamp.is_casting_enabled()
        assert torch.mm(x, x).dtype == torch.bfloat16
        with optamp.disable_casts():
            assert torch.mm(x, x).dtype == torch.float32
        with optamp.autocast(enabled=False):
            assert torch.mm(x, x).dtype == torch.float32
        assert torch.mm(x, x).dtype == torch.bfloat16
    assert not optamp.is_casting_enabled()
    assert torch.mm(x, x).dtype == torch.float32
    with pytest.raises(ValueError, match="torch.float64"):
        with optamp.autocast(dtype=torch.float64):
            pass
    with pytest.raises(TypeError, match="dtype"):
        optamp.autocast(dtype="half")


def test_casting_is_per_thread_and_can_be_carried(fresh):  # noqa: F811
    init(Mlp(), opt_level="O1")
    x = r(2, 2)
    state = optamp.ThreadState.capture()
    seen = {}

    def worker():
        seen["plain"] = torch.mm(x, x).dtype
        with optamp.thread_state_guard(state):
            seen["carried"] = torch.mm(x, x).dtype

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"plain": torch.float32, "carried": torch.float16}
    assert torch.mm(x, x).dtype == torch.float16


def test_thread_state_carries_o2_working_copies(fresh):  # noqa: F811
    model = Mlp()
    init(model, opt_level="O2")
    state = optamp.ThreadState.capture()
    assert state.key_on and state.substitution_on
    seen = {}

    def worker():
        seen["plain"] = torch.add(model.fc1.weight, 1.0).dtype
        with optamp.thread_state_guard(state):
            seen["carried"] = torch.add(model.fc1.weight, 1.0).dtype
        seen["after"] = torch.add(model.fc1.weight, 1.0).dtype

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"plain": torch.float32, "carried": torch.float16, "after": torch.float32}


def test_guard_must_exit_on_the_entering_thread(fresh):  # noqa: F811
    guard = optamp.disable_casts()
    guard.__enter__()
    errors = []

    def other():
        try:
            guard.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread that entered" in errors[0]
    guard.__exit__(None, None, None)


def test_cache_and_counters(fresh):  # noqa: F811
    model = Mlp()
    init(model, opt_level="O2")
    optamp.clear_cache()
    before = optamp.cast_count()
    model(torch.randn(2, 4))
    made = optamp.cast_count() - before
    assert made > 0 and optamp.cache_size() > 0
    model(torch.randn(2, 4))  # weights reused from the cache: only the input is cast again
    assert optamp.cast_count() - before - made < made
    optamp.clear_cache()
    assert optamp.cache_size() == 0
    report = optamp.policy_report()
    assert "aten::mm" in report and "skipped" in report


def test_cache_stays_bounded_when_python_tensors_die(fresh):  # noqa: F811
    # A Python tensor that dies while the cache's cast (through its autograd graph) still holds
    # the TensorImpl keeps its PyObject alive: liveness can't be read off the C++ refcount alone.
    init(Mlp(), opt_level="O1")
    x = torch.randn(2, 4)
    peak = 0
    for i in range(1000):
        layer = torch.nn.Linear(4, 3)  # fresh parameters every iteration, then dropped
        layer(x)
        if i % 10 == 0:
            peak = max(peak, optamp.cache_size())
    assert peak <= 200, peak


def test_register_ops_and_errors(fresh):  # noqa: F811
    with pytest.raises(ValueError, match="nosuchns::nosuchop"):
        optamp.register_half_op("nosuchns::nosuchop")
    optamp.register_half_op("aten::outer")  # before initialize: takes effect at initialize
    init(Mlp(), opt_level="O1")
    assert torch.outer(r(3), r(3)).dtype == torch.float16
    optamp.register_float_op("aten::outer")  # newest wins
    assert torch.outer(r(3, dtype=torch.float16), r(3, dtype=torch.float16)).dtype == torch.float32


class _Funcs:
    @staticmethod
    def combine(a, pair):
        return a, pair[0], pair[1]

    @staticmethod
    def weird(a, b):
        return a + b


def test_python_function_registration_before_and_after_initialize(fresh):  # noqa: F811
    ns = type("ns", (), {})()
    ns.combine = _Funcs.combine
    ns.mix = _Funcs.weird
    optamp.register_half_function(ns, "combine")  # before initialize
    a, b, c = ns.combine(r(2), [r(2), torch.ones(2, dtype=torch.float64)])
    assert (a.dtype, b.dtype, c.dtype) == (torch.float32,) * 2 + (torch.float64,)  # inactive
    init(Mlp(), opt_level="O4")
    a, b, c = ns.combine(r(2), [r(2), torch.ones(2, dtype=torch.float64)])
    assert (a.dtype, b.dtype, c.dtype) == (torch.bfloat16, torch.bfloat16, torch.float64)
    optamp.register_promote_function(ns, "mix")  # after initialize
    assert ns.mix(r(2, dtype=torch.bfloat16), r(2)).dtype == torch.float32

    @optamp.float_function
    def as_is(x):
        return x

    assert as_is(r(2, dtype=torch.bfloat16)).dtype == torch.float32

    @optamp.half_function
    def h(x):
        return x

    assert h(r(2)).dtype == torch.bfloat16
    with optamp.disable_casts():
        assert h(r(2)).dtype == torch.float32
    with pytest.raises(ValueError, match="No function named nope in module"):
        optamp.register_half_function(torch, "nope")
    with pytest.raises(TypeError, match="torch.__version__ must be callable, got "):
        optamp.register_half_function(torch, "__version__")
    for decorator, kind in [(optamp.half_function, "half"), (optamp.float_function, "float"),
                            (optamp.promote_function, "promote")]:
        with pytest.raises(TypeError, match=f"{kind}_function expects a callable .* got int"):
            decorator(3)


def test_registered_builtin_wins_over_its_table_policy(fresh):  # noqa: F811
    import types

    ns = types.SimpleNamespace(gelu=F.gelu)  # a C builtin in the fp32 list
    optamp.register_half_function(ns, "gelu")
    init(Mlp(), opt_level="O4")
    assert ns.gelu(r(3)).dtype == torch.bfloat16
    assert F.gelu(r(3, dtype=torch.bfloat16)).dtype == torch.float32  # the table still holds
