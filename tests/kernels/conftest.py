"""Kernel tests: on CPU the kernels run in the Triton interpreter (tests/conftest.py sets it)."""

import os

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                        else "cpu")
