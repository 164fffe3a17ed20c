"""The C ABI (include/optamp/c_api.h) from a foreign language: ctypes loads the liboptamp that
optamp._C uses and drives initialize, a region and a scaler on tensors passed as at::Tensor*
handles (optamp._C._tensor_handle), as a binding over LibTorch (tch-rs, TorchSharp, R torch)
would through its own shim."""
import ctypes
import io
import os

import pytest
import torch

import optamp
from optamp import _C

c_int, c_size_t, c_double, c_void_p, c_char_p = (ctypes.c_int, ctypes.c_size_t, ctypes.c_double,
                                                 ctypes.c_void_p, ctypes.c_char_p)
P = ctypes.POINTER

OK, ERROR_VALUE, ERROR_NULL_ARGUMENT = 0, 1, 5
DTYPE_FLOAT16, DTYPE_BFLOAT16 = 2, 3


class Properties(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("opt_level", c_int), ("enabled", c_int),
                ("loss_scale_dynamic", c_int), ("loss_scale", c_double), ("low_dtype", c_int),
                ("num_losses", c_int), ("casts", c_int), ("model_cast", c_int),
                ("cast_model_type", c_int), ("keep_batchnorm_fp32", c_int),
                ("master_weights", c_int), ("patch_torch_functions", c_int)]


class ModelTensors(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("reduced", P(c_void_p)), ("num_reduced", c_size_t),
                ("keep_fp32", P(c_void_p)), ("num_keep_fp32", c_size_t),
                ("parameters", P(c_void_p)), ("num_parameters", c_size_t),
                ("parameter_names", P(c_char_p)), ("identities", P(c_void_p)),
                ("num_identities", c_size_t)]


class OptimizerTensors(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("identity", c_void_p), ("description", c_char_p),
                ("parameters", P(c_void_p)), ("num_parameters", c_size_t),
                ("state", P(c_void_p)), ("state_owners", P(c_void_p)), ("num_state", c_size_t),
                ("smallest_eps", c_double), ("steps_through_closure", c_int)]


def _load():
    lib = ctypes.CDLL(_C._library_path())
    signatures = {
        "optamp_abi_version": (ctypes.c_uint32, []),
        "optamp_last_error": (c_char_p, []),
        "optamp_status_name": (c_char_p, [c_int]),
        "optamp_initialize": (c_int, [P(ModelTensors), P(OptimizerTensors), c_size_t, c_char_p,
                                      P(c_char_p), P(c_char_p), c_size_t, P(Properties)]),
        "optamp_is_initialized": (c_int, []),
        "optamp_reset": (c_int, []),
        "optamp_autocast_enter": (c_int, [c_int, c_int, P(c_void_p)]),
        "optamp_autocast_exit": (c_int, [c_void_p]),
        "optamp_disable_casts_enter": (c_int, [P(c_void_p)]),
        "optamp_disable_casts_exit": (c_int, [c_void_p]),
        "optamp_scale_loss_begin": (c_int, [c_void_p, P(c_void_p), c_size_t, P(c_void_p),
                                            c_size_t, c_int, c_int, P(c_void_p), P(c_void_p)]),
        "optamp_scale_loss_finish": (c_int, [c_void_p, P(c_int)]),
        "optamp_step_should_skip": (c_int, [P(c_void_p), c_size_t, P(c_int)]),
        "optamp_loss_scale": (c_int, [c_int, P(c_double)]),
        "optamp_state_save": (c_int, [P(P(ctypes.c_uint8)), P(c_size_t)]),
        "optamp_state_load": (c_int, [P(ctypes.c_uint8), c_size_t]),
        "optamp_buffer_free": (None, [P(ctypes.c_uint8)]),
        "optamp_tensor_free": (None, [c_void_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


LIB = _load()


def ok(status):
    """Fails with the C API's own message unless `status` is OPTAMP_OK."""
    assert status == OK, (LIB.optamp_status_name(status).decode(),
                          LIB.optamp_last_error().decode())


class Handles:
    """at::Tensor* handles of Python tensors (each shares its tensor), freed together."""

    def __init__(self):
        self.owned = []

    def of(self, tensor):
        handle = _C._tensor_handle(tensor)
        self.owned.append(handle)
        return handle

    def array(self, tensors):
        return (c_void_p * len(tensors))(*[self.of(t) for t in tensors])

    def free(self):
        for handle in self.owned:
            _C._free_tensor_handle(handle)
        self.owned.clear()


@pytest.fixture
def handles(fresh):
    h = Handles()
    yield h
    h.free()


def _strings(values):
    return (c_char_p * len(values))(*[v.encode() if v is not None else None for v in values])


class Session:
    """A small model and its SGD, initialized through the C API."""

    def __init__(self, handles, opt_level="O1", options=None):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                         torch.nn.Linear(8, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.params = list(self.model.parameters())
        self.param_handles = handles.array(self.params)
        names = [n for n, _ in self.model.named_parameters()]
        self._names = _strings(names)
        self._identities = (c_void_p * 1)(id(self.model))
        model = ModelTensors(ctypes.sizeof(ModelTensors), self.param_handles, len(self.params),
                             None, 0, self.param_handles, len(self.params), self._names,
                             self._identities, 1)
        optimizer = OptimizerTensors(ctypes.sizeof(OptimizerTensors), id(self.optimizer),
                                     b"optimizer 0 (SGD)", self.param_handles, len(self.params),
                                     None, None, 0, 0.0, 0)
        options = {"verbosity": "0", **(options or {})}
        self.properties = Properties(ctypes.sizeof(Properties))
        ok(LIB.optamp_initialize(ctypes.byref(model), ctypes.byref(optimizer), 1,
                                 opt_level.encode(), _strings(list(options)),
                                 _strings(list(options.values())), len(options),
                                 ctypes.byref(self.properties)))
        self.identities = (c_void_p * 1)(id(self.optimizer))
        self.handles = handles

    def loss(self):
        torch.manual_seed(1)
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        return torch.nn.functional.mse_loss(self.model(x), y)

    def scaled_backward(self, loss, corrupt=None):
        """One guard: begin, backward on the scaled tensor from its handle, finish. Returns
        (skipped, the scaled loss)."""
        guard, scaled = c_void_p(), c_void_p()
        ok(LIB.optamp_scale_loss_begin(self.handles.of(loss), self.identities, 1,
                                       self.param_handles, len(self.params), 0, 0,
                                       ctypes.byref(guard), ctypes.byref(scaled)))
        scaled_loss = _C._tensor_from_handle(scaled.value)
        LIB.optamp_tensor_free(scaled)
        scaled_loss.backward()
        if corrupt is not None:
            corrupt()
        skipped = c_int(-1)
        ok(LIB.optamp_scale_loss_finish(guard, ctypes.byref(skipped)))
        return skipped.value, scaled_loss

    def should_skip(self):
        skip = c_int(-1)
        ok(LIB.optamp_step_should_skip(self.param_handles, len(self.params), ctypes.byref(skip)))
        return skip.value

    def loss_scale(self):
        scale = c_double()
        ok(LIB.optamp_loss_scale(0, ctypes.byref(scale)))
        return scale.value


def test_abi_version_and_the_library_of_the_package():
    assert LIB.optamp_abi_version() == 1
    assert LIB.optamp_status_name(ERROR_NULL_ARGUMENT) == b"OPTAMP_ERROR_NULL_ARGUMENT"
    # The package's own library (initialize through one is seen by the other: next test).
    assert os.path.basename(_C._library_path()).startswith("liboptamp")


def test_initialize_through_the_c_api_is_the_packages_session(handles):
    s = Session(handles, "O1")
    assert LIB.optamp_is_initialized() == 1
    assert optamp.is_initialized()
    assert (s.properties.opt_level, s.properties.loss_scale_dynamic) == (1, 1)
    assert s.properties.low_dtype == DTYPE_FLOAT16
    assert s.loss_scale() == 65536.0


def test_errors_are_codes_with_a_message(handles):
    model = ModelTensors(ctypes.sizeof(ModelTensors))
    status = LIB.optamp_initialize(None, None, 0, b"O1", None, None, 0, None)
    assert status == ERROR_NULL_ARGUMENT
    assert LIB.optamp_last_error() == b"optamp_initialize: model must not be NULL"
    status = LIB.optamp_initialize(ctypes.byref(model), None, 0, b"O1", _strings(["loss_scal"]),
                                   _strings(["128"]), 1, None)
    assert status == ERROR_VALUE
    assert b'got "loss_scal"' in LIB.optamp_last_error()
    assert LIB.optamp_is_initialized() == 0


def test_a_region_casts_mm_and_its_exit_restores_fp32(handles):
    Session(handles, "O1")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.no_grad():  # O1's rules stay off under no_grad; a region casts there too
        assert torch.mm(a, b).dtype == torch.float32
        for dtype, expected in ((DTYPE_FLOAT16, torch.float16), (DTYPE_BFLOAT16, torch.bfloat16)):
            region = c_void_p()
            ok(LIB.optamp_autocast_enter(1, dtype, ctypes.byref(region)))
            assert torch.mm(a, b).dtype == expected
            ok(LIB.optamp_autocast_exit(region))
            assert torch.mm(a, b).dtype == torch.float32
    # O1 casts with grad on; a disable_casts region turns it off.
    assert torch.mm(a, b).dtype == torch.float16
    region = c_void_p()
    ok(LIB.optamp_disable_casts_enter(ctypes.byref(region)))
    assert torch.mm(a, b).dtype == torch.float32
    ok(LIB.optamp_disable_casts_exit(region))
    assert torch.mm(a, b).dtype == torch.float16


def test_scale_loss_unscales_to_the_plain_losss_gradients(handles):
    s = Session(handles, "O1")
    region = c_void_p()
    ok(LIB.optamp_disable_casts_enter(ctypes.byref(region)))  # fp32: scaling by 2^16 is exact
    try:
        s.optimizer.zero_grad()
        s.loss().backward()
        plain = [p.grad.clone() for p in s.params]
        s.optimizer.zero_grad()
        loss = s.loss()
        skipped, scaled = s.scaled_backward(loss)
    finally:
        ok(LIB.optamp_disable_casts_exit(region))
    assert skipped == 0
    assert torch.equal(scaled.detach(), loss.detach() * 65536.0)
    for p, g in zip(s.params, plain):
        assert torch.equal(p.grad, g)
    assert s.should_skip() == 0
    before = [p.detach().clone() for p in s.params]
    s.optimizer.step()
    assert not torch.equal(s.params[0], before[0])


def test_an_injected_inf_skips_the_step_and_halves_the_scale(handles):
    s = Session(handles, "O1")
    s.optimizer.zero_grad()

    def corrupt():
        s.params[0].grad[0, 0] = float("inf")

    skipped, _ = s.scaled_backward(s.loss(), corrupt)
    assert skipped == 1
    assert s.should_skip() == 1
    assert all(p.grad is None for p in s.params)
    assert s.loss_scale() == 32768.0
    assert optamp.loss_scaler(0).loss_scale() == 32768.0


def _save():
    data, size = P(ctypes.c_uint8)(), c_size_t()
    ok(LIB.optamp_state_save(ctypes.byref(data), ctypes.byref(size)))
    try:
        return ctypes.string_at(data, size.value)
    finally:
        LIB.optamp_buffer_free(data)


def _same(a, b):
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def test_state_bytes_round_trip_bit_exactly(handles):
    s = Session(handles, "O1")
    s.optimizer.zero_grad()
    s.scaled_backward(s.loss(), lambda: s.params[1].grad.fill_(float("nan")))
    saved = _save()
    expected = _C.state_dict()
    _same(torch.load(io.BytesIO(saved)), expected)  # torch's own format
    assert expected["loss_scaler0.skipped"].item() == 1

    s.optimizer.zero_grad()
    s.scaled_backward(s.loss(), lambda: s.params[1].grad.fill_(float("inf")))
    assert s.loss_scale() == 16384.0
    buffer = (ctypes.c_uint8 * len(saved)).from_buffer_copy(saved)
    ok(LIB.optamp_state_load(buffer, len(saved)))
    _same(_C.state_dict(), expected)
    assert s.loss_scale() == 32768.0

    garbage = (ctypes.c_uint8 * 3)(1, 2, 3)
    assert LIB.optamp_state_load(garbage, 3) == ERROR_VALUE
    assert b"data must be the bytes of optamp_state_save" in LIB.optamp_last_error()
    _same(_C.state_dict(), expected)
