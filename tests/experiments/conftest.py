"""Fixtures of the experiment tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test of tiny models on one intra-op thread: on a shared 2-core machine the second
    thread only spin-waits (several times slower), and the numbers do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
