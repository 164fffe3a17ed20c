import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="no CUDA device visible")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "needs_cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
