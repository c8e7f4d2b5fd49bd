"""The device the engine tests run their tiny models on: `TEST_DEVICE` (default `cpu`), so the same
exactness tests check a CUDA host with `TEST_DEVICE=cuda` (see `bench/cuda_check.sh`)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    name = os.environ.get("TEST_DEVICE", "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.fail("TEST_DEVICE=cuda, but torch sees no CUDA device")
    return torch.device(name)
