"""Apex's documented patterns through optamp.initialize + scale_loss, checkpoints, and interop
with torch.autocast + torch.amp.GradScaler."""
import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F

import optamp
from common_utils import Mlp, init, tol, train_row

X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))


def test_multiple_losses_and_optimizers(fresh):
    model = Mlp()
    opt0 = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    model, (opt0, opt1) = init(model, [opt0, opt1], opt_level="O1", num_losses=2,
                               init_scale=256.0)
    for step in range(3):
        opt0.zero_grad()
        opt1.zero_grad()
        out = model(X)
        loss0 = F.cross_entropy(out, Y)
        loss1 = out.float().pow(2).mean() * (math.inf if step == 1 else 1.0)
        with optamp.scale_loss(loss0, opt0, loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with optamp.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
            scaled.backward()
        opt0.step()
        opt1.step()
        assert optamp.loss_scaler(1).last_step_skipped == (step == 1)
        assert not optamp.loss_scaler(0).last_step_skipped, step
    assert optamp.loss_scaler(0).loss_scale() == 256.0
    assert optamp.loss_scaler(1).loss_scale() == 128.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _accumulated_grads(mode, micro=4):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode != "reference":
        init(model, opt, opt_level="O0", loss_scale=128.0)
    for k in range(micro):
        loss = F.cross_entropy(model(X[2 * k: 2 * k + 2]), Y[2 * k: 2 * k + 2]) / micro
        if mode == "reference":
            loss.backward()
        else:
            delay = mode == "delay_unscale" and k < micro - 1
            with optamp.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optamp.reset()
    return grads


@pytest.mark.parametrize("mode", ["delay_unscale", "unscale_every_micro_batch"])
def test_gradient_accumulation_is_exact_both_ways(fresh, mode):
    reference = _accumulated_grads("reference")
    # Power-of-two scale, no casting (O0): every accumulated grad must match bit for bit.
    for a, b in zip(_accumulated_grads(mode), reference):
        assert torch.equal(a, b)


def test_gradient_accumulation_o1_close_to_fp32(fresh):
    reference = _accumulated_grads("reference")
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O1")
    for k in range(2):
        loss = F.cross_entropy(model(X[4 * k: 4 * k + 4]), Y[4 * k: 4 * k + 4]) / 2
        with optamp.scale_loss(loss, opt, delay_unscale=k == 0) as scaled:
            scaled.backward()
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, g, **tol("train_float16"))


def test_clipping_after_the_guard_at_o2(fresh):
    torch.manual_seed(0)
    reference = Mlp()
    model = Mlp()
    model.load_state_dict(reference.state_dict())
    F.cross_entropy(reference(X), Y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, opt_level="O2")
    with optamp.scale_loss(F.cross_entropy(model(X), Y), opt) as scaled:
        scaled.backward()
    assert optamp.loss_scaler().loss_scale() == 2.0**16  # grads above were scaled by 65536
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    torch.testing.assert_close(norm, ref_norm, **tol("train_float16"))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped <= 0.01 * 1.001
    assert list(optamp.master_params(opt)) == list(model.parameters())
    opt.step()


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_a_scheduler_after_a_skipped_first_step_steps_along_without_a_warning(
        fresh, level, fused):
    """An LR scheduler stepped after every optimizer step, the first of which overflows: the
    schedule advances as under torch.amp.GradScaler (and Apex), and torch's "lr_scheduler.step()
    before optimizer.step()" warning, which GradScaler's skipped first step triggers, does not
    come: optamp calls the optimizer's step (with no gradients, or with the device-side skip)."""
    import warnings
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused or None)
    init(model, opt, opt_level=level)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(model(X), Y) * (math.inf if step == 0 else 1.0)
            with optamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if step == 0:
                assert optamp.loss_scaler().last_step_skipped
                assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
                # No momentum yet: none at all, or zeros (fused: optamp's zeros stand in for
                # torch's uninitialized first-step buffers, scaler.py)
                assert all(st.get("momentum_buffer") is None or not st["momentum_buffer"].any()
                           for st in opt.state.values())
            scheduler.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [
        str(w.message) for w in caught]
    assert scheduler.get_last_lr() == [0.1 * 0.5**3]
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert not all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O4", "O5"])
def test_step_hooks_see_a_skipped_step_as_gradscaler_shows_it(fresh, level, fused):
    """As under GradScaler: a step skipped on the host is not called, so its step hooks do not
    run (an EMA update or a step counter in a post hook counts only real steps); a fused
    optimizer skips on the device, its step is called with the overflow flag handed to the
    kernel (``optimizer.found_inf``) and its hooks run, where a post hook that must not count
    the step tells it by ``last_step_skipped``."""
    torch.manual_seed(0)
    model = Mlp()
    eps = dict(eps=1e-4) if level == "O3" else {}
    # torch 2.11's fused CPU kernel leaves fp16 parameters unchanged: O3 steps with the loop.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=(fused and level != "O3") or None,
                            **eps)
    init(model, opt, opt_level=level)
    pre_saw_flag, post_saw_skipped = [], []

    def pre_hook(optimizer, args, kwargs):
        assert all(p.grad is not None for p in model.parameters())
        pre_saw_flag.append(getattr(optimizer, "found_inf", None) is not None)

    def post_hook(optimizer, args, kwargs):
        post_saw_skipped.append(optamp.loss_scaler().last_step_skipped)

    opt.register_step_pre_hook(pre_hook)
    opt.register_step_post_hook(post_hook)
    for step in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(model(X).float(), Y) * (math.inf if step == 1 else 1.0)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    device_skip = fused and level != "O3"
    assert post_saw_skipped == ([False, True, False, False] if device_skip else [False] * 3)
    assert pre_saw_flag == [device_skip] * len(post_saw_skipped)


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_per_sample_losses_backward_with_a_gradient(fresh, level):
    """A loss of any shape, as Apex's ``loss.float() * scale`` and ``GradScaler.scale`` take it:
    per-sample losses weighted through ``scaled.backward(gradient)`` train like an fp32 run of
    their weighted sum, and an inf among them skips the step."""
    torch.manual_seed(0)
    model = Mlp()
    reference = copy.deepcopy(model)
    # SGD: O3's fp16 Adam state is not comparable with fp32's (v underflows; opt_levels.md)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    init(model, opt, opt_level=level)
    weights = torch.linspace(0.5, 1.5, X.shape[0]) / X.shape[0]
    for step in range(3):
        opt.zero_grad()
        per_sample = F.cross_entropy(model(X).float(), Y, reduction="none")
        with optamp.scale_loss(per_sample, opt) as scaled:
            assert scaled.shape == per_sample.shape
            scaled.backward(weights)
        opt.step()
        ref_opt.zero_grad()
        (F.cross_entropy(reference(X), Y, reduction="none") * weights).sum().backward()
        ref_opt.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().float(), r.detach(), **tol(train_row(level)))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    per_sample = F.cross_entropy(model(X).float(), Y, reduction="none")
    with optamp.scale_loss(per_sample * torch.tensor([1.0] * 7 + [math.inf]), opt) as scaled:
        scaled.backward(weights)
    opt.step()
    assert optamp.loss_scaler().last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _train(model, opt, steps, start):
    for s in range(start, start + steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y) * (math.inf if s == 2 else 1.0)
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_checkpoint_resume_is_bit_exact(fresh, level):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    init(model, opt, opt_level=level, growth_interval=2)
    _train(model, opt, 3, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "amp": optamp.state_dict()}, buf)
    _train(model, opt, 4, 3)
    final = [p.detach().clone() for p in model.parameters()]
    final_scale = optamp.loss_scaler().loss_scale()
    optamp.reset()

    # Resume: Apex's order (build, initialize, then load the three state dicts).
    model2 = Mlp()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    init(model2, opt2, opt_level=level, growth_interval=2)
    buf.seek(0)
    ckpt = torch.load(buf)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    optamp.load_state_dict(ckpt["amp"])
    _train(model2, opt2, 4, 3)
    assert optamp.loss_scaler().loss_scale() == final_scale
    for a, b in zip(final, model2.parameters()):
        assert torch.equal(a, b)


def _checkpoint_at(level, **options):
    """A checkpoint of model, optimizer and amp after 3 steps at ``level``; amp is then reset."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    init(model, opt, opt_level=level, **options)
    _train(model, opt, 3, 0)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "amp": optamp.state_dict()}
    optamp.reset()
    return ckpt


def _resume_at(level, ckpt, load_amp=True, **options):
    model = Mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    init(model, opt, opt_level=level, **options)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    if load_amp:
        optamp.load_state_dict(ckpt["amp"])
    return model, opt


@pytest.mark.parametrize("saved,resumed", [("O5", "O2"), ("O4", "O1"), ("O0", "O1"),
                                           ("O3", "O2")])
def test_a_checkpoint_without_loss_scaling_is_not_resumed_at_its_scale_by_a_dynamic_one(
        fresh, saved, resumed):
    """Changing levels from one without loss scaling (a fixed scale of 1) to fp16's dynamic
    scaling: going on from scale 1 would underflow fp16 gradients for thousands of steps, so the
    amp state is refused, with a message naming both ways on, and nothing changes; leaving it out
    starts from init_scale, and init_scale=1 asks for the checkpoint's scale."""
    ckpt = _checkpoint_at(saved)
    assert not ckpt["amp"]["loss_scaler0.dynamic"]
    _resume_at(resumed, ckpt, load_amp=False)
    before = optamp.state_dict()
    with pytest.raises(ValueError, match=r"loss_scaler0.dynamic' is False.*fixed scale of 1.0 .*"
                       r"init_scale 65536.0;.*leave the loss scalers' state out.*init_scale=1.0 "):
        optamp.load_state_dict(ckpt["amp"])
    assert all(torch.equal(before[k], v) for k, v in optamp.state_dict().items())
    optamp.reset()
    model, opt = _resume_at(resumed, ckpt, load_amp=False)
    _train(model, opt, 2, 3)
    assert optamp.loss_scaler().loss_scale() == 2.0**16  # no overflow at 65536 in 2 steps
    optamp.reset()
    model, opt = _resume_at(resumed, ckpt, init_scale=1.0)
    assert optamp.loss_scaler().loss_scale() == 1.0


@pytest.mark.parametrize("saved,resumed", [("O1", "O2"), ("O2", "O1")])
def test_a_dynamic_scale_resumes_across_fp16_levels(fresh, saved, resumed):
    ckpt = _checkpoint_at(saved, init_scale=2.0**10)
    model, opt = _resume_at(resumed, ckpt)
    assert optamp.loss_scaler().loss_scale() == ckpt["amp"]["loss_scaler0.scale"].item()
    _train(model, opt, 2, 3)


@pytest.mark.parametrize("resumed", ["O4", "O5", "O3"])
def test_a_dynamic_scale_is_not_resumed_by_a_fixed_one(fresh, resumed):
    """fp16's dynamic scale into a level with a fixed scale of 1 (to bf16, or to O3): refused
    with the ways on; leaving the amp state out keeps the fixed scale."""
    ckpt = _checkpoint_at("O2")
    _resume_at(resumed, ckpt, load_amp=False)
    with pytest.raises(ValueError, match=r"must equal the configured fixed loss scale 1.0 .*"
                       r"leave the loss scalers' state out to keep the fixed scale"):
        optamp.load_state_dict(ckpt["amp"])
    assert optamp.loss_scaler().loss_scale() == 1.0


def test_a_checkpoint_written_before_the_dynamic_entry_still_loads(fresh):
    """Checkpoints from before 2026-12-06 have no ``.dynamic`` entry: they load as they did."""
    ckpt = _checkpoint_at("O5")
    del ckpt["amp"]["loss_scaler0.dynamic"]
    _resume_at("O1", ckpt)
    assert optamp.loss_scaler().loss_scale() == 1.0


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_distributed_checkpoint_resume_is_bit_exact(fresh, level, tmp_path):
    """torch.distributed.checkpoint (FSDP2's way to checkpoint), in one process: model and
    optimizer through ``get_state_dict``/``set_state_dict``, amp's state as the dict of tensors it
    is; the resumed run equals the uninterrupted one bit for bit, an overflow included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        torch.manual_seed(0)
        model = Mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        init(model, opt, opt_level=level, growth_interval=2)
        return model, opt

    model, opt = build()
    _train(model, opt, 3, 0)  # step 2 overflows
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state, "amp": optamp.state_dict()},
             checkpoint_id=tmp_path, no_dist=True)
    _train(model, opt, 3, 3)
    final = [p.detach().clone() for p in model.parameters()]
    final_scale = optamp.loss_scaler().loss_scale()
    optamp.reset()

    model, opt = build()
    _train(model, opt, 1, 0)  # DCP loads in place: the optimizer's state must exist
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": opt_state, "amp": optamp.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    optamp.load_state_dict(state["amp"])
    _train(model, opt, 3, 3)
    assert optamp.loss_scaler().loss_scale() == final_scale
    assert all(torch.equal(a, b) for a, b in zip(final, model.parameters()))


def test_o1_matches_torch_autocast_and_grad_scaler(fresh):
    steps, bad = 6, 3
    torch.manual_seed(0)
    ours = Mlp()
    theirs = Mlp()
    theirs.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    init(ours, opt_ours, opt_level="O1", growth_interval=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    ours_scales, theirs_scales = [], []
    for s in range(steps):
        poison = math.inf if s == bad else 1.0
        opt_ours.zero_grad()
        loss_ours = F.cross_entropy(ours(X), Y)
        with optamp.scale_loss(loss_ours * poison, opt_ours) as scaled:
            scaled.backward()
        opt_ours.step()
        ours_scales.append(optamp.loss_scaler().loss_scale())

        opt_theirs.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):  # optamp defers inside (documented rule)
            loss_theirs = F.cross_entropy(theirs(X), Y)
        scaler.scale(loss_theirs * poison).backward()
        scaler.step(opt_theirs)
        scaler.update()
        theirs_scales.append(scaler.get_scale())
    assert ours_scales == theirs_scales
    torch.testing.assert_close(loss_ours.float(), loss_theirs.float(), **tol("train_float16"))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as users copy it (davda54/sam): `first_step` climbs to the
    worst point within `rho` along the gradient, saving each parameter in `old_p`; `second_step`
    puts them back (only those with a gradient) and steps the base optimizer."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for g in self.param_groups
                                       for p in g["params"] if p.grad is not None]), p=2)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def _sam_step(model, optimizer, x, y, overflow_in=None):
    """docs/python.md's recipe for two-step optimizers: each pass in its own guard, and a pass
    that overflowed ends the step with the weights where it began."""
    with optamp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
        if overflow_in == "first":
            model.fc1.weight.grad[0, 0] = math.inf
    if optamp.loss_scaler().last_step_skipped:  # no gradients to climb along
        return
    optimizer.first_step(zero_grad=True)
    with optamp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
        if overflow_in == "second":
            model.fc2.bias.grad[0] = math.nan
    if optamp.loss_scaler().last_step_skipped:  # back to the weights first_step moved
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if "old_p" in optimizer.state[p]:
                        p.copy_(optimizer.state[p]["old_p"])
        return
    optimizer.second_step(zero_grad=True)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_a_two_step_optimizer_trains_and_skips_either_pass_bitwise(fresh, level):
    # SAM's two passes: an overflow in the first leaves no gradients (first_step would have
    # failed on none), one in the second leaves the weights at the perturbed point unless put
    # back (its second_step restores only parameters with a gradient). The recipe skips both.
    def run(overflow_at, amp_level):
        torch.manual_seed(0)
        model = Mlp()
        optimizer = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        if amp_level is not None:
            model, optimizer = init(model, optimizer, amp_level)
        states = []
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(10 + step))
            if amp_level is None:
                F.cross_entropy(model(x), y).backward()
                optimizer.first_step(zero_grad=True)
                F.cross_entropy(model(x), y).backward()
                optimizer.second_step(zero_grad=True)
            else:
                _sam_step(model, optimizer, x, y, overflow_at.get(step))
            states.append([p.detach().clone() for p in model.parameters()] +
                          [optimizer.base_optimizer.state[p]["momentum_buffer"].clone()
                           for p in model.parameters()
                           if "momentum_buffer" in optimizer.base_optimizer.state[p]])
        optamp.reset()
        return states

    reference = run({}, None)
    clean = run({}, level)
    for got, want in zip(clean[-1], reference[-1]):
        torch.testing.assert_close(got, want, **tol(train_row(level)))
    for where in ("first", "second"):
        skipped = run({1: where}, level)
        assert all(torch.equal(a, b) for a, b in zip(skipped[1], skipped[0])), where
        assert all(torch.isfinite(t).all() for t in skipped[2]), where


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_swavs_sinkhorn_under_no_grad_trains_as_under_apex(fresh, level):
    """SwAV (trained with Apex's O1) computes its codes by Sinkhorn-Knopp under torch.no_grad from
    the detached prototype scores, fp16 at O1: exp(scores / 0.05) overflows fp16. The fp32 lists
    widen reduced input under the no_grad gate too, as Apex and native autocast cast there, so
    the codes are fp32 and training follows fp32's (until 2026-12-07 every O1 step was NaN and
    skipped, the scale falling each step)."""
    from programs import SwAV, swav_loss

    def train(opt_level):
        torch.manual_seed(0)
        model = SwAV()
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        if opt_level:
            init(model, opt, opt_level)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(32, 16, generator=gen)
            views = torch.stack([x + 0.1 * torch.randn(x.shape, generator=gen) for _ in range(2)])
            opt.zero_grad()
            loss = swav_loss(model, views)
            if opt_level:
                with optamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                assert not optamp.loss_scaler().last_step_skipped
            else:
                loss.backward()
            opt.step()
            losses.append(loss.detach().float())
        return torch.stack(losses)

    reference = train(None)
    optamp.reset()
    losses = train(level)
    torch.testing.assert_close(losses, reference, **tol(train_row(level)))
