"""amp.precision_report and amp.compare_with_fp32: dtypes per level, planted overflow (forward and
backward, named by module path) and flush, the probe off after the block, bit-identical training
with a report, the fp32 comparison per level, and argument errors."""
import copy
import json

import pytest
import torch

import optamp as amp
from common_utils import init


class Net(torch.nn.Module):
    """encoder -> relu -> head -> softmax, with named submodules."""

    def __init__(self, d=16, d_out=4):
        super().__init__()
        self.encoder = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, d_out)

    def forward(self, x):
        return torch.softmax(self.head(torch.relu(self.encoder(x))), 1)


def rows_of(rep, op, scope=None, phase="forward"):
    return [r for r in rep.rows if r["op"] == op and r["phase"] == phase
            and (scope is None or r["scope"] == scope)]


def one_row(rep, op, scope=None, phase="forward"):
    rows = rows_of(rep, op, scope, phase)
    assert len(rows) == 1, (op, scope, phase, rep.table(200))
    return rows[0]


@pytest.mark.parametrize("level,low", [("O1", "float16"), ("O4", "bfloat16")])
def test_linear_runs_in_the_low_dtype_and_softmax_in_float32(fresh, level, low):
    net = init(Net(), opt_level=level)
    with amp.precision_report(net) as rep:
        net(torch.randn(3, 16))
    assert one_row(rep, "aten::linear", "encoder")["dtypes"] == {low: 1}
    assert one_row(rep, "aten::softmax.int", "Net")["dtypes"] == {"float32": 1}
    assert one_row(rep, "aten::linear", "head")["calls"] == 1


def test_o0_runs_everything_in_float32_and_counts_calls(fresh):
    net = init(Net(), opt_level="O0")
    with amp.precision_report(net) as rep:
        for _ in range(3):
            net(torch.randn(2, 16))
    row = one_row(rep, "aten::linear", "encoder")
    assert row["dtypes"] == {"float32": 3} and row["calls"] == 3 and row["elements"] == 3 * 2 * 16
    assert rep.first_nonfinite is None


def overflowing_head(opt_level):
    """A Net whose head's outputs exceed float16's range: 1000 * (sum of relu(encoder) ~ 1e3),
    on inputs of 100; initialized at `opt_level`, with its report of one forward."""
    net = Net()
    with torch.no_grad():
        net.head.weight.fill_(1000.0)
    net = init(net, opt_level=opt_level)
    with amp.precision_report(net) as rep:
        net(torch.full((2, 16), 100.0))
    return rep


def test_forward_overflow_names_the_innermost_op_and_the_module(fresh):
    rep = overflowing_head("O1")
    first = rep.first_nonfinite
    assert first is not None, rep.table()
    assert (first["op"], first["phase"], first["scope"], first["dtype"]) == (
        "aten::addmm", "forward", "head", "float16")
    assert one_row(rep, "aten::linear", "head")["nonfinite"] == 8
    assert one_row(rep, "aten::linear", "encoder")["nonfinite"] == 0


def test_a_kernels_cast_of_memory_it_has_not_written_is_not_reported(fresh):
    # CPU mean of fp16 converts its unwritten result to fp32 before summing into it; that cast
    # read whatever the memory held (NaN left by the freed tensors here), and the probe named a
    # copy_ no value of the program held as the first inf/NaN (seen in a timm LeViT at O2).
    net = init(Net(), opt_level="O2")
    x = torch.randn(2, 384).half()
    with amp.precision_report(net) as rep:
        for _ in range(50):
            freed = [torch.full((768,), float("nan")) for _ in range(4)]
            del freed
            mean = x.mean(0)
    assert torch.isfinite(mean).all()
    assert {r["op"] for r in rep.rows if r["nonfinite"]} == {"aten::full", "aten::fill_.Scalar"}, (
        rep.table(60))
    assert one_row(rep, "aten::mean.dim", "")["nonfinite"] == 0
    assert one_row(rep, "aten::sum.IntList_out", "")["elements"] == 50 * 384, "still measured"


def test_the_same_model_in_fp32_shows_what_float16_would_overflow(fresh):
    rep = overflowing_head("O0")
    head = one_row(rep, "aten::linear", "head")
    assert head["fp16_overflow_fraction"] == 1.0 and head["bf16_overflow_fraction"] == 0.0
    assert head["nonfinite"] == 0 and rep.first_nonfinite is None


def test_flush_is_reported_where_float16_loses_tiny_values(fresh):
    tiny = torch.full((2, 16), 1e-9)  # below float16's smallest subnormal (6e-8) / 2
    net = init(Net(), opt_level="O1")
    with amp.precision_report(net) as rep:
        net(tiny)
        net(torch.full((2, 16), 0.5))
    # At O1 the cast of the input to float16 flushes it: counted against what it converted.
    cast = rows_of(rep, "aten::_to_copy", "encoder")
    assert cast and sum(r["fp16_flush"] for r in cast) == 32, rep.table(200)
    assert one_row(rep, "aten::_to_copy", "encoder")["fp16_flush_fraction"] < 1.0  # 0.5 survives
    amp.reset()
    net = init(Net(), opt_level="O0")
    with amp.precision_report(net) as fp32:
        net(tiny)
    assert not rows_of(fp32, "aten::_to_copy", "encoder"), "nothing is cast at O0"
    assert one_row(fp32, "aten::t", "encoder")["elements"] == 0, "a view: nothing new measured"
    encoder = one_row(fp32, "aten::linear", "encoder")
    assert encoder["fp16_flush"] == 0 and encoder["bf16_flush"] == 0, "O(1) outputs: no flush"


def test_backward_overflow_names_the_node_and_the_forward_module(fresh):
    net = Net(d_out=16)
    with torch.no_grad():
        net.head.weight.fill_(300.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, opt_level="O1", loss_scale=1e4)
    x = torch.randn(4, 16) * 0.01
    with amp.precision_report(net) as rep:
        loss = net.head(torch.relu(net.encoder(x))).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()  # head's input gradient: 1e4 * 300 * 16 overflows float16
    first = rep.first_nonfinite
    assert first is not None, rep.table()
    assert (first["phase"], first["scope"], first["node"], first["op"]) == (
        "backward", "head", "AddmmBackward0", "aten::mm"), rep.table()
    assert all(r["nonfinite"] == 0 for r in rep.rows if r["phase"] == "forward")
    assert amp.loss_scaler(0).last_step_skipped


def test_a_causal_masks_infinity_is_not_taken_for_the_overflow(fresh):
    # torch.nn.Transformer's causal mask is -inf above the diagonal (generate_square_subsequent_mask
    # fills it from a scalar): every such model was reported at the mask's fill_, whatever
    # overflowed later. The ops that carry an infinity they were given do not make it; the first
    # inf/NaN is the backward overflow of the over-scaled loss.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, opt_level="O1")
    x = torch.randn(2, 5, 16)
    with amp.precision_report(net) as rep:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
        out = net(x, mask=mask, is_causal=True)
        (out.float().pow(2).sum() * 1e9).backward()  # its float16 gradients overflow
    first = rep.first_nonfinite
    assert first is not None, rep.table()
    assert first["phase"] == "backward" and first["from_inputs"] is False, rep.table()
    assert any(r["op"] == "aten::fill_.Scalar" and r["nonfinite"] > 0 for r in rep.rows)
    # Nothing overflows: the mask is all there is, and it is not named.
    with amp.precision_report(net) as quiet:
        net(x, mask=torch.nn.Transformer.generate_square_subsequent_mask(5), is_causal=True)
    assert quiet.first_nonfinite is None, quiet.table()
    assert "No op made an inf/NaN" in quiet.table()
    # A corrupt batch from outside: named where it is first carried, marked as such.
    bad = x.clone()
    bad[0, 1, 3] = float("nan")
    with amp.precision_report(net) as corrupt:
        net(bad, mask=torch.nn.Transformer.generate_square_subsequent_mask(5), is_causal=True)
    first = corrupt.first_nonfinite
    assert first is not None and first["from_inputs"] is True, corrupt.table()
    assert first["scope"].startswith("layers.0"), corrupt.table()


def test_no_probe_after_the_block_and_hooks_removed(fresh):
    net = init(Net(), opt_level="O1")
    with amp.precision_report(net) as rep:
        assert rep.recording
        net(torch.randn(2, 16))
    calls = rep.to_dict()["calls"]
    assert not rep.recording
    net(torch.randn(2, 16))
    assert rep.to_dict()["calls"] == calls
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    with amp.precision_report() as again:  # the probe is free again
        torch.ones(2).exp()
    assert one_row(again, "aten::exp", "")["calls"] == 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_training_is_bit_identical_with_a_report(level):
    def train(report):
        amp.reset()
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        net, opt = init(net, opt, opt_level=level)
        with amp.precision_report(net) if report else _nothing():
            for step in range(3):
                x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
                loss = torch.nn.functional.nll_loss(net(x).log(), y)
                opt.zero_grad()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
        params = [p.detach().clone() for p in net.parameters()]
        amp.reset()
        return params

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_report_forms_and_several_models(fresh):
    a, b = Net(), Net()
    with amp.precision_report([a, b]) as rep:
        b(a(torch.randn(2, 16)).repeat(1, 4))
    assert one_row(rep, "aten::linear", "0.encoder")["calls"] == 1
    assert one_row(rep, "aten::linear", "1.head")["calls"] == 1
    json.dumps(rep.to_dict())
    text = str(rep)
    assert text.startswith("| op | scope | phase | dtypes | calls |") and "0.encoder" in text
    # The hint names what Python has (rows), and rows holds every row the table left out.
    short = rep.table(max_rows=3)
    assert f"{len(rep.rows) - 3} more rows" in short and "rows in Python" in short


def test_bad_arguments(fresh):
    with pytest.raises(TypeError, match="item 1 is a str"):
        amp.precision_report([Net(), "net"])
    with amp.precision_report(label="warmup") as rep:
        with pytest.raises(RuntimeError, match='only one probe records at a time; "warmup"'):
            with amp.precision_report():
                pass
        with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
            rep.table(0)
    with pytest.raises(RuntimeError, match="already recorded"):
        with rep:
            pass
    with pytest.raises(RuntimeError, match="nothing recorded yet"):
        amp.precision_report().rows
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got str"):
        amp.compare_with_fp32("net", torch.randn(2, 16))


# ---- compare_with_fp32 ---------------------------------------------------------------------


class BnNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(self.bn(self.fc(x))))


@pytest.mark.parametrize("level", ["O1", "O2", "O4"])
def test_fp32_comparison_shows_the_level_error_per_module(fresh, level):
    net = BnNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, opt_level=level)
    x = torch.randn(8, 16)
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    cmp = amp.compare_with_fp32(net, x)
    assert [r["module"] for r in cmp.rows] == ["BnNet", "fc", "bn", "drop", "out"]
    low = "bfloat16" if level == "O4" else "float16"
    fc = cmp.rows[1]
    assert fc["dtype"] == low and 0 < fc["rel_error"] < 0.05 and fc["max_abs_error"] > 0
    # Training state as before: buffers, RNG, no grads, no cached casts.
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in net.parameters())
    assert amp.cache_size() == 0
    assert f"| module | call | dtype at {level} |" in str(cmp)
    json.dumps(cmp.to_dict())


def test_fp32_comparison_is_exact_at_o0(fresh):
    net = init(BnNet(), opt_level="O0")
    cmp = amp.compare_with_fp32(net, torch.randn(8, 16))
    assert all(r["rel_error"] == 0.0 and r["dtype"] == "float32" for r in cmp.rows)


def test_disable_casts_at_o2_runs_the_fp32_masters():
    """The reference compare_with_fp32 uses: at O2, disable_casts turns off the working-copy
    substitution too, so the forward equals an untouched fp32 copy's."""
    amp.reset()
    net = Net()
    x = torch.randn(4, 16)
    fp32 = copy.deepcopy(net)(x)  # before initialize: plain fp32
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = init(net, opt, opt_level="O2")
    with torch.enable_grad():
        assert net.encoder(x).dtype == torch.float16
        with amp.disable_casts():
            assert torch.equal(net(x), fp32)
    amp.reset()


def test_fp32_comparison_refuses_o3(fresh):
    net = init(Net(), opt_level="O3")
    with pytest.raises(RuntimeError, match="no fp32 reference at O3"):
        amp.compare_with_fp32(net, torch.randn(2, 16).half())


def test_backward_ops_of_cast_inputs_and_engine_work_carry_the_module(fresh):
    """gelu at O1 runs in fp32 as optamp's own op (optamp::widened_gelu), whose node optamp makes
    in the Block's forward: its backward's ops carry the Block's scope; and the engine reduces a
    linear's bias gradient after AddmmBackward0 ends."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x))

    block = init(Block(), opt_level="O1")
    with amp.precision_report(block) as rep:
        block(torch.randn(4, 16, requires_grad=True)).float().sum().backward()
    gelu = one_row(rep, "aten::gelu_backward", phase="backward")
    assert (gelu["scope"], gelu["node"]) == ("Block", "WidenedGeluBackward")
    after = one_row(rep, "aten::sum.dim_IntList", phase="backward")
    assert (after["scope"], after["node"]) == ("fc", "after AddmmBackward0"), rep.table(200)
