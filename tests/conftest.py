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


def _language_namespaces():
    """The namespaces Triton's interpreter patches (runtime/interpreter.py, `_patch_lang`)."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


# Triton 3.7's interpreter patches triton.language for a kernel and restores it afterwards, but a @triton.jit
# helper called inside an interpreted kernel patches it again and never restores it (InterpretedFunction's
# device call: `_patch_lang(self.fn)` with its scope dropped). A test that compiles for a GPU after Day 2's
# FlashAttention or the paged-attention kernel ran in the interpreter then failed ("'ir.value' object has no
# attribute 'dtype'", test_doctor's in-suite failure, order-dependent). So triton.language is snapshotted
# before any kernel runs and put back after every test.
_LANGUAGE = [(ns, dict(vars(ns))) for ns in _language_namespaces()]


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """`dlo.setup` sets torch's threads (one on the tiny CPU profile, `dlo.cpus`): a test calling it left the
    worker on one thread, and a later sandboxed check compared float64 gradients computed here with those of a
    runner on the default count, exactly (Day 3's checkpoint_function: 2.8e-17 apart). Put back after each test."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _triton_language_restored():
    yield
    for ns, saved in _LANGUAGE:
        for name, value in saved.items():
            if vars(ns).get(name) is not value:
                setattr(ns, name, value)


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
