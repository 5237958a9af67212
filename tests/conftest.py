"""Shared pytest configuration for the dsv4_nvfp4 test suite.

* registers the ``gpu`` marker (tests that need a CUDA device);
* skips ``gpu`` tests automatically when ``torch.cuda.is_available()`` is False;
* provides a ``cuda_device`` fixture for GPU tests that want the device explicitly;
* makes the package importable when pytest is started from anywhere.
"""
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# pytest-xdist on a host of several GPUs (tests/gpu_suite.py): worker gwN gets GPU N mod DSV4_TEST_GPUS, set before
# anything initializes CUDA
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and os.environ.get("DSV4_TEST_GPUS", "1") != "1":
    _gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_gpus)]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: test needs a CUDA GPU (skipped when torch.cuda.is_available() is False)"
    )
    config.addinivalue_line("markers", "slow: slow test")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda_device():
    """The CUDA device for gpu tests; skips the test when there is none."""
    if not _cuda_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    import torch

    return torch.device("cuda")
