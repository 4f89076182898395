"""Shared test set-up: GPU tests skip with a reason on machines without one."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when kernels are defined, so set it before any port is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()
NO_GPU_REASON = "needs an NVIDIA GPU: CuPy kernels and timing cannot run on this machine"

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
