"""Three holes a Day 8 red team found (2026-12-02), closed in the grading runtime for every check: references run
as TorchScript (`forbid.SERIALISED_CODE`), a library kernel launched in Triton's interpreter
(`identity.kernel_function`), and the other way, an honest `is_2to4` taken for a copy of the reference
(`bytecode.SUBSTANTIAL`, attribute names in `bytecode.shape`)."""

from __future__ import annotations

import inspect
import io

import pytest
import torch

import dlo.prune
import dlo.quant
from dlo.checks import day8, day8_prune
from dlo.grading import bytecode, identity
from dlo.grading.forbid import SERIALISED_CODE, ForbiddenCall, forbidden, plan
from tests.student_cell import student_cell


def _scripted(fn) -> bytes:
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(fn), buf)
    return buf.getvalue()


LAUNDERED = """
def calibrate_range(batches, method="minmax", percentile=99.9):
    import io, torch
    f = torch.jit.load(io.BytesIO(SCRIPTED))
    v = torch.cat([b.flatten() for b in batches]).double()
    lo, hi = f(v, [0.0, 1.0] if method == "minmax" else [1 - percentile / 100, percentile / 100])
    return float(lo), float(hi)
"""


def test_a_reference_scripted_where_no_check_ran_is_refused_at_call_time():
    """Scripted and saved where no check ran (a notebook cell), loaded in the student's function: TorchScript runs
    no Python code object, so only blocking the loaders holds. Without them this passed the check."""
    student = student_cell(LAUNDERED, "scripted_student", SCRIPTED=_scripted(dlo.quant.quantiles))
    with pytest.raises(AssertionError, match="torch.jit.load is off limits"):
        day8.check_calibrate_range(student.calibrate_range)


@pytest.mark.parametrize("path", SERIALISED_CODE)
def test_every_check_blocks_the_serialised_code_loaders(path):
    found = plan(("dlo.quant.quantiles",), "any")
    assert path in found.names
    owner, attr = path.rsplit(".", 1)
    with forbidden(("dlo.quant.quantiles",), "any"):
        held = getattr(eval(owner, {"torch": torch}), attr)  # noqa: S307 - a dotted name of torch's
        with pytest.raises(ForbiddenCall):
            held()
    assert not getattr(getattr(eval(owner, {"torch": torch}), attr), "__dlo_forbidden__", None)  # noqa: S307


def test_a_forbidden_triton_kernel_is_implemented_by_its_function():
    """Triton's interpreter runs the kernel's Python function: forbidding the kernel burns it."""
    from dlo.kernels import quantize

    kernel = quantize._quantize_kernel
    assert identity.kernel_function(kernel) is kernel.fn
    assert identity.implementations(kernel) == [kernel.fn]
    assert identity.kernel_function(quantize.quantize_weight) is None
    with forbidden(("dlo.kernels.quantize._quantize_kernel",), "quantize"):
        with pytest.raises(ForbiddenCall):
            kernel.fn()  # what InterpretedFunction(kernel.fn) would run


HONEST = """
def is_2to4(mask):
    if mask.shape[-1] % 4:
        return False
    return bool(((mask != 0).reshape(-1, 4).sum(1) <= 2).all())
"""


def test_an_honest_is_2to4_as_short_as_the_reference_is_no_copy():
    """A red team's own is_2to4 is the reference's idiom instruction for instruction (31): refused as a copy before
    SUBSTANTIAL rose to 32."""
    student = student_cell(HONEST, "honest_2to4")
    ref = inspect.unwrap(dlo.prune.is_2to4)
    assert bytecode.shape(student.is_2to4.__code__) == bytecode.shape(ref.__code__)  # the same code...
    assert bytecode.instructions(ref.__code__) < bytecode.SUBSTANTIAL  # ...too short to tell a copy
    found = plan(day8_prune.check_mask_2to4.forbid, "mask_2to4")
    assert identity.copy_in(student.is_2to4, found.codes, found.originals) is None
    with forbidden(day8_prune.check_mask_2to4.forbid, "mask_2to4"):
        assert student.is_2to4(torch.tensor([[1, 1, 0, 0]])) is True


def test_the_same_instructions_through_other_methods_are_another_shape():
    a = student_cell("def f(x):\n    return x.reshape(-1, 4).sum(1).all()\n", "shape_a").f
    b = student_cell("def f(y):\n    return y.view(-1, 2).amax(0).any()\n", "shape_b").f
    c = student_cell("def g(z):\n    return z.reshape(-1, 4).sum(1).all()\n", "shape_c").g
    assert bytecode.shape(a.__code__) != bytecode.shape(b.__code__)
    assert bytecode.shape(a.__code__) == bytecode.shape(c.__code__)  # renamed, other constants' values: the same


def test_what_torch_imports_from_its_test_suite_at_run_time_is_let_through():
    """torch.distributed.tensor.debug imports composite_compliance: refused, it failed a Day 7 test's import of
    CommDebugMode in a check (a clean clone's make test, 2026-12-02). The modules run again under other names, so
    that nothing imported changes; common_quantized, which holds references, stays refused."""
    import importlib.util

    def run(module: str) -> None:
        again = importlib.util.spec_from_file_location(f"again_{module}", importlib.util.find_spec(module).origin)
        again.loader.exec_module(importlib.util.module_from_spec(again))

    with forbidden(("dlo.quant.quantiles",), "any"):
        run("torch.testing._internal.composite_compliance")
        run("torch.testing._internal.distributed.fake_pg")
        with pytest.raises(ForbiddenCall, match="torch's test suite"):
            run("torch.testing._internal.common_quantized")
