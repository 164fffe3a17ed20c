"""pytest hooks and fixtures for tests/python: the slow and needs_cuda markers, a fixed seed for
every test, and ``fresh`` (optamp reset around a test). Shared helpers that are not fixtures live
in common_utils.py, the casting cases in op_cases.py (both imported by name: pytest puts this
directory on sys.path)."""
import pytest
import torch

import optamp


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


@pytest.fixture
def fresh():
    """optamp reset before and after the test."""
    optamp.reset()
    yield
    optamp.reset()


@pytest.fixture
def cpu_buckets():
    """Gradients of CPU parameters' batched copies converted a bucket at a time, as a GPU's are
    (off on the CPU by default: no launch to save there)."""
    previous = optamp._C._set_gradient_buckets_on_cpu(True)
    yield
    optamp._C._set_gradient_buckets_on_cpu(previous)
