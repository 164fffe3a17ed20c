"""Parameters' casts record no autograd node of their own (docs/casting.md, "Casts in the
autograd graph"): a cast copy takes its source's gradient edge, and the engine converts the
fp16/bf16 gradient on its way back. Checked here: no ToCopyBackward for the parameters in a
training step's graph at O1 and O2, the gradients equal those of explicit `.to()` casts, several
uses of one cast sum in fp32, activations' casts keep their node (their converted gradient would
otherwise be made beside the consumer's buffers), and the cases that keep the node (forward-mode
AD) or need the converted gradient to stay differentiable (double backward) give what native
autocast gives."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import optamp

from common_utils import Mlp, graph_node_names, init, tol
from op_cases import CPU_AND_CUDA


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_training_step_records_no_cast_nodes(fresh, level):
    model = Mlp()
    init(model, opt_level=level)
    out = model(torch.randn(5, 4))
    names = graph_node_names(out)  # the model's graph (the loss's log_softmax(dtype=) casts itself)
    # At O2/O5 the model boundary casts the output to fp32 with a plain `.to()`, as Apex does.
    assert names.count("ToCopyBackward0") == (level in ("O2", "O5")), names
    assert names.count("AccumulateGrad") == 4, names
    F.cross_entropy(out, torch.tensor([0, 1, 2, 0, 1])).backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_an_activation_cast_keeps_its_node(fresh, level):
    """An fp32 activation (here a view of one) going into a linear is cast by the kernel with a
    ToCopyBackward of its own, as `.to()` would; the parameters' casts record none. Without it
    the engine converts the activation's gradient inside the consumer's backward, beside that
    node's buffers (the C++ GPT-2 benchmark's logits, cast for the loss: +393 MB of peak)."""
    model = Mlp()
    init(model, opt_level=level)
    x = torch.randn(5, 4, requires_grad=True)
    out = model.fc1((x * 2).view(5, 4))  # fp32 activation -> fp16/bf16 linear
    assert out.dtype != torch.float32
    names = graph_node_names(out)
    assert names.count("ToCopyBackward0") == 1, names
    assert names.index("ToCopyBackward0") < names.index("MulBackward0"), names
    out.float().sum().backward()
    low = out.dtype
    expected = (torch.ones(5, model.fc1.out_features, dtype=low) @ model.fc1.weight.to(low)) * 2
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, expected.float()), (x.grad, expected)


@pytest.mark.parametrize("level,low", [("O1", torch.float16), ("O2", torch.float16),
                                       ("O4", torch.bfloat16), ("O5", torch.bfloat16)])
def test_gradients_equal_explicit_casts_bit_for_bit(fresh, level, low):
    """The same grads as a forward written with `.to(low)` (ToCopyBackward nodes), bit for bit."""
    reference = Mlp()
    model = Mlp()
    model.load_state_dict(reference.state_dict())
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])

    def by_hand(m):
        h = F.linear(x.to(low), m.fc1.weight.to(low), m.fc1.bias.to(low)).relu()
        return F.linear(h, m.fc2.weight.to(low), m.fc2.bias.to(low))

    F.cross_entropy(by_hand(reference).float(), y).backward()
    init(model, opt_level=level)
    F.cross_entropy(model(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), name


def test_a_cast_used_twice_sums_its_gradients_in_fp32(fresh, cpu_buckets):
    """A tied weight: each use's fp16 gradient is converted, then they are summed in fp32 (where
    ToCopyBackward summed in fp16): the grad equals the sum of two untied copies' grads. At every
    step: from the second, the first use's gradient is converted in its bucket, the second's on
    its own (a copy's uses would otherwise meet in fp16 before the bucket)."""

    class Tied(torch.nn.Module):
        def __init__(self, untied=False):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 6))
            self.w2 = torch.nn.Parameter(self.w.detach().clone()) if untied else self.w

        def forward(self, x):
            return F.linear(F.linear(x, self.w).tanh(), self.w2)

    tied = Tied()
    untied = Tied(untied=True)
    untied.w.data.copy_(tied.w.data)
    untied.w2.data.copy_(tied.w.data)
    x = torch.randn(3, 6)
    both = torch.nn.ModuleList([tied, untied])
    opt = torch.optim.SGD(both.parameters(), lr=0.0)
    both, opt = init(both, opt, opt_level="O1", loss_scale=1.0)  # no overflow, no skipped step
    for step in range(3):
        opt.zero_grad()
        loss = tied(x).float().pow(2).sum() + untied(x).float().pow(2).sum()
        with optamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert torch.equal(tied.w.grad, untied.w.grad + untied.w2.grad), step
        opt.step()


def test_forward_mode_ad_keeps_its_tangent_through_a_cast(fresh):
    model = Mlp()
    init(model, opt_level="O1")
    x, tangent = torch.randn(2, 4), torch.randn(2, 4)
    with fwAD.dual_level():
        out = model.fc1(fwAD.make_dual(x, tangent))
        got = fwAD.unpack_dual(out).tangent
    assert got is not None and got.dtype == torch.float16
    expected = tangent.half() @ model.fc1.weight.detach().half().t()
    assert torch.equal(got, expected)


def test_double_backward_through_casts_matches_native_autocast(fresh):
    """A gradient penalty (create_graph=True): the engine's conversion is recorded and
    differentiated like ToCopyBackward, so the result is native fp16 autocast's, bit for bit."""
    model = Mlp()
    native = Mlp()
    native.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)

    def penalty(m):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xi).float().pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()

    with torch.autocast("cpu", dtype=torch.float16):
        penalty(native)
    init(model, opt_level="O1")
    penalty(model)
    for p, q in zip(model.parameters(), native.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_kept_cast_delivers_its_gradient_before_the_backward_ends(fresh):
    """Gradient accumulation keeps the cached casts across micro-batches. A kept cast's gradient
    goes to its parameter as soon as it is computed; with a ToCopyBackward node from the earlier
    micro-batch (the lowest sequence number in the graph) it waited until the whole backward had
    run, holding every working copy's fp16 gradient meanwhile."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    init(model, opt_level="O2")
    events = []
    model[2].weight.register_post_accumulate_grad_hook(lambda p: events.append("last layer"))
    for _ in range(2):  # two micro-batches: the second reuses the first one's casts
        events.clear()
        x = torch.randn(5, 4, requires_grad=True)
        x.register_hook(lambda g: events.append("input"))
        model(x).float().sum().backward()
    assert events == ["last layer", "input"], events


class _GeluMlp(torch.nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.fc1, self.fc2, self.approximate = torch.nn.Linear(4, 16), torch.nn.Linear(16, 3), approximate

    def forward(self, x, cast=None):
        if cast is None:  # under optamp: the levels cast
            return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
        h = F.linear(x.to(cast), self.fc1.weight.to(cast), self.fc1.bias.to(cast))
        h = F.gelu(h.float(), approximate=self.approximate).to(cast)  # Apex's fp32 GELU
        return F.linear(h, self.fc2.weight.to(cast), self.fc2.bias.to(cast))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("level,low", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_apex_fp32_gelu_is_one_op_with_the_cast_paths_gradients(fresh, level, low, approximate):
    """Apex's list runs GELU in fp32: one op (WidenedGeluBackward in the graph, no casts around
    it), with the values and gradients of widening, fp32 GELU and narrowing, bit for bit."""
    reference, model = _GeluMlp(approximate), _GeluMlp(approximate)
    model.load_state_dict(reference.state_dict())
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    F.cross_entropy(reference(x, cast=low).float(), y).backward()
    init(model, opt_level=level)
    out = model(x)
    names = graph_node_names(out)
    assert "WidenedGeluBackward" in names and "GeluBackward0" not in names, names
    assert "ToCopyBackward0" not in names, names
    F.cross_entropy(out, y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _softmax_input_dtypes(fn):
    """The dtype of the first argument of every softmax and log_softmax call: torch's
    (aten::softmax, aten::_softmax, ...) and optamp's (optamp::widened_log_softmax,
    optamp::widened_softmax), and of every aten::_to_copy."""
    names = ("aten::log_softmax", "aten::_log_softmax", "optamp::widened_log_softmax",
             "aten::softmax", "aten::_softmax", "optamp::widened_softmax", "aten::_to_copy",
             "optamp::fused_cross_entropy")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        fn()
    return [(e.name(), e.dtypes()[0]) for e in prof.profiler.kineto_results.events()
            if e.name() in names]


def _expect_the_cast_paths(result, expected, logits, reference, device):
    """An fp32 result and the reduced logits' gradient, as the cast path (`expected`, computed
    from `reference`) has them: bit for bit on the CPU (the same ops), within each dtype's
    tolerance on CUDA (other kernels)."""
    assert result.dtype == torch.float32 and logits.grad.dtype == logits.dtype
    if device == "cpu":
        assert torch.equal(result, expected) and torch.equal(logits.grad, reference.grad)
    else:
        torch.testing.assert_close(result, expected, **tol(torch.float32))
        torch.testing.assert_close(logits.grad, reference.grad, **tol(logits.dtype))


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("level,low", [("O1", torch.float16), ("O2", torch.float16),
                                       ("O4", torch.bfloat16), ("O5", torch.bfloat16)])
def test_cross_entropy_reads_reduced_logits_without_a_widened_copy(fresh, level, low, device):
    """Apex runs cross_entropy in fp32. Of fp16/bf16 logits on the CPU optamp's log_softmax reads
    the reduced logits and writes fp32, its backward writes the reduced gradient (the cast path's
    ops, bit for bit); on CUDA optamp.fused_cross_entropy computes the loss from each row's
    log-sum-exp and writes the reduced gradient, with no fp32 copy and no log-probabilities at
    all. The values and gradients are the cast path's (within each dtype's rounding on CUDA)."""
    init(Mlp().to(device), opt_level=level)
    # 2000 classes: on CUDA optamp's op takes rows of 128 or more, a block per row over 1024
    logits = torch.randn(6, 2000, device=device).to(low).requires_grad_()
    reference = logits.detach().clone().requires_grad_()
    y = torch.randint(2000, (6,), device=device)
    with optamp.disable_casts():
        expected = F.cross_entropy(reference.float(), y)
        expected.backward()
    loss = None

    def run():
        nonlocal loss
        loss = F.cross_entropy(logits, y)
        loss.backward()

    calls = _softmax_input_dtypes(run)
    low_name = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}[low]
    first = "optamp::fused_cross_entropy" if device == "cuda" else "optamp::widened_log_softmax"
    assert calls[0] == (first, low_name), calls
    if device == "cuda":  # read, not widened; no log-probabilities; the gradient is not narrowed
        assert calls == [(first, low_name)], calls
        assert "FusedCrossEntropyBackward" in graph_node_names(loss)
    _expect_the_cast_paths(loss, expected, logits, reference, device)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("level,low", [("O2", torch.float16), ("O5", torch.bfloat16)])
def test_a_models_widened_logits_are_read_reduced(fresh, level, low, device):
    """At O2/O5 the model boundary widens the model's output to fp32, as Apex's does. The loss of
    those logits, here of a view of all of them as a language model's loss takes them, reads the
    reduced output they were widened from, with no fp32 copy of its own: the op O1 takes, and no
    widening's backward in the graph. The loss and the parameters' gradients are those of torch's
    loss of the fp32 logits (a copy of them, which the boundary did not make, takes that path, as
    do logits whose own gradient is kept)."""
    model = torch.nn.Linear(16, 2000).to(device)
    init(model, opt_level=level)
    x = torch.randn(2, 4, 16, device=device)
    y = torch.randint(2000, (8,), device=device)
    out = model(x)
    assert out.dtype == torch.float32
    loss = None

    def run():
        nonlocal loss
        loss = F.cross_entropy(out.view(-1, 2000), y)

    calls = _softmax_input_dtypes(run)
    low_name = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}[low]
    first = "optamp::fused_cross_entropy" if device == "cuda" else "optamp::widened_log_softmax"
    assert calls[0] == (first, low_name), calls
    assert "ToCopyBackward0" not in graph_node_names(loss)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    copied = model(x).clone()  # not the boundary's output: torch's loss of fp32 logits
    calls = _softmax_input_dtypes(lambda: F.cross_entropy(copied.view(-1, 2000), y).backward())
    assert calls[0] == ("aten::log_softmax", "float"), calls
    expected = F.cross_entropy(copied.view(-1, 2000), y)
    torch.testing.assert_close(loss, expected, **tol(torch.float32))
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, **tol(low))
    kept = model(x)
    kept.retain_grad()  # the fp32 output's gradient is looked at: the loss must send it there
    calls = _softmax_input_dtypes(lambda: F.cross_entropy(kept.view(-1, 2000), y).backward())
    assert calls[0] == ("aten::log_softmax", "float"), calls
    assert kept.grad is not None and kept.grad.dtype == torch.float32


class _ReversedGradient(torch.autograd.Function):
    """A gradient reversal layer (domain-adversarial training): the identity forward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_logits_passed_through_a_custom_function_send_their_gradient_through_it(fresh, level):
    """A custom autograd Function that returns its input hands back a view of the model's fp32
    output. Until 2026-12-06 the loss read the reduced companion of that view's base, so the
    gradient went around the Function: a module's full backward hooks (which wrap the module's
    outputs in such a Function) never ran on the initialized model, and a gradient reversal on
    the logits was lost (the parameters got the un-reversed gradient)."""
    model = torch.nn.Linear(16, 10)
    init(model, opt_level=level)
    x, y = torch.randn(8, 16), torch.randint(10, (8,))
    F.cross_entropy(model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(_ReversedGradient.apply(model(x)), y).backward()
    for got, want in zip((p.grad for p in model.parameters()), plain):
        torch.testing.assert_close(got, -want, rtol=0, atol=0)
    model.zero_grad()
    seen = []
    handle = model.register_full_backward_hook(
        lambda module, grad_in, grad_out: seen.append(grad_out[0].dtype))
    F.cross_entropy(model(x), y).backward()
    handle.remove()
    assert seen == [torch.float32], "the hook ran, with the fp32 output's gradient"
    for got, want in zip((p.grad for p in model.parameters()), plain):
        torch.testing.assert_close(got, want, **tol(torch.float32))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("level,low", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_the_fused_loss_captures_in_a_cuda_graph(fresh, level, low):
    """optamp.fused_cross_entropy (the CUDA loss of reduced logits) reads nothing on the host, so
    a loss and its backward capture in a CUDA graph, and a replay gives the eager gradient bit for
    bit (each row is reduced in a fixed order), ignored rows included."""
    init(Mlp().cuda(), opt_level=level)
    logits = torch.randn(64, 3000, device="cuda").to(low).requires_grad_()
    y = torch.randint(3000, (64,), device="cuda")
    y[3] = -100

    def step():
        logits.grad = None
        F.cross_entropy(logits, y).backward()

    step()
    eager = logits.grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's recipe does
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    logits.grad = None
    with torch.cuda.graph(graph):
        F.cross_entropy(logits, y).backward()
    logits.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(logits.grad, eager)
    assert logits.grad[3].eq(0).all()


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("level,low", [("O1", torch.float16), ("O4", torch.bfloat16)])
@pytest.mark.parametrize("fn,op", [(F.log_softmax, "optamp::widened_log_softmax"),
                                   (F.softmax, "optamp::widened_softmax")])
def test_softmaxes_of_reduced_input_without_a_widened_copy(fresh, level, low, device, fn, op):
    """F.log_softmax of a language model's [batch, tokens, vocab] logits (a KL term, a
    hand-written nll_loss) and F.softmax of the last dimension (attention written out): Apex's
    fp32 rule is computed from the reduced input by optamp's ops, with the cast path's values and
    gradients (bit for bit on the CPU). A dtype the caller names is left alone. On CUDA an fp16
    softmax with no backward to follow takes torch's kernel (fp16 in, fp32 out: its forward is the
    faster)."""
    init(Mlp().to(device), opt_level=level)
    logits = torch.randn(2, 3, 1100, device=device).to(low).requires_grad_()
    reference = logits.detach().clone().requires_grad_()
    grad = torch.randn(2, 3, 1100, device=device)
    with optamp.disable_casts():
        expected = fn(reference.float(), dim=-1)
        expected.backward(grad)
    out = None

    def run():
        nonlocal out
        out = fn(logits, dim=-1)
        out.backward(grad)

    calls = _softmax_input_dtypes(run)
    low_name = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}[low]
    assert (op, low_name) in calls, calls
    if device == "cuda":
        assert not [c for c in calls if c[0] == "aten::_to_copy"], calls
    _expect_the_cast_paths(out, expected, logits, reference, device)
    detached = _softmax_input_dtypes(lambda: fn(logits.detach(), dim=-1))
    torchs_forward = device == "cuda" and low == torch.float16 and fn is F.softmax
    assert ("aten::_softmax" if torchs_forward else op, low_name) in detached, detached
    if device == "cuda":
        assert not [c for c in detached if c[0] == "aten::_to_copy"], detached
    assert fn(logits, dim=-1, dtype=torch.float64).dtype == torch.float64
