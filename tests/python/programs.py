"""Small models in the shapes of real programs where casting rules were found wanting, shared by
the tests that found them (test_casting.py, test_compose.py) and by test_programs_on_devices.py,
which trains each of them on every device. Tensors a forward makes are made on its input's
device, so the same model runs on the CPU and on a GPU."""
import torch
import torch.nn.functional as F


class Experts(torch.nn.Module):
    """A top-2 mixture of experts routed by index_add_ into a buffer made from the input."""

    def __init__(self, d=8, experts=3):
        super().__init__()
        self.gate = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        weights, chosen = F.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot].unsqueeze(-1))
        return self.head(x + out)


class SinusoidalNet(torch.nn.Module):
    """Embeddings plus a positional encoding made in the forward (fp32, as torch.zeros makes it),
    then a layer norm and a group norm: the classic transformer input stage."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
        self.group = torch.nn.GroupNorm(4, 16)
        self.out = torch.nn.Linear(16, 50)

    def forward(self, idx):
        device = idx.device
        pos = torch.arange(idx.shape[1], dtype=torch.float32, device=device)[:, None]
        freq = torch.exp(torch.arange(0, 16, 2, dtype=torch.float32, device=device) * (-9.2 / 16))
        encoding = torch.zeros(idx.shape[1], 16, device=device)
        encoding[:, 0::2] = torch.sin(pos * freq)
        encoding[:, 1::2] = torch.cos(pos * freq)
        x = self.norm(self.emb(idx) + encoding)
        x = self.group(self.body(x).transpose(1, 2)).transpose(1, 2)
        return self.out(x)


class SpectralNet(torch.nn.Module):
    """An FNO-style spectral layer between two linears (complex weights over the low modes), and
    an stft feature of the input with a registered window buffer, as audio front ends have."""

    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(1, 4)
        self.modes = torch.nn.Parameter(torch.randn(4, 4, 5, dtype=torch.complex64) * 0.2)
        self.proj = torch.nn.Linear(4, 1)
        self.register_buffer("window", torch.hann_window(8))

    def forward(self, x):  # x: [batch, 32]
        h = self.lift(x.unsqueeze(-1)).transpose(1, 2)  # [batch, 4, 32], reduced below O0
        spectrum = torch.fft.rfft(h)[..., :5]
        h = torch.fft.irfft(torch.einsum("bix,iox->box", spectrum, self.modes), n=x.shape[-1])
        feature = torch.stft(x, 8, window=self.window, return_complex=True).abs().mean()
        return self.proj(h.transpose(1, 2)).squeeze(-1) + feature


class DiagonalStateSpaceNet(torch.nn.Module):
    """An S4D-style layer (a diagonal state-space model): its complex state matrix and output
    projection are real parameters made complex in the forward (`view_as_complex` of real pairs,
    `-exp(log_a) + 1j * a_imag`), its convolution kernel a Vandermonde product of complex
    exponentials, applied through an FFT; between a linear and a layer norm, as S4 models are."""

    def __init__(self, channels=4, states=4):
        super().__init__()
        self.lift = torch.nn.Linear(1, channels)
        self.log_dt = torch.nn.Parameter(torch.linspace(-4.0, -2.0, channels))
        self.c = torch.nn.Parameter(torch.randn(channels, states, 2) * 0.5)
        self.log_a_real = torch.nn.Parameter(torch.full((channels, states), -0.7))
        frequencies = torch.pi * torch.arange(states).float()
        self.a_imag = torch.nn.Parameter(frequencies.repeat(channels, 1))
        self.norm = torch.nn.LayerNorm(channels)
        self.proj = torch.nn.Linear(channels, 1)

    def forward(self, x):  # x: [batch, length]
        u = self.lift(x.unsqueeze(-1)).transpose(1, 2)  # [batch, channels, length]
        length = x.shape[-1]
        a = -torch.exp(self.log_a_real) + 1j * self.a_imag
        dt_a = a * torch.exp(self.log_dt)[:, None]
        c = torch.view_as_complex(self.c) * (torch.exp(dt_a) - 1.0) / a
        powers = torch.exp(dt_a[..., None] * torch.arange(length))
        kernel = 2 * torch.einsum("hn,hnl->hl", c, powers).real
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * length) * torch.fft.rfft(kernel, n=2 * length),
                            n=2 * length)[..., :length]
        return self.proj(self.norm((y + u).transpose(1, 2))).squeeze(-1)


class LinearRecurrentNet(torch.nn.Module):
    """A linear recurrent unit (Orvieto et al., 2023) as its PyTorch ports write it: a complex
    diagonal recurrence whose eigenvalues are `exp(-exp(nu_log) + 1j * exp(theta_log))`, input
    and output matrices made complex from real pairs, unrolled over time."""

    def __init__(self, width=4, states=6):
        super().__init__()
        self.lift = torch.nn.Linear(2, width)
        self.nu_log = torch.nn.Parameter(torch.linspace(-2.0, 0.0, states))
        self.theta_log = torch.nn.Parameter(torch.linspace(-1.0, 1.5, states))
        self.b_re = torch.nn.Parameter(torch.randn(states, width) * 0.3)
        self.b_im = torch.nn.Parameter(torch.randn(states, width) * 0.3)
        self.c_re = torch.nn.Parameter(torch.randn(width, states) * 0.3)
        self.c_im = torch.nn.Parameter(torch.randn(width, states) * 0.3)
        self.proj = torch.nn.Linear(width, 1)

    def forward(self, x):  # x: [batch, length, 2]
        u = self.lift(x)
        eigenvalues = torch.exp(-torch.exp(self.nu_log) + 1j * torch.exp(self.theta_log))
        b, c = self.b_re + 1j * self.b_im, self.c_re + 1j * self.c_im
        driven = torch.einsum("nd,bld->bln", b, u.to(b.dtype))
        state, outputs = torch.zeros_like(driven[:, 0]), []
        for t in range(x.shape[1]):
            state = eigenvalues * state + driven[:, t]
            outputs.append((state @ c.T).real)
        return self.proj(torch.stack(outputs, 1) + u).squeeze(-1)


class LinalgNet(torch.nn.Module):
    """Linear algebra on working copies and reduced activations: a normalizing flow's invertible
    1x1 convolution (slogdet of its weight, as Glow's), an orthogonal layer parametrized by
    Householder reflections, and a Gaussian-process-style head (an RBF kernel from cdist, solved
    through its Cholesky factor)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.linalg.qr(torch.randn(4, 4))[0])
        self.ortho = torch.nn.utils.parametrizations.orthogonal(
            torch.nn.Linear(8, 6), orthogonal_map="householder")
        self.feature = torch.nn.Linear(6, 3)

    def forward(self, x):  # x: [batch, 4, 2]
        z = torch.einsum("ij,bjk->bik", self.mix, x).flatten(1)
        log_det = 2 * torch.linalg.slogdet(self.mix)[1]
        f = self.feature(torch.tanh(self.ortho(z)))
        kernel = torch.exp(-torch.cdist(f, f) ** 2) + 0.1 * torch.eye(f.shape[0], device=x.device)
        alpha = torch.cholesky_solve(f, torch.linalg.cholesky(kernel))
        return alpha.float().pow(2).mean() - 0.01 * log_det.float()


def orthogonal_classifier():
    """A classifier whose first layer is orthogonal by parametrization: for a square weight
    orthogonal()'s default map, the matrix exponential."""
    return torch.nn.Sequential(
        torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(16, 16)), torch.nn.ReLU(),
        torch.nn.Linear(16, 4))


class TinyGpt(torch.nn.Module):
    """One pre-norm GPT block: learned positions, causal scaled-dot-product attention, a tanh-GELU
    MLP, a final layer norm and a head tied to the embedding."""

    def __init__(self, vocab=40, d=32, heads=4, seq=12):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, d)
        torch.nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.ln1, self.ln2, self.ln_f = (torch.nn.LayerNorm(d) for _ in range(3))
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU("tanh"),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.ln_f(x) @ self.emb.weight.t()


class UNetLike(torch.nn.Module):
    """Convolutions with batch norm, a max-pool down and a bilinear upsample back (an fp32 op
    in Apex's lists) with a skip connection: the shape of segmentation and diffusion nets."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1),
                                        torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.mid = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.up = torch.nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x):
        skip = self.down(x)
        h = F.interpolate(self.mid(F.max_pool2d(skip, 2)), scale_factor=2, mode="bilinear")
        return self.up(torch.cat([skip, h], dim=1))


def _fp32_only_function(device_type):
    """A custom autograd Function whose kernel takes fp32 only, declared for ``device_type`` with
    torch.amp.custom_fwd(cast_inputs=torch.float32), as such Functions are."""

    class Fp32Only(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx, x, w):
            if x.dtype != torch.float32 or w.dtype != torch.float32:
                raise TypeError(f"fp32 only, got {x.dtype} and {w.dtype}")
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad @ w.t(), x.t() @ grad

    return Fp32Only


_FP32_ONLY = {device_type: _fp32_only_function(device_type) for device_type in ("cpu", "cuda")}


class CustomFunctionNet(torch.nn.Module):
    """A linear layer feeding a custom fp32-only Function that multiplies by a weight of the
    model's own."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.randn(16, 4) * 0.3)

    def forward(self, x):
        return _FP32_ONLY[x.device.type].apply(torch.tanh(self.fc(x)), self.w)


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder ``nn.Transformer`` (causal target mask, shared embedding): the
    attention, layer norm and mask paths of a translation model."""

    def __init__(self, vocab=20, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.transformer = torch.nn.Transformer(width, 2, 1, 1, 32, dropout=0.0,
                                                batch_first=True)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, src, tgt):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1],
                                                                    device=tgt.device)
        hidden = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask,
                                  tgt_is_causal=True)
        return self.out(hidden)


class MessagePassing(torch.nn.Module):
    """One graph-network layer: edge messages gathered from both ends, summed into their
    destination with ``index_add_`` and max-pooled with ``scatter_reduce``, then a node update."""

    def __init__(self):
        super().__init__()
        self.message = torch.nn.Linear(12, 8)
        self.update = torch.nn.Linear(14, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, src, dst):
        messages = F.silu(self.message(torch.cat([x[src], x[dst]], -1)))
        zeros = messages.new_zeros(x.shape[0], messages.shape[1])
        summed = zeros.index_add(0, dst, messages)
        peak = zeros.scatter_reduce(0, dst[:, None].expand_as(messages), messages, "amax",
                                    include_self=False)
        return self.out(F.relu(self.update(torch.cat([x, summed + peak], -1))))


class SparseGcn(torch.nn.Module):
    """A graph convolution through a sparse adjacency matrix (``torch.sparse.mm``), normalized
    by the nodes' degrees."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x, src, dst):
        n = x.shape[0]
        with torch.sparse.check_sparse_tensor_invariants():  # torch warns unless asked
            adjacency = torch.sparse_coo_tensor(torch.stack([dst, src]),
                                                torch.ones(src.numel(), device=x.device),
                                                (n, n)).coalesce()
        degree = torch.sparse.sum(adjacency, 1).to_dense().clamp(min=1)
        return self.fc2(F.relu(torch.sparse.mm(adjacency, self.fc1(x)) / degree[:, None]))


class TinyNerf(torch.nn.Module):
    """A NeRF's volume rendering: sin/cos position encodings of the points along each ray, an
    MLP's density and colour, and the transmittance as a ``cumprod`` along the ray."""

    def __init__(self, octaves=6):
        super().__init__()
        self.octaves = octaves
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * (2 * octaves + 1), 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, origins, directions):
        t = torch.linspace(0.1, 2.0, 16, device=origins.device)
        points = origins[:, None] + directions[:, None] * t[None, :, None]
        angles = points[..., None] * 2.0 ** torch.arange(float(self.octaves),
                                                           device=origins.device)
        encoded = torch.cat([points, angles.sin().flatten(-2), angles.cos().flatten(-2)], -1)
        raw = self.mlp(encoded)
        density, colour = F.softplus(raw[..., 0]), torch.sigmoid(raw[..., 1:])
        alpha = 1 - torch.exp(-density * torch.diff(t, append=t[-1:] + 1e10))
        transmittance = torch.cumprod(
            torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return ((alpha * transmittance)[..., None] * colour).sum(1)


class NeuralOde(torch.nn.Module):
    """A neural ODE integrated by Heun's method the way torchdiffeq integrates: time and step
    are 0-dim fp64 tensors beside the state (torchdiffeq keeps time in fp64), which torch's
    promotion ranks below the state, so ``dt * k`` keeps the state's dtype."""

    def __init__(self, dim=4, steps=4):
        super().__init__()
        self.steps = steps
        self.field = torch.nn.Sequential(torch.nn.Linear(dim, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, dim))
        self.head = torch.nn.Linear(dim, 3)

    def forward(self, y):
        t = torch.zeros((), dtype=torch.float64, device=y.device)
        dt = torch.full((), 1.0 / self.steps, dtype=torch.float64, device=y.device)
        for _ in range(self.steps):
            k1 = self.field(y) * torch.cos(t)
            k2 = self.field(y + dt * k1) * torch.cos(t + dt)
            y = y + dt * 0.5 * (k1 + k2)
            t = t + dt
        return self.head(y)


class DecayNet(torch.nn.Module):
    """A network that predicts amplitudes of an exponential decay whose rate is a learned
    float64 parameter, over float64 sample times: a physical constant kept in double beside an
    fp32 network, as scientific programs keep one (torch.amp trains it as it is)."""

    def __init__(self, dim=6, modes=3, samples=5):
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor([0.5, 1.0 + 1e-12, 2.0], dtype=torch.float64))
        self.register_buffer("times", torch.linspace(0, 1, samples, dtype=torch.float64))
        self.amplitudes = torch.nn.Sequential(torch.nn.Linear(dim, 16), torch.nn.Tanh(),
                                              torch.nn.Linear(16, modes))

    def forward(self, x):
        decay = torch.exp(-self.rate[:, None] * self.times)  # (modes, samples)
        return (self.amplitudes(x).double()[:, :, None] * decay).sum(1)


class SwAV(torch.nn.Module):
    """SwAV's backbone, normalized embedding and prototypes (facebookresearch/swav): its codes
    come from a Sinkhorn-Knopp of the detached prototype scores under torch.no_grad
    (``swav_codes``), which takes ``exp(scores / 0.05)``."""

    def __init__(self, dim=16, prototypes=30):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.BatchNorm1d(64),
                                            torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.prototypes = torch.nn.Linear(32, prototypes, bias=False)

    def forward(self, x):
        return self.prototypes(F.normalize(self.backbone(x), dim=1, p=2))


@torch.no_grad()
def swav_codes(scores, epsilon=0.05, iterations=3):
    """SwAV's ``distributed_sinkhorn`` on one process, in place as the original."""
    q = torch.exp(scores / epsilon).t()
    prototypes, batch = q.shape
    q /= torch.sum(q)
    for _ in range(iterations):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= prototypes
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= batch
    q *= batch
    return q.t()


def swav_loss(model, views, temperature=0.1):
    """Two views: each view's codes are the targets of the other's prototype scores, after the
    prototypes are normalized in place under no_grad (as SwAV's training loop does)."""
    with torch.no_grad():
        w = model.prototypes.weight.data.clone()
        model.prototypes.weight.copy_(F.normalize(w, dim=1, p=2))
    scores = model(views.flatten(0, 1)).unflatten(0, views.shape[:2])
    loss = 0
    for view in (0, 1):
        codes = swav_codes(scores[view].detach())
        log_p = F.log_softmax(scores[1 - view] / temperature, dim=1)
        loss = loss - torch.mean(torch.sum(codes * log_p, dim=1))
    return loss / 2
