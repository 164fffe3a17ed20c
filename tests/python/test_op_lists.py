"""op_lists="torch": O1/O4 cast by torch.autocast's own lists, checked op for op against native
autocast on the cases torch tests its lists with (torch.testing._internal.autocast_test_lists).

CPU runs here; the CUDA lists need a GPU (needs_cuda). That the tables hold exactly the ops
torch registers autocast kernels for is checked in C++ (tests/cpp/test_op_lists.cpp)."""
import pytest
import torch

import optamp

try:
    from torch.testing._internal.autocast_test_lists import (AutocastCPUTestLists,
                                                             AutocastTestLists)
    _NO_LISTS = ""
except ImportError as e:  # torch.testing._internal imports expecttest, a test-only package
    _NO_LISTS = f"torch's autocast test lists cannot be imported ({e}): pip install expecttest"

# (list attribute, how the op is called)
_CPU_CATEGORIES = [
    ("torch_16", "torch"),
    ("nn_16", "nn"),
    ("torch_fp32", "torch"),
    ("nn_fp32", "nn"),
    ("torch_need_autocast_promote", "torch"),
    ("torch_expect_builtin_promote", "torch"),
    ("methods_expect_builtin_promote", "method"),
]
_CUDA_CATEGORIES = [
    ("torch_fp16", "torch"),
    ("nn_fp16", "nn"),
    ("linalg_fp16", "linalg"),
    ("methods_fp16", "method"),
    ("torch_fp32", "torch"),
    ("nn_fp32", "nn"),
    ("methods_fp32", "method"),
    ("torch_need_autocast_promote", "torch"),
    ("torch_expect_builtin_promote", "torch"),
    ("methods_expect_builtin_promote", "method"),
]


def _cases(lists, categories):
    if _NO_LISTS:
        return [pytest.param("torch", ("mm", ()), id="no-lists",
                             marks=pytest.mark.skip(reason=_NO_LISTS))]
    out = []
    for attr, how in categories:
        for i, entry in enumerate(getattr(lists, attr)):
            out.append(pytest.param(how, entry, id=f"{attr}-{entry[0]}-{i}"))
    return out


def _call(how, entry):
    op, args = entry[0], entry[1]
    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    if isinstance(args, str):  # ("einsum", equation, operands)
        args = (args, *entry[2])
    if how == "method":
        return getattr(args[0], op)(*args[1:], **kwargs)
    module = {"torch": torch, "nn": torch._C._nn, "linalg": torch._C._linalg}[how]
    return getattr(module, op)(*args, **kwargs)


def _dtypes(out):
    if isinstance(out, torch.Tensor):
        return [out.dtype]
    if not isinstance(out, (tuple, list)):  # e.g. torch.equal's bool
        return [type(out)]
    return [t.dtype for t in out if isinstance(t, torch.Tensor)]


def _native(device, dtype, how, entry):
    with torch.autocast(device, dtype=dtype):
        return _call(how, entry)


def _optamp(level, how, entry):
    optamp.reset()
    optamp.initialize(torch.nn.Linear(1, 1), opt_level=level, op_lists="torch", verbosity=0)
    try:
        return _call(how, entry)
    finally:
        optamp.reset()


def _check_against_native(device, level, dtype, how, entry):
    try:
        expected = _native(device, dtype, how, entry)
    except RuntimeError as e:
        # Native CPU autocast's promote handles bf16 only: cat/stack of fp16 with fp32 fails
        # there ("Unexpected floating ScalarType in at::autocast::prioritize"). optamp
        # promotes to the widest input, fp32, as native does for bf16.
        assert "prioritize" in str(e) and dtype == torch.float16, e
        assert _dtypes(_optamp(level, how, entry)) == [torch.float32]
        return
    actual = _optamp(level, how, entry)
    assert _dtypes(actual) == _dtypes(expected), f"{entry[0]}: optamp {_dtypes(actual)}, " \
                                                 f"native autocast {_dtypes(expected)}"
    if isinstance(expected, torch.Tensor) and expected.is_floating_point():
        # The same casts of the same inputs: the same numbers.
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    elif isinstance(expected, bool):
        assert actual == expected, f"{entry[0]}: optamp {actual}, native autocast {expected}"


_CPU_LISTS = None if _NO_LISTS else AutocastCPUTestLists(torch.device("cpu"))


@pytest.mark.parametrize("how,entry", _cases(_CPU_LISTS, _CPU_CATEGORIES))
def test_o4_torch_lists_match_native_cpu_autocast_bf16(how, entry):
    _check_against_native("cpu", "O4", torch.bfloat16, how, entry)


@pytest.mark.parametrize("how,entry", _cases(_CPU_LISTS, _CPU_CATEGORIES))
def test_o1_torch_lists_match_native_cpu_autocast_fp16(how, entry):
    _check_against_native("cpu", "O1", torch.float16, how, entry)


def _cuda_cases():
    if _NO_LISTS:
        return _cases(None, [])
    if not torch.cuda.is_available():
        return [pytest.param("torch", ("mm", ()), id="no-cuda")]
    return _cases(AutocastTestLists(torch.device("cuda")), _CUDA_CATEGORIES)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("how,entry", _cuda_cases())
def test_o1_torch_lists_match_native_cuda_autocast_CUDA(how, entry):
    _check_against_native("cuda", "O1", torch.float16, how, entry)


@pytest.mark.needs_cuda
def test_torch_lists_ban_binary_cross_entropy_on_cuda_CUDA():
    x = torch.rand(4, device="cuda")
    optamp.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists="torch", verbosity=0)
    try:
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            torch.nn.functional.binary_cross_entropy(x, x)
    finally:
        optamp.reset()


def test_the_two_lists_differ_where_apex_and_torch_disagree():
    # gelu and layer_norm: fp32 in Apex's lists, unlisted on CPU in torch's (native autocast runs
    # them in the input's dtype); binary_cross_entropy: banned by Apex, fp32 on CPU in torch's.
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    results = {}
    for lists in ("apex", "torch"):
        optamp.reset()
        optamp.initialize(torch.nn.Linear(1, 1), opt_level="O4", op_lists=lists, verbosity=0)
        try:
            results[lists] = (torch.nn.functional.gelu(x).dtype,
                              torch.nn.functional.layer_norm(x, (4,)).dtype)
            p = torch.rand(4)
            if lists == "apex":
                with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
                    torch.nn.functional.binary_cross_entropy(p, p)
            else:
                assert torch.nn.functional.binary_cross_entropy(p.bfloat16(), p).dtype == torch.float32
        finally:
            optamp.reset()
    assert results["apex"] == (torch.float32, torch.float32)
    assert results["torch"] == (torch.bfloat16, torch.bfloat16)


def test_o5_with_torch_lists_keeps_losses_fp32():
    model = torch.nn.Linear(4, 3)
    # bf16 logits out of the model (the boundary's default would make them fp32)
    optamp.initialize(model, opt_level="O5", op_lists="torch", verbosity=0,
                      cast_model_outputs=torch.bfloat16)
    try:
        logits = model(torch.randn(2, 4))
        assert logits.dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2])).dtype == torch.float32
        # Not a loss: an fp32-list op of torch's CPU list is no rule at O5.
        assert torch.prod(logits, 0).dtype == torch.bfloat16
    finally:
        optamp.reset()


def test_op_lists_is_validated_and_reported():
    with pytest.raises(ValueError, match='op_lists must be "apex".*or "torch".*got "native"'):
        optamp.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists="native", verbosity=0)
    with pytest.raises(TypeError, match="op_lists must be a str"):
        optamp.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists=1, verbosity=0)
    assert not optamp.is_initialized()
    assert optamp.resolve("O4").op_lists == "apex"
    props = optamp.resolve("O4", op_lists="torch")
    assert props.op_lists == "torch" and "op_lists" in props.describe()
    report = optamp.policy_report()
    assert "  aten::mm: lower | lower\n" in report
    assert "  aten::gelu: fp32\n" in report  # Apex's row; torch lists gelu nowhere
    assert "aten::gelu: -" not in report


@pytest.mark.skipif(bool(_NO_LISTS), reason=_NO_LISTS or "-")
def test_harness_calls_every_shape_of_entry_in_the_cuda_lists():
    """The CUDA lists have entry shapes the CPU lists lack (einsum's equation before its
    operands, equal's bool result): the harness must call and compare each of them. Built on
    the CPU, called without autocast: an op the CPU lacks may raise RuntimeError, nothing else."""
    lists = AutocastTestLists(torch.device("cpu"))
    called = 0
    for attr, how in _CUDA_CATEGORIES:
        for entry in getattr(lists, attr):
            try:
                out = _call(how, entry)
            except RuntimeError:
                continue
            assert _dtypes(out), entry[0]
            called += 1
    assert called > 50
