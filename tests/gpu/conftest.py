"""Tests that need a CUDA device and compiled Triton kernels: `make test-gpu` runs them (MORPHLING_GPU_TESTS=1
keeps tests/conftest.py from switching Triton to its interpreter); everywhere else they are skipped."""

import os

import pytest
import torch

HERE = os.path.dirname(__file__)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "Triton runs interpreted in this session: run the GPU tests with `make test-gpu`"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)
