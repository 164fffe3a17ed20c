"""Small shared helpers for the optamp Python tests."""
import pytest
import torch

import optamp


@pytest.fixture
def fresh():
    """optamp reset before and after the test."""
    optamp.reset()
    yield
    optamp.reset()


class TinyNet(torch.nn.Module):
    """conv -> batch-norm -> relu -> linear: exercises lower ops, batch-norm and a loss."""

    def __init__(self, bn=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(2) if bn else torch.nn.Identity()
        self.fc = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class Mlp(torch.nn.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def init(model, optimizer=None, opt_level="O1", **kw):
    kw.setdefault("verbosity", 0)
    return optamp.initialize(model, optimizer, opt_level=opt_level, **kw)
