"""Apex's DCGAN example (examples/dcgan/main_amp.py) with ``import optamp as amp`` in place of
``from apex import amp``: a reduced copy in this project's words (tiny sizes, synthetic images,
CPU), the training loop as Apex wrote it: two models and two optimizers in one initialize,
``num_losses=3``, two scaled losses before the discriminator's plain ``step()``, labels made with
``torch.full`` and matched to the output with ``type_as`` (torch's float-label change: the label
constants are floats). It must train at O0-O3 near the fp32 run, with the discriminator's output
(the loss's input) fp32 wherever the level casts the model (O2, O3), as Apex's patched
forward made it; at O1 it is what the ops left (fp16), in Apex too; O0 is fp32 throughout."""
import pytest
import torch
from torch import nn

import optamp as amp

NZ, NGF, NDF, NC, IMAGE, BATCH = 8, 4, 4, 1, 16, 6
REAL_LABEL, FAKE_LABEL = 1.0, 0.0


def weights_init(m):
    # DCGAN's init: conv weights N(0, 0.02), batch-norm scale N(1, 0.02), shift 0.
    name = type(m).__name__
    if "Conv" in name:
        m.weight.data.normal_(0.0, 0.02)
    elif "BatchNorm" in name:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(  # z (NZ x 1 x 1) -> 4x4 -> 8x8 -> 16x16 image
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(  # 16x16 -> 8x8 -> 4x4 -> one logit (no sigmoid: Apex's)
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False))

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def train(opt_level, iterations=3):
    """Apex's loop; returns the per-iteration (errD, errG), the models and the D output dtypes."""
    torch.manual_seed(0)
    images = torch.rand(iterations, BATCH, NC, IMAGE, IMAGE) * 2 - 1  # the "dataset"
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCEWithLogitsLoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    if opt_level == "O3":  # Apex's O3 caveat: Adam's eps must be representable in fp16
        for opt in (optimizerD, optimizerG):
            opt.param_groups[0]["eps"] = 1e-4
    [netD, netG], [optimizerD, optimizerG] = amp.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=opt_level, num_losses=3, verbosity=0)
    losses, output_dtypes = [], set()
    for real in images:
        netD.zero_grad()
        label = torch.full((BATCH,), REAL_LABEL)
        output = netD(real)
        output_dtypes.add(output.dtype)
        errD_real = criterion(output, label.type_as(output))
        with amp.scale_loss(errD_real, optimizerD, loss_id=0) as scaled:
            scaled.backward()
        noise = torch.randn(BATCH, NZ, 1, 1)
        fake = netG(noise)
        label.fill_(FAKE_LABEL)
        output = netD(fake.detach())
        errD_fake = criterion(output, label.type_as(output))
        with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as scaled:
            scaled.backward()
        errD = errD_real + errD_fake
        optimizerD.step()

        netG.zero_grad()
        label.fill_(REAL_LABEL)
        output = netD(fake)
        errG = criterion(output, label.type_as(output))
        with amp.scale_loss(errG, optimizerG, loss_id=2) as scaled:
            scaled.backward()
        optimizerG.step()
        losses.append((errD.item(), errG.item()))
    return losses, (netG, netD), output_dtypes


@pytest.fixture(scope="module")
def fp32_run():
    amp.reset()
    try:
        return train("O0")
    finally:
        amp.reset()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_dcgan_trains_with_only_the_import_changed(fresh, fp32_run, opt_level):
    losses, (netG, netD), output_dtypes = train(opt_level)
    assert output_dtypes == {torch.float16 if opt_level == "O1" else torch.float32}
    reference, (refG, refD), _ = fp32_run
    for (d, g), (ref_d, ref_g) in zip(losses, reference):
        assert torch.isfinite(torch.tensor([d, g])).all()
        # A few steps of a GAN in fp16 stay near the fp32 run (the discriminator's first loss
        # is log(2)-ish either way; a level that broke the loop would be far off or non-finite).
        torch.testing.assert_close(torch.tensor([d, g]), torch.tensor([ref_d, ref_g]),
                                   rtol=0.05, atol=0.02)
    param_dtype = torch.float16 if opt_level == "O3" else torch.float32
    for model, ref in ((netG, refG), (netD, refD)):
        for p, r in zip(model.parameters(), ref.parameters()):
            assert p.dtype == param_dtype
            assert torch.isfinite(p).all()
    if opt_level == "O3":
        # O3 steps Adam in fp16: its second moment (0.001 * g^2) underflows for a GAN's small
        # gradients, so its steps are lr * m / eps rather than lr * sign(g), and the weights part
        # from the fp32 run (in Apex too: O3 is the speed baseline). The losses above still match.
        return
    # The other levels moved the weights the way fp32 did, to fp16's precision.
    for model, ref in ((netG, refG), (netD, refD)):
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0.05, atol=2e-3)
