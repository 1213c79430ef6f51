"""The independent solutions of the similarity calibration (tests/harness/similarity_variants.py) that run
on ranks: five `one_f_one_b_step` (Day 6) and five `apply_tp_plan` (Day 7), written apart from the
instructors' solutions. Honest and correct, each must pass its exercise's check: a point lost here is a
false negative. Each runs in a namespace of the solution notebook (its imports, Day 6's `MicroBatches`),
as in a student's kernel."""

from __future__ import annotations

import itertools

import pytest

from dlo.checks import day6, day7
from tests.checks.conftest import load_solution
from tests.harness.similarity_variants import VARIANTS

CASES = [("day6_pipeline", "one_f_one_b", "one_f_one_b_step", day6.check_one_f_one_b_step),
         ("day7_tensor_parallel", "dtensor_plan", "apply_tp_plan", day7.check_dtensor_plan)]


def student(day: str, source: str, name: str):
    """The variant defined in a fresh copy of the solution's namespace (an unimportable module name, so
    that the function travels to the ranks by value)."""
    space = {**vars(load_solution(day)), "itertools": itertools}  # one variant uses it, as a student imports it
    exec(compile(source, f"<{name}>", "exec"), space)  # noqa: S102 - the test's own snippets
    return space[name]


@pytest.mark.parametrize("day,cell,name,check", CASES, ids=[c[1] for c in CASES])
@pytest.mark.parametrize("k", range(5))
def test_an_independent_solution_gets_full_marks(ranks, day, cell, name, check, k):
    check(student(day, VARIANTS[(day, cell)][k], name), seed=k % 2)
