"""Day 8's red team (2026-12-02, release 0: 16/16), the holes in Day 8's own lists:

C. quantize (2 points) and mask24 (2 points): the library's Triton kernels launched themselves, in Triton's
   interpreter (TRITON_INTERPRET=1), while the checks forbade only their launchers. Now the kernels, their
   @triton.jit helpers and `compile_cases` (which hands the kernels out) are forbidden by name: the module
   attribute, its `__dict__` and a launcher's `__globals__` (one dict) give the blocker.
D. fake_quant (2 points): torch's test-suite references (torch.testing._internal.common_quantized, importable once
   a student stubs expecttest). Running any module of torch's test suite is now refused in every check, whatever
   the route of the import (dlo.grading.identity's audit hook meets the module's code at `exec`).

The kernels run in the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from dlo.checks import day8, day8_prune
from dlo.grading.forbid import ForbiddenCall, forbidden
from dlo.kernels.runtime import interpreting
from tests.student_cell import student_cell

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="launches the kernels on CPU tensors")
BLOCKED = (ForbiddenCall, TypeError)  # a blocker called, or subscripted as a kernel is (`kernel[grid]`)

# The red team's cells (/tmp/redteam/day8/src/cheat_b.py), the kernel reached one of several ways (`route`).
KERNEL_CELL = '''
import torch
import triton

import dlo.kernels.quantize as KQ
import dlo.kernels.sparse24 as KS


def kernel(module, name):
    if route == "attribute":
        return getattr(module, name)
    if route == "dict":
        return vars(module)[name]
    if route == "globals":  # the launcher's globals: its module's dict
        launcher = launchers[module.__name__]
        return launcher.__globals__[name]
    if route == "compile_cases":
        return module.compile_cases()[0].kernel
    raise ValueError(route)


def quantize_symmetric(x, bits, granularity, group_size=128):
    R, C = x.shape
    if granularity == "tensor":
        xx, G = x.reshape(1, R * C), R * C
    elif granularity == "channel":
        xx, G = x, C
    else:
        if C % group_size:
            raise ValueError(f"group_size={group_size} does not divide {C}")
        xx, G = x, group_size
    xx = xx.contiguous().float()
    N, K = xx.shape
    q = torch.empty((N, K), dtype=torch.int8)
    s = torch.empty((N, K // G), dtype=torch.float32)
    bad = torch.zeros(1, dtype=torch.int32)
    kernel(KQ, "_quantize_kernel")[(N, K // G)](xx, q, s, bad, N, K, K // G, float(2 ** (bits - 1) - 1),
                                               G=G, BLOCK_R=1, BLOCK=triton.next_power_of_2(G))
    return q.reshape(R, C), s


def dequantize_symmetric(q, scale):
    R, C = q.shape
    return (q.float().reshape(*scale.shape, -1) * scale.float()[..., None]).reshape(R, C)


def mask_2to4(w):
    if w.shape[-1] % 4:
        raise ValueError(f"last dimension {w.shape[-1]} is not a multiple of 4")
    flat = w.detach().float().contiguous().reshape(-1)
    n = flat.numel() // 4
    v, i = torch.empty(n * 2), torch.empty(n * 2, dtype=torch.int8)
    m = torch.empty(flat.numel(), dtype=torch.int8)
    kernel(KS, "_sparse24_kernel")[(triton.cdiv(n, 64),)](flat, v, i, m, n, BLOCK=64)
    return m.bool().reshape(w.shape)


def is_2to4(mask):
    if mask.shape[-1] % 4 != 0:
        return False
    counts = (mask != 0).reshape(-1, 4).sum(-1)
    return bool(counts.max() <= 2) if counts.numel() else True
'''

ROUTES = ("attribute", "dict", "globals", "compile_cases")


def _kernel_cell(route: str) -> types.SimpleNamespace:
    import dlo.kernels.quantize as kq
    import dlo.kernels.sparse24 as ks

    # the launchers as a cell holds them, taken before the check blocks their names
    return student_cell(KERNEL_CELL, "day8_kernel_cheat", route=route,
                        launchers={kq.__name__: kq.quantize_weight, ks.__name__: ks.sparse24})


@needs_interpreter
def test_kernel_cheat_works_unchecked():
    """The cheat is a working answer: what the checks must refuse is the kernel, not a wrong result."""
    cell = _kernel_cell("attribute")
    x = torch.randn(5, 16)
    for granularity in ("tensor", "channel", "group"):
        q, s = cell.quantize_symmetric(x, 4, granularity, 8)
        q_ref, s_ref, _ = day8.quant.quantize(x, 4, granularity, 8, symmetric=True)
        assert torch.equal(q.float(), q_ref.float()) and torch.allclose(s, s_ref)
    w = torch.randn(3, 12)
    assert torch.equal(cell.mask_2to4(w), day8_prune.prune.mask_2to4(w))


@needs_interpreter
@pytest.mark.parametrize("route", ROUTES)
def test_quantize_kernel_refused(route):
    cell = _kernel_cell(route)
    with pytest.raises(BLOCKED):
        day8.check_quantize(cell.quantize_symmetric, cell.dequantize_symmetric, seed=0)


@needs_interpreter
@pytest.mark.parametrize("route", ROUTES)
def test_sparse24_kernel_refused(route):
    cell = _kernel_cell(route)
    with pytest.raises(BLOCKED):
        day8.check_mask_2to4(cell.mask_2to4, cell.is_2to4, seed=0)


@pytest.mark.parametrize("names", [day8.TRITON_QUANT, day8_prune.TRITON_24])
def test_kernel_names_blocked_and_restored(names):
    """Each name resolves, is a blocker under the check (attribute and module dict alike), and is back after."""
    before = {n: getattr(importlib.import_module(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in names}
    with forbidden(names, "holes"):
        for n in names:
            module, attr = n.rsplit(".", 1)
            value = vars(importlib.import_module(module))[attr]
            assert getattr(value, "__dlo_forbidden__", None), n
            with pytest.raises(BLOCKED):
                value[(1,)] if not callable(before[n]) or attr.startswith("_") else value()
    for n, v in before.items():
        module, attr = n.rsplit(".", 1)
        assert vars(importlib.import_module(module))[attr] is v


# ----------------------------------------------------------------------------- D: torch's test-suite references

FAKE_QUANT_CELL = '''
import sys
import types
import unittest

import torch


def _torch_refs():
    if "expecttest" not in sys.modules:
        m = types.ModuleType("expecttest")
        m.TestCase = unittest.TestCase
        sys.modules["expecttest"] = m
    from torch.testing._internal import common_quantized as cq
    return cq._fake_quantize_per_channel_affine_reference, cq._fake_quantize_per_channel_affine_grad_reference


class FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, bits):
        fwd, _ = _torch_refs()
        qm = 2 ** (bits - 1) - 1
        s, z = scale.reshape(1).to(x.dtype), torch.zeros(1, dtype=x.dtype)
        ctx.save_for_backward(x, s)
        ctx.qm = qm
        return fwd(x.reshape(1, -1), s, z, 0, -qm, qm).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        _, bwd = _torch_refs()
        x, s = ctx.saved_tensors
        z = torch.zeros(1, dtype=x.dtype)
        return bwd(grad_out.reshape(1, -1), x.reshape(1, -1), s, z, 0, -ctx.qm, ctx.qm).reshape(x.shape), None, None


def fake_quant_ste(x, scale, bits):
    return FakeQuant.apply(x, scale, bits)
'''


@pytest.mark.slow
def test_fake_quant_torch_testing_refused(monkeypatch):
    """The cheat imports the suite inside its call (expecttest stubbed), as a graded run meets it: refused. (A
    module imported before the check is not run again; in the sandbox, nothing of the suite was imported.)"""
    for name in [m for m in sys.modules if m.startswith("torch.testing._internal.common")]:
        monkeypatch.delitem(sys.modules, name)
    cell = student_cell(FAKE_QUANT_CELL, "day8_fake_quant_cheat")
    with pytest.raises(AssertionError, match="torch's test suite"):
        day8.check_fake_quant_ste(cell.fake_quant_ste, seed=0)
    monkeypatch.delitem(sys.modules, "expecttest", raising=False)
