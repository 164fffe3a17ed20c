"""Nothing corrupts the weights at any level, and no bad state dict or context misuse is
accepted (from Python): fault injection at O1-O5, the scale floor, state-dict validation,
optimizers initialize never saw, backward after the ``with`` block, context managers that end
out of order or on another thread, errors that name the argument, meta models."""
import asyncio
import copy
import math
import threading
import warnings

import pytest
import torch

import optamp
from common_utils import Mlp, init

pytestmark = pytest.mark.usefixtures("fresh")


def _finite(tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _mm_dtype():
    a = torch.randn(2, 2, requires_grad=True)
    return (a @ a).dtype


# ---- 1. fault injection at every level -----------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O4", "O5"])
def test_thousand_injected_steps_never_corrupt_weights_or_adam_state(level):
    model = Mlp(8, 16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    # The ceiling keeps honest fp16 gradients far from overflow; interval 1 lets the scale
    # recover between the ~140 injected backoffs.
    model, opt = init(model, opt, level, growth_interval=1, init_scale=1024.0,
                      max_loss_scale=1024.0)
    gen = torch.Generator().manual_seed(3)
    params = list(model.parameters())
    injected = 0
    for step in range(1000):
        inject = torch.rand((), generator=gen).item() < 0.14
        bad = math.inf if torch.rand((), generator=gen).item() < 0.5 else math.nan
        which = int(torch.randint(len(params), (), generator=gen))
        x, target = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        before = [p.detach().clone() for p in params]
        state_before = copy.deepcopy(opt.state_dict()) if inject else None
        opt.zero_grad()
        loss = (model(x).float() - target).pow(2).mean()
        if inject:
            loss = loss + params[which].sum().float() * bad
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        if inject:
            injected += 1
            assert all(torch.equal(a, b) for a, b in zip(params, before)), (level, step)
            after = opt.state_dict()["state"]
            for k, s in state_before["state"].items():
                for name, t in s.items():
                    assert torch.equal(after[k][name], t), (level, step, name)
        else:
            assert not all(torch.equal(a, b) for a, b in zip(params, before)), (level, step)
        assert _finite(params), (level, step)
    assert injected > 100
    assert optamp.loss_scaler().skipped_steps == injected
    for s in opt.state.values():
        assert _finite([s["exp_avg"], s["exp_avg_sq"]])


def test_python_threads_sharing_one_loss_scaler_skip_exactly_their_own_overflows():
    models = [Mlp() for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    init(models, opts, "O1", init_scale=1024.0, max_loss_scale=4096.0, growth_interval=5)
    state = optamp.ThreadState.capture()
    problems = []

    def train(t):
        with optamp.thread_state_guard(state):
            for step in range(150):
                inject = t == 0 and step % 3 == 0
                opts[t].zero_grad()
                loss = models[t](torch.randn(4, 4)).float().pow(2).mean()
                if inject:
                    loss = loss * math.inf
                with optamp.scale_loss(loss, opts[t]) as scaled:
                    scaled.backward()
                skipped = models[t].fc1.weight.grad is None
                if skipped != inject:
                    problems.append((t, step, skipped))
                opts[t].step()  # the one-shot skip hook belongs to this thread's optimizer only
                if not _finite(models[t].parameters()):
                    problems.append((t, step, "non-finite"))

    threads = [threading.Thread(target=train, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert problems == []
    assert optamp.loss_scaler().skipped_steps == 50


def test_overflow_check_false_is_apexs_fixed_scale_and_needs_one():
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="overflow_check=False.*dynamic"):
        init(model, opt, "O1", overflow_check=False)
    model, opt = init(model, opt, "O5", overflow_check=False)
    assert optamp.properties().overflow_check is False
    with optamp.scale_loss(model(torch.randn(2, 4)).sum() * math.nan, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not _finite(model.parameters()), "the documented opt-out must really opt out"


def test_fixed_scale_logs_the_skip_at_verbosity_one(capfd):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O4", verbosity=1)
    capfd.readouterr()
    with optamp.scale_loss(model(torch.randn(2, 4)).sum() * math.inf, opt) as scaled:
        scaled.backward()
    err = capfd.readouterr().err
    assert "Gradient overflow. Skipping step, loss scaler 0 keeping its fixed loss scale 1.0" in err
    assert optamp.loss_scaler().skipped_steps == 1


# ---- 2. the scale floor --------------------------------------------------------------------


def test_scale_stops_at_the_floor_and_the_next_clean_step_stays_finite():
    model = Mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = init(model, opt, "O1", init_scale=1.0)
    for _ in range(160):
        opt.zero_grad()
        with optamp.scale_loss(model(torch.randn(2, 4)).sum() * math.inf, opt) as scaled:
            scaled.backward()
    assert optamp.loss_scaler().loss_scale() == 2.0**-126 == optamp.LossScaler.SCALE_FLOOR
    for _ in range(3):
        opt.zero_grad()
        with optamp.scale_loss(model(torch.randn(2, 4)).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert _finite(model.parameters())
    assert all(_finite([s["exp_avg"], s["exp_avg_sq"]]) for s in opt.state.values())


# ---- 3. state-dict validation --------------------------------------------------------------


def _initialized(**kw):
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, "O1", **kw)
    return model, opt


@pytest.mark.parametrize("key, value, message", [
    ("loss_scaler0.scale", torch.tensor(1e30), r"loss_scaler0\.scale.*16777216"),
    ("loss_scaler0.scale", torch.tensor(2.0**-127), r"2\^-126"),
    ("loss_scaler0.scale", torch.tensor([1024.0]), r"0-dim.*\[1\]"),
    ("loss_scaler0.growth_tracker", torch.tensor(-7, dtype=torch.int32), r"\[0, 1999\].*got -7"),
    ("loss_scaler0.growth_tracker", torch.tensor(10**9, dtype=torch.int32), r"got 1000000000"),
    ("loss_scaler0.hysteresis", torch.tensor(-3, dtype=torch.int32), r"\[0, 1\].*got -3"),
    ("loss_scaler0.skipped", torch.tensor(-1), r"loss_scaler0\.skipped.*got -1"),
    ("loss_scaler0.floor_skips", torch.tensor(-1), r"floor_skips.*got -1"),
    ("loss_scaler0.extra", torch.tensor(0), r"unknown entry 'loss_scaler0\.extra'"),
    ("loss_scaler0.scale", 65536.0, r"state_dict\['loss_scaler0\.scale'\] must be a torch\.Tensor"),
])
def test_load_state_dict_refuses_what_no_run_produces_and_changes_nothing(key, value, message):
    _initialized()
    good = optamp.state_dict()
    bad = dict(good)
    bad[key] = value
    exc = TypeError if not isinstance(value, torch.Tensor) else ValueError
    with pytest.raises(exc, match=message):
        optamp.load_state_dict(bad)
    assert all(torch.equal(optamp.state_dict()[k], v) for k, v in good.items())


def test_load_state_dict_refuses_non_mappings_and_non_str_keys():
    _initialized()
    with pytest.raises(TypeError, match="state_dict must be a mapping.*list"):
        optamp.load_state_dict([1, 2])
    with pytest.raises(TypeError, match="state_dict keys must be str, got int"):
        optamp.load_state_dict({0: torch.tensor(1.0)})


# ---- 4. optimizers initialize never saw ----------------------------------------------------


def test_scale_loss_refuses_an_optimizer_not_passed_to_initialize():
    model, opt = _initialized()
    other = Mlp()
    stranger = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer must be an optimizer passed to "
                                         "amp::initialize"):
        with optamp.scale_loss(other(torch.randn(2, 4)).sum(), stranger):
            pass
    with pytest.raises(ValueError, match=r"optimizers\[1\] must be an optimizer passed"):
        with optamp.scale_loss(model(torch.randn(2, 4)).sum(), [opt, stranger]):
            pass
    with optamp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()


# ---- 5. context managers out of order, on other threads; reset; is_casting_enabled -----------


def test_asyncio_tasks_interleaving_context_managers_leave_a_consistent_state():
    model, opt = _initialized()
    assert _mm_dtype() == torch.float16
    seen = {}

    async def task_a(entered, b_entered):
        with optamp.disable_casts():
            entered.set()
            await b_entered.wait()
        seen["after_a"] = _mm_dtype()  # A left first; B's bf16 region is still open

    async def task_b(entered, b_entered):
        await entered.wait()
        with optamp.autocast(dtype=torch.bfloat16):
            b_entered.set()
            await asyncio.sleep(0.01)
            seen["inside_b"] = _mm_dtype()

    async def main():
        entered, b_entered = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task_a(entered, b_entered), task_b(entered, b_entered))

    with pytest.warns(UserWarning, match="ended while guards entered after it"):
        asyncio.run(main())
    assert seen == {"after_a": torch.bfloat16, "inside_b": torch.bfloat16}
    assert _mm_dtype() == torch.float16, "the thread must not stay disabled"
    assert optamp.is_casting_enabled()


def test_disable_casts_ended_on_another_thread_frees_its_thread():
    _initialized()
    cm = optamp.disable_casts()
    cm.__enter__()
    assert _mm_dtype() == torch.float32 and not optamp.is_casting_enabled()
    errors = []

    def end_elsewhere():
        try:
            cm.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=end_elsewhere)
    t.start()
    t.join()
    assert errors and "exited on the thread that entered them" in errors[0]
    assert _mm_dtype() == torch.float16
    assert optamp.is_casting_enabled()


def test_reset_clears_a_stuck_thread_and_is_casting_enabled_tells_the_truth():
    cm = optamp.disable_casts()
    cm.__enter__()  # never exited
    optamp.reset()
    _initialized()
    assert _mm_dtype() == torch.float16 and optamp.is_casting_enabled()
    with optamp.autocast(enabled=False):
        assert not optamp.is_casting_enabled() and not torch.is_autocast_enabled()
    with optamp.disable_casts():
        assert not optamp.is_casting_enabled()
    with torch.no_grad():
        assert not optamp.is_casting_enabled()
        with optamp.autocast():
            assert optamp.is_casting_enabled()
    assert optamp.is_casting_enabled()


# ---- 6. backward after the with block -------------------------------------------------------


def test_backward_on_the_scaled_loss_after_the_with_block_raises():
    model, opt = _initialized()
    with optamp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        pass
    with pytest.raises(RuntimeError, match="already finished.*multiplied by the loss scale"):
        scaled.backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_a_step_inside_the_with_block_is_refused_and_changes_nothing(level, fused):
    """``optimizer.step()`` indented into the block would step with the scaled, unchecked
    gradients (Apex did: a 65536-times step, and an overflow's inf reached the weights). It
    raises before the step; the guard unwinds (no gradients, scale unchanged), and the
    optimizer steps as usual after the next block."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4,
                            fused=(fused and level != "O3") or None)
    init(model, opt, opt_level=level)
    x = torch.randn(4, 4)
    params = [p.detach().clone() for p in model.parameters()]
    scale = optamp.loss_scaler().loss_scale()
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) inside a scale_loss block: its "
                       r"gradients are still scaled.*after the block"):
        with optamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            opt.step()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert not opt.state and optamp.loss_scaler().loss_scale() == scale
    opt.zero_grad()
    with optamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_optimizer_stepped_from_a_gradient_hook_inside_the_block_raises_at_its_end(level):
    """torch's "optimizer in the backward" recipe steps each parameter from its
    post-accumulate-grad hook, during the block's backward: with gradients still multiplied by the
    scale, which no pre-hook of the guard's optimizer sees. The block's end names it (the update
    is done; the gradients made inside the block are dropped, the scale is unchanged)."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level=level)
    per_param = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda q: per_param[q].step())
               for p in model.parameters()]
    scale = optamp.loss_scaler().loss_scale()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"fc1.weight \(optimizer 0 param_groups\[0\]"
                       r".params\[0\], shape \[8, 4\]\) and \d+ more parameters were changed "
                       r"in place inside the scale_loss guard \(loss_id 0\)"):
        with optamp.scale_loss(model(torch.randn(4, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
    assert all(p.grad is None for p in model.parameters())
    assert optamp.loss_scaler().loss_scale() == scale
    for h in handles:
        h.remove()
    model.load_state_dict(weights)  # the update with scaled gradients was applied
    with optamp.scale_loss(model(torch.randn(4, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()  # the guard was released; the recipe without the hooks steps
    opt.step()
    assert not optamp.loss_scaler().last_step_skipped


def test_a_parameter_updated_by_hand_inside_the_block_raises_at_its_end():
    """A hand-written update (``p -= lr * p.grad`` under no_grad) indented into the block uses
    the scaled gradients too; a frozen parameter written there (an EMA kept as a parameter) is no
    step, and the block ends as usual."""
    model, opt = _initialized()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"fc2.bias .* was changed in place inside"):
        with optamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
            scaled.backward()
            with torch.no_grad():
                model.fc2.bias -= 0.1 * model.fc2.bias.grad
    model.load_state_dict(weights)  # the bias took a step 65536 times too large
    model.fc2.bias.requires_grad_(False)
    with optamp.scale_loss(model(torch.randn(2, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
        with torch.no_grad():
            model.fc2.bias.mul_(0.5)
    assert model.fc1.weight.grad is not None and not optamp.loss_scaler().last_step_skipped


def _overflowed(model, opt):
    """A guard that overflowed: the next optimizer.step() is to be skipped."""
    opt.zero_grad()
    with optamp.scale_loss(model(torch.randn(2, 4)).float().sum() * math.inf, opt) as scaled:
        scaled.backward()
    assert optamp.loss_scaler().last_step_skipped


def test_a_skipped_step_is_not_called_and_the_next_one_is():
    """After an overflow ``optimizer.step()`` returns without calling the optimizer's own step
    (GradScaler's and Apex's skip), then puts the method back: the next step runs. A step taken
    through a bound method fetched before the overflow (as ``torch.compile(opt.step)`` holds
    one) is reached, and finds no gradients."""
    model, opt = _initialized()
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    bound = opt.step
    _overflowed(model, opt)
    assert "step" in vars(opt)
    assert opt.step() is None and calls == [] and "step" not in vars(opt)
    _overflowed(model, opt)
    params = [p.detach().clone() for p in model.parameters()]
    bound()
    assert calls == ["pre"] and all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    opt.step()  # the skip was used by the bound call's hook: nothing pending, nothing to step
    assert calls == ["pre", "pre"] and "step" not in vars(opt)


def test_a_skipped_step_puts_back_an_lr_schedulers_wrapper():
    """An LR scheduler wraps ``optimizer.step`` on the instance; the skip stands in for it once,
    marks the call as the wrapper would (no "lr_scheduler.step() before optimizer.step()"
    warning), and leaves the wrapper in place for the next step."""
    model, opt = _initialized()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = vars(opt)["step"]
    _overflowed(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        scheduler.step()
    assert vars(opt)["step"] is wrapper and opt.param_groups[0]["lr"] == 0.05


def test_a_step_inside_a_later_block_is_refused_while_a_skip_waits():
    """An overflow waits to skip the next step; a step inside the next guard's block is still
    refused (its grads are scaled), and the skip still applies after that block."""
    model, opt = _initialized()
    _overflowed(model, opt)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"inside a scale_loss block"):
        with optamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
            scaled.backward()
            opt.step()
    with optamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    opt.zero_grad()
    with optamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_reset_drops_a_skip_waiting_for_the_next_step(fused):
    """An overflow leaves a skip (or, fused, the overflow flag) for the next step; ``reset()``
    takes it with the loss scalers, so after a new ``initialize`` the next step runs."""
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    init(model, opt, "O1")
    _overflowed(model, opt)
    optamp.reset()
    assert "step" not in vars(opt) and getattr(opt, "found_inf", None) is None
    init(model, opt, "O1")
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with optamp.scale_loss(model(torch.randn(2, 4)).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not optamp.loss_scaler().last_step_skipped
    assert not any(torch.equal(a, p) for a, p in zip(params, model.parameters()))


def test_an_overflow_inside_a_steps_closure_skips_that_step_and_no_other():
    """Lightning's automatic optimization (and SAM-style optimizers) run forward and backward in
    the closure of ``optimizer.step(closure)``: a guard that overflows there is inside the step
    it must skip, so the grads it drops skip it, and nothing is left to skip the next call (which
    would drop the next step's closure unrun)."""
    model, opt = _initialized()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    calls = []

    def closure(factor):
        def run():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y) * factor
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            calls.append(factor)
            return loss
        return run

    params = [p.detach().clone() for p in model.parameters()]
    opt.step(closure(math.inf))
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert optamp.loss_scaler().last_step_skipped and "step" not in vars(opt)
    opt.step(closure(1.0))
    assert calls == [math.inf, 1.0]
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))


def test_a_step_after_only_delay_unscale_blocks_is_refused_until_a_final_block():
    """Every micro-batch with ``delay_unscale=True``, the last included (a slip: Apex's pattern
    ends with a block without it): the grads are still scaled, so the step raises, as
    ``amp::step`` does in C++, and changes nothing; a block without ``delay_unscale`` then
    unscales the whole sum and the step goes on. After ``zero_grad`` nothing is refused."""
    model, opt = _initialized()
    reference = copy.deepcopy(model)  # the weights before any step, for the fp32 sum below
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    params = [p.detach().clone() for p in model.parameters()]
    for x in xs[:2]:
        with optamp.scale_loss(model(x).float().mean(), opt, delay_unscale=True) as scaled:
            scaled.backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) after scale_loss\(..., "
                       r"delay_unscale=True\): its gradients are still scaled.*without "
                       r"delay_unscale before stepping"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    with optamp.scale_loss(model(xs[2]).float().mean(), opt) as scaled:
        scaled.backward()
    assert not optamp.loss_scaler().last_step_skipped
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    with optamp.disable_casts():
        for x in xs:
            reference(x).float().mean().backward()
    for g, r in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=1e-3, atol=1e-3)
    with optamp.scale_loss(model(xs[0]).float().mean(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    opt.zero_grad()
    opt.step()  # no gradients: nothing scaled to refuse


def test_a_step_of_another_optimizer_inside_the_block_is_allowed():
    """Only the optimizers the block scales are refused: a second model's optimizer steps."""
    model, opt = _initialized()
    other = torch.nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 2)).sum().backward()
    before = other.weight.detach().clone()
    with optamp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()
        other_opt.step()
    assert not torch.equal(before, other.weight)
    opt.step()


# ---- 7. errors that name the argument -------------------------------------------------------


@pytest.mark.parametrize("kw, exc, message", [
    ({"growth_interval": 2**40}, ValueError, r"growth_interval must be an int within .*1099511627776"),
    ({"num_losses": 2**31}, ValueError, r"num_losses must be an int within .*2147483648"),
    ({"hysteresis": 1.5}, TypeError, "hysteresis must be an int, got float"),
    ({"overflow_check": "yes"}, ValueError, "overflow_check must be True, False"),
])
def test_initialize_errors_name_the_argument(kw, exc, message):
    model = Mlp()
    with pytest.raises(exc, match=message):
        init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", **kw)
    assert not optamp.is_initialized()


@pytest.mark.parametrize("call, exc, message", [
    (lambda m, o: optamp.scale_loss(1.5, o), TypeError, "loss must be a torch.Tensor.*float"),
    (lambda m, o: optamp.scale_loss(m(torch.randn(2, 4)).sum(), o, loss_id="0"), TypeError,
     "loss_id must be an int, got str"),
    (lambda m, o: optamp.scale_loss(m(torch.randn(2, 4)).sum(), o, loss_id=2**40), ValueError,
     "loss_id must be an int within"),
    (lambda m, o: optamp.scale_loss(m(torch.randn(2, 4)).sum(), 3), TypeError,
     "optimizers must be a torch.optim.Optimizer or a list of them, got int"),
    (lambda m, o: optamp.loss_scaler("0"), TypeError, "loss_id must be an int, got str"),
])
def test_scale_loss_errors_name_the_argument(call, exc, message):
    model, opt = _initialized()
    with pytest.raises(exc, match=message):
        with call(model, opt):
            pass


# ---- 9. meta models -----------------------------------------------------------------------


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_meta_model_is_refused_with_what_to_do(level):
    with torch.device("meta"):
        model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="materialized.*fc1.weight.*meta device.*to_empty"):
        init(model, opt, level)
    assert not optamp.is_initialized()
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p)
    init(model, torch.optim.SGD(model.parameters(), lr=0.1), level)  # materialized: fine


def test_warnings_module_sees_out_of_order_exit_once_per_call_site():
    _initialized()
    a, b = optamp.disable_casts(), optamp.autocast(dtype=torch.bfloat16)
    a.__enter__()
    b.__enter__()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.__exit__(None, None, None)
        b.__exit__(None, None, None)
    assert len(caught) == 1 and "amp::disable_casts" in str(caught[0].message)
    assert _mm_dtype() == torch.float16
