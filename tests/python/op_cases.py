"""The casting tests' cases: the C++ op tables mirrored (tests/cpp/test_casting.cpp), the public
Python paths that reach other operators, and the levels and devices they run at. A case is a
callable taking an :class:`In` (the dtype and device to build inputs in)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}
CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]


def r(*shape, dtype=torch.float32, device="cpu"):
    return torch.rand(*shape, dtype=dtype, device=device) + 0.5


class In:
    """The inputs of one table case, in the low dtype ``t`` on device ``d`` (as the C++ tables:
    ``n`` randn, ``r`` rand + 0.5, ``hi`` rand + 0.5 in fp32, ``idx`` int64 indices)."""

    def __init__(self, t, d):
        self.t, self.d = t, d

    def n(self, *shape):
        return torch.randn(*shape, dtype=self.t, device=self.d)

    def r(self, *shape):
        return r(*shape, dtype=self.t, device=self.d)

    def hi(self, *shape):
        return r(*shape, device=self.d)

    def idx(self, *values):
        return torch.tensor(values, device=self.d)

    def signs(self):  # +1/-1 targets of the margin losses
        return torch.tensor([1.0, -1.0, 1.0, -1.0], device=self.d).to(self.t)


def _quiet(fn):
    def run(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation warnings (chain_matmul)
            return fn(m)
    return run


aten = torch.ops.aten

def _BATCH_SIZES():  # noqa: N802  (a constant, built per call: always CPU int64)
    return torch.tensor([2, 2, 1])


def _simple_rnn(op, form):
    """aten.rnn_tanh / aten.rnn_relu (same signatures), one layer without biases."""
    overload = getattr(getattr(aten, op), form)
    if form == "input":
        return lambda m: overload(m.n(3, 2, 3), m.n(1, 2, 4), [m.n(4, 3), m.n(4, 4)], False, 1,
                                  0.0, True, False, False)[0]
    return lambda m: overload(m.n(5, 3), _BATCH_SIZES(), m.n(1, 2, 4), [m.n(4, 3), m.n(4, 4)],
                              False, 1, 0.0, True, False)[0]


# ---- the C++ tables (tests/cpp/test_casting.cpp lower_cases / fp32_cases / promote_cases) ----
# Keyed, like them, by the policy-table entry ("op" or "op.overload" in aten::) each case calls at
# the top level, with the same shapes. A public Python function is used where it reaches that
# overload; otherwise torch.ops.aten.<op>.<overload> (the *_PY tables below hold the public
# paths that reach a different operator). test_casting.py's test_every_table_entry_has_a_python_case
# checks the keys against the built policy table, test_every_case_calls_its_operator the calls.
LOWER = {
    "conv1d": lambda m: F.conv1d(m.n(1, 2, 8), m.n(3, 2, 3)),
    "conv2d": lambda m: F.conv2d(m.n(1, 2, 6, 6), m.n(3, 2, 3, 3)),
    "conv3d": lambda m: F.conv3d(m.n(1, 2, 4, 4, 4), m.n(3, 2, 3, 3, 3)),
    "conv1d.padding": lambda m: F.conv1d(m.n(1, 2, 8), m.n(3, 2, 3), padding="same"),
    "conv2d.padding": lambda m: F.conv2d(m.n(1, 2, 6, 6), m.n(3, 2, 3, 3), padding="same"),
    "conv3d.padding": lambda m: F.conv3d(m.n(1, 2, 4, 4, 4), m.n(3, 2, 3, 3, 3), padding="valid"),
    "convolution": lambda m: torch.convolution(m.n(1, 2, 6, 6), m.n(3, 2, 3, 3), m.n(3), [1, 1],
                                               [0, 0], [1, 1], False, [0, 0], 1),
    "_convolution": lambda m: torch._convolution(m.n(1, 2, 6, 6), m.n(3, 2, 3, 3), m.n(3), [1, 1],
                                                 [0, 0], [1, 1], False, [0, 0], 1, False, False,
                                                 True, False),
    "conv_transpose1d": lambda m: F.conv_transpose1d(m.n(1, 2, 5), m.n(2, 3, 3)),
    "conv_transpose2d.input": lambda m: F.conv_transpose2d(m.n(1, 2, 4, 4), m.n(2, 3, 3, 3)),
    "conv_transpose3d.input": lambda m: F.conv_transpose3d(m.n(1, 2, 3, 3, 3), m.n(2, 3, 2, 2, 2)),
    "conv_tbc": lambda m: torch.conv_tbc(m.n(5, 1, 2), m.n(3, 2, 4), m.n(4)),
    "linear": lambda m: F.linear(m.n(2, 4), m.n(3, 4), m.n(3)),
    "prelu": lambda m: F.prelu(m.n(2, 3), m.n(1)),
    "addmm": lambda m: torch.addmm(m.n(2, 2), m.n(2, 3), m.n(3, 2)),
    "_addmm_activation": lambda m: torch._addmm_activation(m.n(2, 2), m.n(2, 3), m.n(3, 2),
                                                           use_gelu=True),
    "addmv": lambda m: torch.addmv(m.n(2), m.n(2, 3), m.n(3)),
    "addr": lambda m: torch.addr(m.n(2, 3), m.n(2), m.n(3)),
    "matmul": lambda m: torch.matmul(m.n(2, 3), m.n(3, 2)),
    "mm": lambda m: torch.mm(m.n(2, 3), m.n(3, 2)),
    "mv": lambda m: torch.mv(m.n(2, 3), m.n(3)),
    "addbmm": lambda m: torch.addbmm(m.n(2, 2), m.n(3, 2, 4), m.n(3, 4, 2)),
    "baddbmm": lambda m: torch.baddbmm(m.n(3, 2, 2), m.n(3, 2, 4), m.n(3, 4, 2)),
    "bmm": lambda m: torch.bmm(m.n(3, 2, 4), m.n(3, 4, 2)),
    "chain_matmul": _quiet(lambda m: torch.chain_matmul(m.n(2, 3), m.n(3, 4), m.n(4, 2))),
    "linalg_multi_dot": lambda m: torch.linalg.multi_dot([m.n(2, 3), m.n(3, 4), m.n(4, 2)]),
    "einsum": lambda m: torch.einsum("ij,jk->ik", m.n(2, 3), m.n(3, 2)),
    "scaled_dot_product_attention": lambda m: F.scaled_dot_product_attention(
        m.n(1, 2, 4, 8), m.n(1, 2, 4, 8), m.n(1, 2, 4, 8)),
    "_native_multi_head_attention": lambda m: (lambda q: torch._native_multi_head_attention(
        q, q, q, 8, 2, m.n(24, 8), m.n(24), m.n(8, 8), m.n(8))[0])(m.n(2, 3, 8)),
    "lstm_cell": lambda m: torch.lstm_cell(m.n(2, 3), [m.n(2, 4), m.n(2, 4)], m.n(16, 3),
                                           m.n(16, 4))[0],
    "gru_cell": lambda m: torch.gru_cell(m.n(2, 3), m.n(2, 4), m.n(12, 3), m.n(12, 4)),
    "rnn_tanh_cell": lambda m: torch.rnn_tanh_cell(m.n(2, 3), m.n(2, 4), m.n(4, 3), m.n(4, 4)),
    "rnn_relu_cell": lambda m: torch.rnn_relu_cell(m.n(2, 3), m.n(2, 4), m.n(4, 3), m.n(4, 4)),
    # Whole layers (what nn.LSTM/GRU/RNN call; ".data" with a PackedSequence): one layer, no
    # biases, sequence 3, batch 2, input 3, hidden 4; packed: lengths {3, 2}, 5 rows.
    "lstm.input": lambda m: aten.lstm.input(m.n(3, 2, 3), [m.n(1, 2, 4), m.n(1, 2, 4)],
                                            [m.n(16, 3), m.n(16, 4)], False, 1, 0.0, True,
                                            False, False)[0],
    "lstm.data": lambda m: aten.lstm.data(m.n(5, 3), _BATCH_SIZES(), [m.n(1, 2, 4), m.n(1, 2, 4)],
                                          [m.n(16, 3), m.n(16, 4)], False, 1, 0.0, True,
                                          False)[0],
    "gru.input": lambda m: aten.gru.input(m.n(3, 2, 3), m.n(1, 2, 4), [m.n(12, 3), m.n(12, 4)],
                                          False, 1, 0.0, True, False, False)[0],
    "gru.data": lambda m: aten.gru.data(m.n(5, 3), _BATCH_SIZES(), m.n(1, 2, 4),
                                        [m.n(12, 3), m.n(12, 4)], False, 1, 0.0, True, False)[0],
    **{f"{op}.{form}": _simple_rnn(op, form) for op in ("rnn_tanh", "rnn_relu")
       for form in ("input", "data")},
}


def _u(fn):
    return lambda m: fn(m.r(2, 3))


def _upsample(name, rank, *align):
    """The "" overload (sizes) and the ".vec" one (optional sizes, optional scales)."""
    shape, size = [(1, 1, 4), (1, 1, 2, 2), (1, 1, 2, 2, 2)][rank - 1], [[8], [4, 4], [4, 4, 4]][
        rank - 1]
    if name.endswith("_aa"):
        shape, size = (1, 1, 4, 4), [2, 3]
    op = getattr(aten, name)
    return {name: lambda m: op.default(m.r(*shape), size, *align),
            name + ".vec": lambda m: op.vec(m.r(*shape), size, *align, None)}


FP32 = {
    **_upsample("upsample_nearest1d", 1),
    **_upsample("upsample_nearest2d", 2),
    **_upsample("upsample_nearest3d", 3),
    **_upsample("upsample_linear1d", 1, False),
    **_upsample("upsample_bilinear2d", 2, False),
    **_upsample("upsample_bicubic2d", 2, False),
    **_upsample("upsample_trilinear3d", 3, False),
    **_upsample("_upsample_nearest_exact1d", 1),
    **_upsample("_upsample_nearest_exact2d", 2),
    **_upsample("_upsample_nearest_exact3d", 3),
    **_upsample("_upsample_bilinear2d_aa", 2, False),
    **_upsample("_upsample_bicubic2d_aa", 2, False),
    "avg_pool3d": lambda m: F.avg_pool3d(m.r(1, 1, 4, 4, 4), 2),
    "grid_sampler": lambda m: torch.grid_sampler(m.r(1, 1, 3, 3), m.r(1, 2, 2, 2) - 1.0, 0, 0,
                                                 False),
    "softplus": _u(F.softplus),
    "softmax.int": _u(lambda x: torch.softmax(x, 1)),
    "log_softmax.int": _u(lambda x: torch.log_softmax(x, 1)),
    "gelu": _u(F.gelu),
    "layer_norm": _u(lambda x: F.layer_norm(x, (3,))),
    "group_norm": lambda m: F.group_norm(m.r(2, 4, 3), 2),
    "cosine_similarity": lambda m: F.cosine_similarity(m.r(2, 3), m.r(2, 3)),
    "acos": _u(lambda x: torch.acos(x - 1.0)),
    "asin": _u(lambda x: torch.asin(x - 1.0)),
    "cosh": _u(torch.cosh),
    "erfinv": _u(lambda x: torch.erfinv(x - 1.0)),
    "exp": _u(torch.exp),
    "expm1": _u(torch.expm1),
    "log": _u(torch.log),
    "log10": _u(torch.log10),
    "log2": _u(torch.log2),
    "log1p": _u(torch.log1p),
    "reciprocal": _u(torch.reciprocal),
    "rsqrt": _u(torch.rsqrt),
    "sinh": _u(torch.sinh),
    "tan": _u(torch.tan),
    "pow.Tensor_Scalar": _u(lambda x: torch.pow(x, 2)),
    "pow.Tensor_Tensor": _u(lambda x: torch.pow(x, x)),
    "pow.Scalar": _u(lambda x: torch.pow(2.0, x)),
    "cumprod": _u(lambda x: torch.cumprod(x, 1)),
    "cumsum": _u(lambda x: torch.cumsum(x, 1)),
    "dist": _u(lambda x: torch.dist(x, x * 2)),
    "norm.Scalar": _u(aten.norm.Scalar),
    "norm.ScalarOpt_dim": _u(lambda x: aten.norm.ScalarOpt_dim(x, 2, [1])),
    # The overloads with a required dtype: the result has the caller's dtype (fp32 here).
    "norm.ScalarOpt_dim_dtype": _u(
        lambda x: aten.norm.ScalarOpt_dim_dtype(x, 2, [1], False, dtype=torch.float32)),
    "norm.ScalarOpt_dtype": _u(lambda x: aten.norm.ScalarOpt_dtype(x, 2, dtype=torch.float32)),
    "linalg_vector_norm": _u(torch.linalg.vector_norm),
    "prod": _u(torch.prod),
    "prod.dim_int": _u(lambda x: torch.prod(x, 1)),
    "std": _u(lambda x: aten.std.default(x, True)),
    "std.dim": _u(lambda x: aten.std.dim(x, [1], True)),
    "std.correction": _u(lambda x: aten.std.correction(x, [1], correction=1)),
    "sum": _u(torch.sum),
    "sum.dim_IntList": _u(lambda x: torch.sum(x, [1])),
    "var": _u(lambda x: aten.var.default(x, True)),
    "var.dim": _u(lambda x: aten.var.dim(x, [1], True)),
    "var.correction": _u(lambda x: aten.var.correction(x, [1], correction=1)),
    "renorm": _u(lambda x: torch.renorm(x, 2, 0, 1)),
    # losses
    "nll_loss": lambda m: aten.nll_loss(m.r(4, 3), m.idx(0, 1, 2, 1)),
    "nll_loss2d": lambda m: aten.nll_loss2d(m.r(2, 3, 2, 2),
                                            m.idx(0, 1, 2, 1, 2, 0, 1, 1).view(2, 2, 2)),
    "nll_loss_nd": lambda m: F.nll_loss(m.r(4, 3), m.idx(0, 1, 2, 1)),
    "cross_entropy_loss": lambda m: F.cross_entropy(m.r(4, 3), m.idx(0, 1, 2, 1)),
    "mse_loss": lambda m: F.mse_loss(m.r(4), m.r(4)),
    "l1_loss": lambda m: F.l1_loss(m.r(4), m.r(4)),
    "smooth_l1_loss": lambda m: F.smooth_l1_loss(m.r(4), m.r(4)),
    "huber_loss": lambda m: F.huber_loss(m.r(4), m.r(4)),
    "kl_div": lambda m: torch.kl_div(m.r(4), m.r(4)),
    "binary_cross_entropy_with_logits": lambda m: F.binary_cross_entropy_with_logits(
        m.r(4), m.r(4) - 0.5),
    "soft_margin_loss": lambda m: F.soft_margin_loss(m.r(4), m.r(4)),
    "multi_margin_loss": lambda m: F.multi_margin_loss(m.r(4, 3), m.idx(0, 1, 2, 1)),
    "multilabel_margin_loss": lambda m: F.multilabel_margin_loss(
        m.r(2, 3), m.idx(0, 2, -1, 1, -1, 0).view(2, 3)),
    "hinge_embedding_loss": lambda m: F.hinge_embedding_loss(m.r(4), m.signs()),
    "margin_ranking_loss": lambda m: F.margin_ranking_loss(m.r(4), m.r(4), m.signs()),
    "cosine_embedding_loss": lambda m: F.cosine_embedding_loss(m.r(4, 3), m.r(4, 3), m.signs()),
    "poisson_nll_loss": lambda m: F.poisson_nll_loss(m.r(4), m.r(4)),
    "triplet_margin_loss": lambda m: F.triplet_margin_loss(m.r(4, 3), m.r(4, 3), m.r(4, 3)),
    # ctc: log-probs made in fp32, handed over in the case's dtype; 5 steps, batch 2, 4 classes.
    "ctc_loss.IntList": lambda m: torch.ctc_loss(
        torch.log_softmax(torch.randn(5, 2, 4, device=m.d), 2).to(m.t),
        m.idx(1, 2, 1, 3).view(2, 2), [5, 5], [2, 2]),
    "ctc_loss.Tensor": lambda m: torch.ctc_loss(
        torch.log_softmax(torch.randn(5, 2, 4, device=m.d), 2).to(m.t),
        m.idx(1, 2, 1, 3).view(2, 2), m.idx(5, 5), m.idx(2, 2)),
}

# Mixed widths: the first input in the low dtype, the second in fp32.
PROMOTE = {
    "addcdiv": lambda m: torch.addcdiv(m.r(3), m.hi(3), m.r(3)),
    "addcmul": lambda m: torch.addcmul(m.r(3), m.hi(3), m.r(3)),
    "atan2": lambda m: torch.atan2(m.r(3), m.hi(3)),
    "cross": lambda m: torch.cross(m.r(2, 3), m.hi(2, 3), 1),
    "linalg_cross": lambda m: torch.linalg.cross(m.r(2, 3), m.hi(2, 3)),
    "bilinear": lambda m: torch.bilinear(m.r(2, 3), m.hi(2, 4), m.hi(5, 3, 4), None),
    "dot": lambda m: torch.dot(m.r(3), m.hi(3)),
    "vdot": lambda m: torch.vdot(m.r(3), m.hi(3)),
    "add.Tensor": lambda m: torch.add(m.r(3), m.hi(3)),
    "sub.Tensor": lambda m: torch.sub(m.r(3), m.hi(3)),
    "mul.Tensor": lambda m: torch.mul(m.r(3), m.hi(3)),
    "div.Tensor": lambda m: torch.div(m.r(3), m.hi(3)),
    "eq.Tensor": lambda m: torch.eq(m.r(3), m.hi(3)),
    "ne.Tensor": lambda m: torch.ne(m.r(3), m.hi(3)),
    "lt.Tensor": lambda m: torch.lt(m.r(3), m.hi(3)),
    "le.Tensor": lambda m: torch.le(m.r(3), m.hi(3)),
    "gt.Tensor": lambda m: torch.gt(m.r(3), m.hi(3)),
    "ge.Tensor": lambda m: torch.ge(m.r(3), m.hi(3)),
    "cat": lambda m: torch.cat([m.r(3), m.hi(3)]),
    "stack": lambda m: torch.stack([m.r(3), m.hi(3)]),
    "index_put": lambda m: torch.index_put(m.r(4), (m.idx(1, 2),), m.hi(2)),
    "tensordot": lambda m: torch.tensordot(m.r(2, 3), m.hi(3, 4), ([1], [0])),
    # A low-precision table with fp32 per-sample weights (mode sum): 4 indices in 2 bags.
    "embedding_bag": lambda m: aten.embedding_bag.default(
        m.r(5, 3), m.idx(0, 1, 2, 3), m.idx(0, 2), False, 0, False, m.hi(4))[0],
    "embedding_bag.padding_idx": lambda m: F.embedding_bag(
        m.idx(0, 1, 2, 3), m.r(5, 3), m.idx(0, 2), mode="sum", per_sample_weights=m.hi(4),
        padding_idx=4),
}
# Comparisons return bool whatever they compare in; the widening shows in cast_count().
RESULT = {f"{op}.Tensor": torch.bool for op in ("eq", "ne", "lt", "le", "gt", "ge")}

# ---- public Python paths that reach a different operator than the C++ case -----------------
LOWER_PY = {
    "nn.Linear": lambda m: torch.nn.Linear(3, 2).to(m.d)(m.n(2, 3)),
    "nn.LSTMCell": lambda m: torch.nn.LSTMCell(3, 4).to(m.d)(m.n(2, 3))[0],
    "einsum_batched": lambda m: torch.einsum("bij,bjk->bik", m.n(2, 2, 3), m.n(2, 3, 2)),
}
FP32_PY = {
    "F.kl_div": lambda m: F.kl_div(m.r(4), m.r(4), reduction="batchmean"),
    "torch.norm": _u(torch.norm),
    "torch.std": _u(torch.std),
    "F.grid_sample": lambda m: F.grid_sample(m.r(1, 1, 3, 3), m.r(1, 2, 2, 2) - 1.0,
                                             align_corners=False),
    "interpolate_nearest": lambda m: F.interpolate(m.r(1, 1, 4, 4), scale_factor=2.0),
    "interpolate_nearest_exact_1d": lambda m: F.interpolate(m.r(1, 1, 4), size=7,
                                                            mode="nearest-exact"),
    "interpolate_bilinear": lambda m: F.interpolate(m.r(1, 1, 4, 4), size=(3, 5), mode="bilinear"),
    "interpolate_bicubic_antialias": lambda m: F.interpolate(m.r(1, 1, 4, 4), size=(2, 3),
                                                             mode="bicubic", antialias=True),
}
PROMOTE_PY = {
    "operator*": lambda m: m.r(3) * m.hi(3),
    "F.bilinear": lambda m: F.bilinear(m.r(2, 3), m.hi(2, 4), m.hi(5, 3, 4)),
    "F.embedding_bag": lambda m: F.embedding_bag(
        m.idx(0, 1, 2, 3), m.r(5, 3), m.idx(0, 2), mode="sum", per_sample_weights=m.hi(4)),
}
TABLES = {"lower": LOWER, "fp32": FP32, "promote": PROMOTE}
