"""Answers only on the grading side (issue 26): where student code runs under a check, the grader's
own modules (`dlo.checks.*`: references, test benches) are sealed and the private machinery of a
forbidden reference is blocked with it.

Each leak is a student function that reached the grader through a door that was open: the checks'
modules by name (`dlo.checks.day5.memory_per_rank`, `dlo.checks.day6_schedules.gpipe_schedule`),
through `importlib` or `sys.modules`, the test bench on a rank, `zero._Sharded` (the engines' private
base) and `tensor_parallel._VocabParallelCrossEntropy.apply`. In the notebook's direct checks, on the
tests' ranks and in the grader's sandboxed runner (whose ranks are a real launch) each now fails with
a message naming what is off limits.
"""

from __future__ import annotations

import importlib
import sys

import pytest

import dlo.checks
from dlo.checks import day5, day6, day7
from dlo.grading.forbid import ForbiddenCall
from dlo.grading.seal import Placeholder, sealed

pytestmark = pytest.mark.usefixtures("one_thread")

# The student's code, as a notebook defines it: a module name nothing can import, so that every object
# travels by value (to the ranks, to the sandboxed runner) as a notebook's does.
STUDENT = '''
import importlib, sys
import torch
import dlo
import dlo.checks.day5
from dlo.distributed import tensor_parallel, zero

def acc_by_name(*args, **kwargs):
    return dlo.checks.day5.memory_per_rank(*args, **kwargs)

def acc_by_importlib(*args, **kwargs):
    return importlib.import_module("dlo.checks.day5").memory_per_rank(*args, **kwargs)

def acc_by_sys_modules(*args, **kwargs):
    return sys.modules["dlo.checks.day5"].memory_per_rank(*args, **kwargs)

def acc_by_dunder_import(*args, **kwargs):
    return __import__("dlo.checks.day5_zero", fromlist=["memory_per_rank"]).memory_per_rank(*args, **kwargs)

def gpipe_by_bench(p, m):
    import dlo.checks.day6_schedules as bench
    return [[(a.kind, a.mb) for a in rank] for rank in bench.gpipe_schedule(p, m)]

def one_f_one_b_by_bench(p, m):
    import dlo.checks.day6_schedules as bench
    return [[(a.kind, a.mb) for a in rank] for rank in bench.one_f_one_b_schedule(p, m)]

def bubble(p, m):
    return (p - 1) / (m + p - 1)

class BenchZeRO1(zero.ZeRO1.__mro__[1]):
    """A ZeRO-1 on the library's private base (its hooks, its reduce-scatter), the rest copied."""
    def __init__(self, module, optimizer_cls=torch.optim.AdamW, **kw):
        super().__init__(module)
        self.inner = None

class RecomputedZeRO1(torch.nn.Module):
    """Recomputes the expected parameters on the rank with the check's own test bench."""
    def __init__(self, module, optimizer_cls=torch.optim.AdamW, **kw):
        super().__init__()
        import dlo.checks.day5_zero as bench
        self.expected = bench.reference(bench.case(0), 0, "sgd", 1, 2)

def ce_private(logits, target, group=None):
    return tensor_parallel._VocabParallelCrossEntropy.apply(logits, target, group).mean()
'''


@pytest.fixture(scope="module")
def student():
    ns = {"__name__": "sealed_student"}
    exec(compile(STUDENT, "student cell", "exec"), ns)
    return type("Student", (), ns)


def test_sealed_gives_placeholders_through_every_door():
    from dlo.checks import day5_zero

    with sealed():
        for get in (lambda: importlib.import_module("dlo.checks.day5"), lambda: sys.modules["dlo.checks.day5"],
                    lambda: __import__("dlo.checks.day5", fromlist=["x"]), lambda: dlo.checks.day5,
                    lambda: importlib.reload(sys.modules["dlo.checks.day5"]),
                    lambda: importlib.import_module("dlo.checks.day8")):
            assert isinstance(get(), Placeholder)
        with pytest.raises(AttributeError, match="dlo.checks.day5.memory_per_rank is the grader's"):
            dlo.checks.day5.memory_per_rank  # noqa: B018
        with pytest.raises(ImportError, match="the grader's module: off limits"):
            from dlo.checks.day5_zero import reference  # noqa: F401
        assert not hasattr(sys.modules["dlo.checks.day5_zero"], "reference")
        wire = importlib.import_module("dlo.grading.wire")  # what the kernel and the runner run on stays open
        assert dlo.grading.wire is wire and not isinstance(wire, Placeholder)
        assert hasattr(dlo.grading.forbid, "forbidden")
        for trusted in ("trusted", "remote", "testcells", "jail", "jail_kernel", "files"):  # the grader's side
            trusted = f"dlo.grading.{trusted}"
            assert isinstance(importlib.import_module(trusted), Placeholder), trusted
    assert sys.modules["dlo.checks.day5_zero"] is day5_zero and dlo.checks.day5 is day5  # restored


@pytest.mark.parametrize("fn", ["acc_by_name", "acc_by_importlib", "acc_by_sys_modules", "acc_by_dunder_import"])
def test_the_checks_modules_are_sealed_in_a_direct_check(student, fn):
    with pytest.raises(AttributeError, match=r"dlo\.checks\.day5(_zero)?\.memory_per_rank is the grader's"):
        day5.check_memory_accountant(getattr(student, fn), trials=2)


def test_the_schedules_bench_is_sealed(student):
    with pytest.raises(AttributeError, match=r"dlo\.checks\.day6_schedules\.gpipe_schedule is the grader's"):
        day6.check_schedules(student.gpipe_by_bench, student.one_f_one_b_by_bench, student.bubble)


@pytest.mark.parametrize("fn", ["acc_by_name", "acc_by_dunder_import"])
def test_the_checks_modules_are_sealed_in_the_sandbox(student, sandbox, fn):
    with pytest.raises(AttributeError, match=r"dlo\.checks\.day5(_zero)?\.memory_per_rank is the grader's"):
        sandbox.run(day5.check_memory_accountant, getattr(student, fn), trials=2)


# ----------------------------------------------------------------------------- on ranks (a failure ends the pool)

def test_the_engines_private_base_is_off_limits_on_a_rank(student, ranks):
    with pytest.raises(AssertionError, match=r"dlo\.distributed\.zero\._Sharded(\.__init__)? is off limits"):
        day5.check_zero1(student.BenchZeRO1)


def test_the_test_bench_is_sealed_on_a_rank(student, ranks):
    with pytest.raises(AssertionError, match=r"dlo\.checks\.day5_zero\.reference is the grader's"):
        day5.check_zero1(student.RecomputedZeRO1)


def test_the_private_autograd_function_is_off_limits_on_a_rank(student, ranks):
    with pytest.raises(AssertionError, match=r"_VocabParallelCrossEntropy(\.forward)? is off limits"):
        day7.check_vocab_parallel_cross_entropy(student.ce_private)


def test_the_engines_private_base_is_off_limits_on_the_sandbox_s_ranks(student, sandbox):
    """The grader's own path: the runner's child launches the ranks; each seals before it unpickles."""
    with pytest.raises(AssertionError, match=r"dlo\.checks\.day5_zero\.reference is the grader's"):
        sandbox.run(day5.check_zero1, student.RecomputedZeRO1)
    with pytest.raises((AssertionError, ForbiddenCall), match=r"zero\._Sharded.* is off limits"):
        sandbox.run(day5.check_zero1, student.BenchZeRO1)
