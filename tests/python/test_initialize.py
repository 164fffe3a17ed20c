"""optamp.initialize from Python: return shapes, optimizers, validation, levels, outputs."""
import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import optamp
from common_utils import Mlp, TinyNet, init, tol


class MySGD(torch.optim.Optimizer):
    """A custom optimizer subclass: plain SGD written by hand."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class GroupCountedAdam(torch.optim.Optimizer):
    """Keeps state beside its parameters', as many optimizers outside torch.optim do (group
    step counts, Prodigy's d, ASGD's norms): a group's step count advances on every call and a
    group-level statistic is rewritten, whether or not a parameter has a gradient."""

    def __init__(self, params, lr=1e-2, eps=1e-8):
        super().__init__(params, dict(lr=lr, eps=eps, step=0, grad_norm=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            grads = [p.grad for p in group["params"] if p.grad is not None]
            group["grad_norm"] = float(sum(g.norm() ** 2 for g in grads)) ** 0.5
            correction = 1 - 0.999 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                v = state.setdefault("v", torch.zeros_like(p))
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.addcdiv_(p.grad, (v / correction).sqrt_().add_(group["eps"]), value=-group["lr"])


class NeedsGradients(MySGD):
    """Refuses a step without any gradient, as pytorch_optimizer's Adai and AdamS do."""

    @torch.no_grad()
    def step(self, closure=None):
        if all(p.grad is None for group in self.param_groups for p in group["params"]):
            raise RuntimeError("NeedsGradients: no parameter has a gradient")
        super().step(closure)


OPTIMIZERS = {
    "SGD": lambda ps, eps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": lambda ps, eps: torch.optim.Adam(ps, lr=1e-2, **eps),
    "AdamW": lambda ps, eps: torch.optim.AdamW(ps, lr=1e-2, **eps),
    "RMSprop": lambda ps, eps: torch.optim.RMSprop(ps, lr=1e-2, **eps),
    "Adagrad": lambda ps, eps: torch.optim.Adagrad(ps, lr=1e-2, **eps),
    "Adagrad_fused": lambda ps, eps: torch.optim.Adagrad(ps, lr=1e-2, fused=True, **eps),
    "Adadelta": lambda ps, eps: torch.optim.Adadelta(ps, lr=1.0, **eps),
    "Adafactor": lambda ps, eps: torch.optim.Adafactor(ps, lr=1e-2),  # eps: (None, 1e-3)
    "Adamax": lambda ps, eps: torch.optim.Adamax(ps, lr=1e-2, **eps),
    "ASGD": lambda ps, eps: torch.optim.ASGD(ps, lr=1e-2),
    "NAdam": lambda ps, eps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True,
                                               weight_decay=1e-2, **eps),
    "RAdam": lambda ps, eps: torch.optim.RAdam(ps, lr=1e-2, foreach=True, **eps),
    "Rprop": lambda ps, eps: torch.optim.Rprop(ps, lr=1e-2),
    "custom": lambda ps, eps: MySGD(ps, lr=0.1),
    "group_state": lambda ps, eps: GroupCountedAdam(ps, lr=1e-2, **eps),
    "needs_gradients": lambda ps, eps: NeedsGradients(ps, lr=0.1),
}
# The dtype the optimizer steps (the model's parameters) at each level.
PARAM_DTYPE = {"O1": torch.float32, "O2": torch.float32, "O3": torch.float16,
               "O4": torch.float32, "O5": torch.float32}


def step(model, opt, x, y, **kw):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with optamp.scale_loss(loss, opt, **kw) as scaled:
        scaled.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", list(PARAM_DTYPE))
def test_every_optimizer_trains(fresh, name, level):
    model = Mlp()
    # O3 steps fp16 weights: eps >= 1e-4 (docs/opt_levels.md, O3 caveats); the defaults warn.
    eps = dict(eps=1e-4) if level == "O3" else {}
    opt = OPTIMIZERS[name](model.parameters(), eps)
    if level != "O3":
        # Some optimizer state before initialize (the device check reads it). Not at O3: state
        # made for the fp32 weights stays fp32 after they are cast to fp16.
        F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eps warning at O3 with eps=1e-4
        m2, o2 = init(model, opt, opt_level=level)
    assert m2 is model and o2 is opt
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for _ in range(3):
        loss = step(model, opt, x, y)
    assert torch.isfinite(loss)
    assert all(p.dtype == PARAM_DTYPE[level] for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert optamp.loss_scaler().skipped_steps == 0
    # O1/O4: the ops' dtype; O2/O3/O5: fp32 at the model boundary (Apex's patched forward)
    assert model(x).dtype == {"O1": torch.float16, "O4": torch.bfloat16}.get(level, torch.float32)


def _same(a, b):
    """Bitwise equality of two optimizer state_dicts (tensors, numbers, nested containers)."""
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", list(PARAM_DTYPE))
def test_every_optimizer_skips_an_overflow_bit_exactly(fresh, name, level):
    """An inf in the loss skips the step: weights and every piece of optimizer state (moments,
    step counts, Rprop's step sizes, ASGD's averages, Adafactor's factors, a group's own
    counters) stay bit for bit. The skipped call does not reach the optimizer, as under
    GradScaler: one that refuses a step without gradients is not called (until 2026-12-07 it
    was, with the grads set to None, and group-level state advanced)."""
    model = Mlp()
    opt = OPTIMIZERS[name](model.parameters(), dict(eps=1e-4) if level == "O3" else {})
    model, opt = init(model, opt, opt_level=level)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for _ in range(2):
        step(model, opt, x, y)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    with optamp.scale_loss(F.cross_entropy(model(x), y) * math.inf, opt) as scaled:
        scaled.backward()
    opt.step()
    assert optamp.loss_scaler().last_step_skipped and optamp.loss_scaler().skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert _same(state, opt.state_dict())
    step(model, opt, x, y)
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))


def test_return_shapes_follow_the_inputs(fresh):
    m, n = Mlp(), Mlp()
    assert init(m) is m
    optamp.reset()
    assert init([m, n]) == [m, n]
    optamp.reset()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    assert init(m, o) == (m, o)
    optamp.reset()
    o2 = torch.optim.SGD(n.parameters(), lr=0.1)
    assert init([m, n], [o, o2]) == ([m, n], [o, o2])
    optamp.reset()
    assert init(m, [o]) == (m, [o])


def test_enabled_false_returns_untouched_and_scale_loss_is_identity(fresh):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert init(model, opt, enabled=False, opt_level="O3", cast_model_outputs=torch.float16) == (
        model, opt)
    assert "forward" not in model.__dict__
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32 and model.fc1.weight.dtype == torch.float32
    loss = out.sum()
    with optamp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item())
        scaled.backward()


class _DPOptimizer(torch.optim.SGD):
    """Stands for Opacus's DPOptimizer (``opacus.optimizers.optimizer``), not installed here:
    optamp tells it by the module its class comes from. Like Opacus, it recombines the
    gradients with an ``einsum`` in ``step()`` with grad mode on, and assigns them to ``p.grad``
    (which refuses a gradient of another dtype)."""

    def step(self, closure=None):
        self.einsum_dtypes = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    clipped = torch.einsum("i,i...", torch.ones(1), p.grad.unsqueeze(0))
                    self.einsum_dtypes.append(clipped.dtype)
                    p.grad = clipped.view_as(p)
        return super().step(closure)


_DPOptimizer.__module__ = "opacus.optimizers.optimizer"


@pytest.mark.parametrize("level, refused", [("O1", True), ("O2", True), ("O3", False),
                                            ("O4", False), ("O5", False)])
def test_opacus_is_refused_where_the_loss_is_scaled(fresh, level, refused):
    """Opacus clips per-sample gradients its hooks compute from the scaled loss, which no loss
    scaler unscales (GradScaler's runs turn NaN): a level that scales the loss refuses its
    DPOptimizer, naming the remedy, and changes nothing; bf16 levels and O3 scale by 1."""
    model = Mlp()
    opt = _DPOptimizer(model.parameters(), lr=0.1)
    if refused:
        with pytest.raises(ValueError, match=r"optimizers\[0\] is Opacus's _DPOptimizer.*loss "
                           r"scale of 1 \(opt_level O\d has loss_scale='dynamic'\).*'O4' or "
                           r"'O5'"):
            init(model, opt, opt_level=level)
        assert "forward" not in vars(model)
        init(model, opt, opt_level=level, loss_scale=1.0)  # the other remedy
    else:
        init(model, opt, opt_level=level)


@pytest.mark.parametrize("level", ["O4", "O5"])
def test_an_opacus_optimizers_step_runs_uncast(fresh, level):
    """Opacus clips in ``step()`` with grad mode on, where O4 would cast its einsum and the
    bf16 sum could not be assigned to an fp32 gradient ("attempting to assign a gradient with
    dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'"; until 2026-12-07 the remedy was
    the user's ``torch.no_grad()``). Its step runs with optamp's rules off, as a step outside
    native autocast's region does; an LR scheduler wraps it as any step, and ``reset`` gives
    the optimizer its own step back."""
    model = Mlp()
    opt = _DPOptimizer(model.parameters(), lr=0.1)
    init(model, opt, opt_level=level)
    assert "step" in vars(opt)
    optamp.reset()
    assert "step" not in vars(opt)
    init(model, opt, opt_level=level)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    step(model, opt, torch.randn(8, 4), torch.randint(0, 3, (8,)))
    scheduler.step()
    assert opt.einsum_dtypes == [torch.float32] * 4
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    optamp.reset()  # the scheduler's wrapper (around optamp's) stays
    assert hasattr(vars(opt)["step"], "_wrapped_by_lr_sched")


def test_validation_errors_change_nothing(fresh):
    model = Mlp()
    with pytest.raises(TypeError, match="models must be a torch.nn.Module"):
        optamp.initialize("model")
    with pytest.raises(TypeError, match=r"optimizers\[1\]"):
        optamp.initialize(model, [torch.optim.SGD(model.parameters(), lr=1), 3])
    with pytest.raises(ValueError, match="LBFGS"):
        init(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match="must be a parameter of the model"):
        init(model, torch.optim.SGD(Mlp().parameters(), lr=0.1), opt_level="O2")
    with pytest.raises(ValueError, match="opt_level"):
        init(model, opt_level="O9")
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        init(model, opt_level="O1", keep_batchnorm_fp32=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        init(model, bogus=1)
    with pytest.raises(RuntimeError, match="AFTER optamp.initialize"):
        init(torch.nn.DataParallel(model))
    assert not optamp.is_initialized() and not optamp.is_casting_enabled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt)
    with pytest.raises(ValueError, match="reset"):
        init(model, opt)


def test_o2_keeps_fp32_masters_and_batchnorm(fresh):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O5")
    seen = {}
    model.bn.register_forward_hook(lambda m, i, o: seen.update(bn_out=o.dtype))
    model.conv.register_forward_hook(lambda m, i, o: seen.update(conv_out=o.dtype))
    mean_before = model.bn.running_mean.clone()
    out = model(torch.randn(2, 1, 4, 4))
    assert seen["conv_out"] == torch.bfloat16
    # batch-norm runs with its own fp32 params and updates its fp32 running stats in place
    assert model.bn.running_mean.dtype == torch.float32
    assert not torch.equal(model.bn.running_mean, mean_before)
    assert out.dtype == torch.float32  # bf16 inside, fp32 at the model boundary
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ckpt = {k: v.dtype for k, v in model.state_dict().items()}
    assert ckpt["fc.weight"] == torch.float32
    assert [p.detach().clone().dtype for p in model.parameters()][0] == torch.float32


def test_o3_casts_the_model_and_keep_in_fp32(fresh):
    model = TinyNet()
    optamp.keep_in_fp32(model.fc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O3", cast_model_type=torch.bfloat16, keep_batchnorm_fp32=True)
    assert model.conv.weight.dtype == torch.bfloat16
    assert model.bn.weight.dtype == torch.float32 and model.bn.running_mean.dtype == torch.float32
    assert model.fc.weight.dtype == torch.float32
    assert opt.param_groups[0]["params"][0] is model.conv.weight  # same Parameter objects
    step(model, opt, torch.randn(2, 1, 4, 4), torch.tensor([0, 1]))
    assert model.conv.weight.grad is None or model.conv.weight.grad.dtype == torch.bfloat16


def test_cast_model_outputs_recursively_and_reset_unwraps(fresh):
    class Multi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.fc(x)
            return {"a": y, "b": [y, (y, torch.ones(1, dtype=torch.long))]}

    model = Multi()
    init(model, opt_level="O4", cast_model_outputs=torch.float32)
    out = model(torch.randn(1, 2))
    assert out["a"].dtype == torch.float32
    assert out["b"][0].dtype == torch.float32 and out["b"][1][0].dtype == torch.float32
    assert out["b"][1][1].dtype == torch.long
    optamp.reset()
    assert "forward" not in model.__dict__
    with pytest.raises(TypeError, match="cast_model_outputs"):
        init(model, cast_model_outputs="float16")


def test_properties_and_verbosity(fresh, capfd):
    model = Mlp()
    optamp.initialize(model, opt_level="O2", loss_scale=128.0, init_scale=4.0)
    props = optamp.properties()
    assert props.opt_level == "O2" and props.loss_scale == 128.0
    assert "O2" in capfd.readouterr().out  # Apex-style report at verbosity 1
    assert optamp.loss_scaler().loss_scale() == 128.0
    optamp.reset()
    assert optamp.properties() is None and not optamp.is_initialized()


def _overflowing_steps(opt_level, verbosity, **kw):
    """One clean step, then one overflowing step per loss (two losses: ids 0 and 1)."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    optamp.initialize(model, opt, opt_level=opt_level, verbosity=verbosity, num_losses=2, **kw)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    for poison in (1.0, math.inf):
        for loss_id in (0, 1):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) * poison
            with optamp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
            opt.step()
            assert optamp.loss_scaler(loss_id).last_step_skipped == (poison == math.inf)


def test_overflow_is_logged_apex_style_at_verbosity_1_only(fresh, capfd):
    _overflowing_steps("O1", 1)  # default init_scale 65536
    out, err = capfd.readouterr()
    assert out == "optamp: opt_level O1 (Insert automatic casts around Pytorch functions and " \
        "Tensor methods), loss scale dynamic (verbosity=2 prints the full report)\n", out
    # Printed by the C++ scaler on stderr, one line per skipped step, none for the clean ones.
    assert err.splitlines() == [
        "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0",
        "Gradient overflow. Skipping step, loss scaler 1 reducing loss scale to 32768.0",
    ], err
    optamp.reset()
    _overflowing_steps("O1", 0)
    assert capfd.readouterr() == ("", "")  # verbosity 0: neither the report nor the log


def test_errors_from_cpp_keep_their_text(fresh):
    with pytest.raises(ValueError, match="loss_scale"):
        init(Mlp(), loss_scale=-1.0)
    with pytest.raises(RuntimeError, match="initialize"):
        optamp.loss_scaler(0)


def test_floor_error_names_the_model_parameters(fresh):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O4", loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0)
    with pytest.raises(RuntimeError) as info:
        for _ in range(optamp._C.FLOOR_SKIP_LIMIT + 1):
            opt.zero_grad()
            with optamp.scale_loss(model(torch.randn(2, 4)).float().sum() * math.inf, opt) as s:
                s.backward()
    # Each parameter once: its model name (from the core's namer), then where it sits.
    shapes = {"fc1.weight": "[8, 4]", "fc1.bias": "[8]", "fc2.weight": "[3, 8]", "fc2.bias": "[3]"}
    named = ", ".join(f"{name} (optimizer 0 param_groups[0].params[{i}], shape {shape})"
                      for i, (name, shape) in enumerate(shapes.items()))
    assert str(info.value) == (
        f"amp: loss scaler 0 skipped {optamp._C.FLOOR_SKIP_LIMIT} consecutive steps at "
        "min_loss_scale (1) because of non-finite gradients; the model diverged or "
        "min_loss_scale is too high. Parameters with non-finite gradients in the last step: "
        + named)


def test_scale_loss_errors_name_the_model_parameters(fresh):
    """Not only the floor error: every scale_loss message gives the model's name, then where
    the optimizer holds the parameter."""
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O4")
    loss = model(torch.randn(2, 4)).float().sum()
    with optamp.scale_loss(loss, opt) as scaled:
        with pytest.raises(RuntimeError, match=re.escape(
                "fc1.weight (optimizer 0 param_groups[0].params[0]) is already inside")):
            with optamp.scale_loss(loss, opt):
                pass
        scaled.backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)])
@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_adam_training_steps(fresh, level, device):
    model = TinyNet().to(device)
    # O3 steps fp16 parameters directly: Adam's default eps=1e-8 is below fp16's smallest normal
    # number, so its denominator underflows and steps blow up (initialize warns). 1e-4 is the
    # smallest eps the warning accepts.
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4 if level == "O3" else 1e-8)
    init(model, opt, opt_level=level)
    x, y = torch.randn(4, 1, 4, 4, device=device), torch.tensor([0, 1, 2, 0], device=device)
    for _ in range(3):
        loss = step(model, opt, x, y)
    assert torch.isfinite(loss)
    assert optamp.loss_scaler().skipped_steps == 0
    # O1: the ops' fp16; O2/O3/O5: fp32, cast at the model boundary (Apex's patched forward)
    assert model(x).dtype == (torch.float16 if level == "O1" else torch.float32)


def test_o3_adam_eps_warning_is_a_python_warning(fresh):
    model = Mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    with pytest.warns(UserWarning, match=r"eps=1e-08.*fp16"):
        init(model, opt, opt_level="O3")


@pytest.mark.needs_cuda
@pytest.mark.parametrize("level,overrides,syncs_per_step", [
    ("O1", {}, 1), ("O2", {}, 1),
    # A fixed scale checks for inf/NaN too (docs/design.md: fixed loss scales check for overflow)
    # and skips such steps, which is a host decision: one copy. overflow_check=False is Apex's
    # unchecked fixed scale: none.
    ("O4", {}, 1), ("O5", {}, 1),
    ("O4", {"overflow_check": False}, 0), ("O5", {"overflow_check": False}, 0),
])
def test_cuda_step_syncs_at_most_once(fresh, level, overrides, syncs_per_step):
    # The scaler's update is the only device->host copy of a step.
    torch.manual_seed(0)
    model = TinyNet().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    init(model, opt, opt_level=level, **overrides)
    x, y = torch.randn(4, 1, 4, 4, device="cuda"), torch.tensor([0, 1, 2, 0], device="cuda")
    step(model, opt, x, y)  # warm-up: first-use moves and allocations
    torch.cuda.synchronize()
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                step(model, opt, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 3 * syncs_per_step, syncs


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_parameter_of_no_model_is_taken_where_models_are_not_cast(fresh, level):
    # Multi-task uncertainty weights (a learned log-variance per loss) live outside the model;
    # Apex and torch.amp take them. optamp refused them at every level before 2026-12-06; where
    # models are not cast nothing depends on which were passed.
    model = Mlp()
    log_var = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(list(model.parameters()) + [log_var], lr=0.1)
    model, opt = init(model, opt, opt_level=level, init_scale=128.0)  # fp16 output grads fit
    x = torch.randn(4, 4)

    def weighted(out):
        losses = torch.stack([out[:, 0].float().pow(2).mean(), out[:, 1].float().abs().mean()])
        return (torch.exp(-log_var) * losses + log_var).sum(), losses.detach()

    loss, losses = weighted(model(x))
    with optamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    torch.testing.assert_close(log_var.grad, 1 - losses, **tol(torch.float32))  # unscaled
    opt.step()
    before = log_var.detach().clone()
    with optamp.scale_loss(weighted(model(x))[0], opt) as scaled:
        scaled.backward()
        log_var.grad[0] = float("inf")
    opt.step()
    assert optamp.loss_scaler().last_step_skipped and torch.equal(log_var.detach(), before)


class _CastsItsWeightsToItsInput(torch.nn.Module):
    """A loss with class centers of its own that casts them to the embeddings' dtype in its
    forward, as pytorch-metric-learning's ArcFaceLoss and ProxyAnchorLoss do (``W.data = ...``)."""

    def __init__(self):
        super().__init__()
        self.centers = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, embeddings, labels):
        self.centers.data = self.centers.data.to(embeddings.dtype)
        return F.cross_entropy((embeddings @ self.centers.t()).float(), labels)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_parameter_of_no_model_cast_by_its_module_is_refused_with_the_remedy(fresh, level):
    # Taken as it was at initialize: stepped in fp16/bf16 without master weights its updates
    # would round away (native bf16 autocast lets that happen silently; GradScaler refuses fp16).
    model, loss_fn = Mlp(), _CastsItsWeightsToItsInput()
    opt = torch.optim.SGD(list(model.parameters()) + list(loss_fn.parameters()), lr=0.1)
    model, opt = init(model, opt, opt_level=level, init_scale=128.0)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    params = [p.detach().clone() for p in model.parameters()]
    scale = optamp.loss_scaler().loss_scale()
    loss = loss_fn(model(x), y)
    assert loss_fn.centers.dtype != torch.float32  # the module cast its own weights
    with pytest.raises(ValueError, match=r"params\[4\] must still be torch.float32.*"
                                         r"no model passed.*embeddings.float\(\)"):
        with optamp.scale_loss(loss, opt):
            pass
    assert optamp.loss_scaler().loss_scale() == scale
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    # The remedy: fp32 embeddings keep the centers fp32, and the step trains them.
    loss_fn.centers.data = loss_fn.centers.data.float()
    with optamp.scale_loss(loss_fn(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert loss_fn.centers.dtype == torch.float32 and loss_fn.centers.grad is not None
    assert not optamp.loss_scaler().last_step_skipped
