"""Casting checks beyond the table of test_casting.py: the casting gate (rules in an autocast
region under no_grad, none under no_grad outside one), the cast cache's drop at the outermost
autocast exit, Apex's fp32 Python functions that have no aten op of their own
(local_response_norm, normalize, softmin), complex tensors, and why opt-level rule 9 cannot be hit
from Python. The per-op cases are the shared table's (tests/op_cases.txt, through op_cases.py)."""
import pytest
import torch
import torch.nn.functional as F

import optamp
from common_utils import Mlp, init, tol
from op_cases import CPU_AND_CUDA, FP32, LEVELS, LOWER, NATIVE_PROMOTION, PROMOTE, RESULT, In


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("level", list(LEVELS))
def test_tables_in_an_autocast_region_under_no_grad(fresh, level, device):
    """Without initialize and with autograd off, an explicit region applies the full lists in
    its dtype (reduced-precision inference): every table case, as the C++ CastingTable expects."""
    low = LEVELS[level]
    m, f = In(low, device), In(torch.float32, device)
    assert not optamp.is_casting_enabled()
    with torch.no_grad(), optamp.autocast(dtype=low):
        for name, run in LOWER.items():
            assert run(f).dtype == low, name
            assert run(m).dtype == low, name
        for name, run in FP32.items():
            assert run(m).dtype == torch.float32, name
            assert run(f).dtype == torch.float32, name
        for name, run in PROMOTE.items():
            before = optamp.cast_count()
            assert run(m).dtype == RESULT.get(name, torch.float32), name
            if name in NATIVE_PROMOTION:
                assert optamp.cast_count() == before, f"{name}: torch promotes it itself"
            else:
                assert optamp.cast_count() > before, f"{name}: no input was cast"
    assert not optamp.is_casting_enabled()


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_no_rules_under_no_grad_outside_a_region(fresh, device):
    """At O1 the rules apply while autograd records; under no_grad (validation, optimizer steps)
    the lower ops run in the dtype they are given and nothing is cast."""
    init(Mlp().to(device), opt_level="O1")
    f = In(torch.float32, device)
    with torch.no_grad():
        before = optamp.cast_count()
        for name, run in LOWER.items():
            assert run(f).dtype == torch.float32, name
        assert optamp.cast_count() == before
    assert LOWER["mm"](f).dtype == torch.float16  # recording again: rules back


def test_cache_dropped_at_the_outermost_autocast_exit_only(fresh):
    layer = torch.nn.Linear(3, 4)
    x = torch.randn(2, 3)
    with optamp.autocast():
        layer(x)
        cached = optamp.cache_size()
        assert cached == 2  # weight and bias (parameters); the input is not cached
        with optamp.autocast(dtype=torch.bfloat16):
            layer(x)
            assert optamp.cache_size() == 2 * cached  # bf16 copies next to the fp16 ones
        assert optamp.cache_size() == 2 * cached, "an inner exit must keep the entries"
        with optamp.autocast(enabled=False):
            pass
        with optamp.disable_casts():
            pass
        assert optamp.cache_size() == 2 * cached
        before = optamp.cast_count()
        layer(x)
        assert optamp.cast_count() - before == 1  # only the input: weights served from the cache
    assert optamp.cache_size() == 0, "the outermost exit must drop every entry"


def _lrn(x):
    return F.local_response_norm(x, 3)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 5), (2, 4, 3, 3), (1, 4, 2, 3, 3)])
def test_local_response_norm_runs_in_fp32(fresh, shape, low):
    """Apex lists local_response_norm as fp32; it has no aten op. Its 4-D/5-D path pools with
    avg_pool3d (in the fp32 list: CPU has no fp16/bf16 kernel), its 3-D path ends in pow (fp32)
    and a promoting division. Before avg_pool3d was listed, 4-D/5-D fp16 input raised
    NotImplementedError on the CPU."""
    x = (torch.rand(*shape) + 0.5).to(low)
    reference = _lrn(x.float())
    with optamp.autocast(dtype=low):
        out = _lrn(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, **tol(low))
    init(Mlp(), opt_level="O4" if low == torch.bfloat16 else "O1")
    xg = x.clone().requires_grad_()
    out = _lrn(xg)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert xg.grad.dtype == low


@pytest.mark.parametrize("level", list(LEVELS))
def test_normalize_and_softmin_run_in_fp32(fresh, level):
    """Apex's other fp32 Python functions: normalize through linalg_vector_norm and the
    promoting division, softmin through softmax."""
    low = LEVELS[level]
    init(Mlp(), opt_level=level)
    x = (torch.rand(2, 3) + 0.5).to(low)
    for name, fn in {"normalize": F.normalize, "softmin": lambda t: F.softmin(t, 1)}.items():
        out = fn(x)
        assert out.dtype == torch.float32, name
        torch.testing.assert_close(out, fn(x.float()), **tol(low))


def test_complex_is_never_cast(fresh):
    init(Mlp(), opt_level="O1")
    c = torch.randn(2, 2, dtype=torch.complex64)
    before = optamp.cast_count()
    assert torch.mm(c, c).dtype == torch.complex64  # lower
    assert torch.exp(c).dtype == torch.complex64  # fp32
    assert torch.add(c, torch.rand(2, 2, dtype=torch.float16)).dtype == torch.complex64  # promote
    assert optamp.cast_count() == before


@pytest.mark.parametrize("level, low", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_patch_type_none_is_not_an_override(level, low):
    """Opt-level rule 9 (patching needs a type) is C++-only: from Python, None means "not
    overridden", so the level's own type stays, even with patch_torch_functions=True spelled out."""
    for overrides in ({}, {"patch_torch_functions": True}):
        props = optamp.resolve(level, patch_torch_functions_type=None, **overrides)
        assert props.patch_torch_functions is True
        assert props.patch_torch_functions_type == low
        overrides_line = next(line for line in props.describe().splitlines()
                              if line.startswith("Overrides applied"))
        assert "patch_torch_functions_type" not in overrides_line, overrides_line


@pytest.mark.parametrize("level,rules", [("O1", "FULL_LISTS"), ("O2", "MASTER_WEIGHTS"),
                                         ("O3", "PURE_LOW"), ("O0", "NONE")])
def test_rule_sets_and_policies_are_enums(fresh, level, rules):
    init(Mlp(), None, level)
    got, low = optamp.cast_rules_now("cpu")
    assert got == getattr(optamp.RuleSet, rules)
    assert (low is None) == (rules == "NONE")
    with torch.no_grad():
        assert optamp.cast_rules_now("cpu")[0] == (
            optamp.RuleSet.PURE_LOW if level == "O3" else optamp.RuleSet.NONE)
    assert optamp.policy_applies(optamp.CastPolicy.LOWER, got) == (rules != "NONE")
    assert optamp.policy_applies(optamp.CastPolicy.FP32, got) == (rules == "FULL_LISTS")
    assert optamp.CastPolicy.FP32_LOSS.name == "FP32_LOSS"
