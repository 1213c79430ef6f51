"""Suite-wide set-up.

Without a GPU the Triton kernels run in the CPU interpreter. TRITON_INTERPRET must be set before
any module decorates a kernel with triton.jit, and many test modules import dlo.optim (which
imports the kernels), so it is set here, before collection starts. On a CUDA machine the kernels
are compiled and the same tests run on the GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where the Triton kernels run here: the GPU, or the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                        else "cpu")


def pytest_collection_modifyitems(config, items):
    """Longest files first: whole-notebook grading (course), then files with slow tests, so that with
    pytest-xdist no long test starts last while the other workers sit idle. A file's tests stay
    together and in their order (module fixtures are set up once)."""
    def rank(item):
        return 0 if item.get_closest_marker("course") else 1 if item.get_closest_marker("slow") else 2

    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 2), rank(item))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (first[item.path], order[id(item)]))
