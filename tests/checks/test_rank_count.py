"""ZeRO-2's memory counted outside the rank (issue 33): Day 5's meters live in the rank, the kernel's count does not.

The ZeRO-2 check measures what a rank keeps during backward with meters in the rank's own process, which count
tensors (`dlo.measure.held_bytes`, `live_bytes`). An engine that also keeps every full gradient, as bytes, passes
them: the notebook's check on the tests' reused ranks shows it below. Where the ranks are launched for the check
(a notebook's launch, the grader's sandbox) the launcher reads each rank's memory from /proc on a large case, the
course's ZeRO-2 first (`dlo.checks.day5_count`), and that count sees it. Honest work stays far under the allowance.
"""

from __future__ import annotations

import pytest

from dlo.checks.day5 import check_zero2
from dlo.grading.jail import make_spec, probe
from dlo.grading.trusted import LocalSandbox
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.trust
needs_bwrap = pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}")

# The student's cell, in a module nothing can import: its classes travel by value, as a notebook's do.
STUDENT = '''
def keeping_gradients_as_bytes(base):
    class KeepsGradients(base):
        """The instructors' ZeRO-2, and every full gradient kept as bytes from backward to the step: no tensor
        holds them, so no meter that counts tensors sees them."""

        kept = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for p in self.module.parameters():
                p.register_hook(lambda g: KeepsGradients.kept.append(bytearray(g.numpy().tobytes())) or g)

        def step(self):
            super().step()
            KeepsGradients.kept.clear()
    return KeepsGradients
'''


@pytest.fixture(scope="module")
def engines():
    ns = {"__name__": "rank_count_student"}
    exec(compile(STUDENT, "student cell", "exec"), ns)
    honest = load_solution("day5_fsdp").ZeRO2
    return honest, ns["keeping_gradients_as_bytes"](honest)


@pytest.fixture(scope="module")
def jail(tmp_path_factory):
    """The grader's sandbox as `dlo grade` makes it: bwrap, and uid 65534 when the tests run as root."""
    spec = make_spec("bwrap", tmp_path_factory.mktemp("jail") / "work", hidden=[])
    spec.make_dirs()
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log) as sb:
        yield sb


MATCH = r"rank \d's resident memory rose by \d+ MiB, as the kernel counts it outside your code"


def test_gradients_kept_as_bytes_pass_the_meters_in_the_rank(engines, ranks):
    """The hole: on ranks nobody reads from outside, the meters of the check see tensors only."""
    check_zero2(engines[1], seed=1)


def test_the_launcher_counts_the_gradients_kept_as_bytes(engines):
    with pytest.raises(AssertionError, match=MATCH):
        check_zero2(engines[1], seed=1)


def test_honest_zero2_passes_under_the_launcher_s_count(engines):
    check_zero2(engines[0], seed=1)


@needs_bwrap
def test_the_sandbox_counts_the_gradients_kept_as_bytes(engines, jail):
    """In the grader's sandbox the launcher (its session child) may not reset a rank's high water mark (the
    ranks are not dumpable): the count runs from the reference's peak, and the verdict is the same."""
    with pytest.raises(AssertionError, match=MATCH):
        jail.run(check_zero2, engines[1], seed=2)


@needs_bwrap
@pytest.mark.parametrize("seed", [0, 2])
def test_honest_zero2_passes_under_the_sandbox_s_count(engines, jail, seed):
    jail.run(check_zero2, engines[0], seed=seed)
