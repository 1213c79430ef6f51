"""What the check tests share: a pool of ranks per test module (tests.rank_pool) and the solutions
notebook's exercise cells, loaded the way a student's kernel holds them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from dlo.grading.jail import make_spec
from dlo.grading.trusted import LocalSandbox
from tests.rank_pool import RankPool, one_thread  # noqa: F401 - a fixture, re-exported to the test modules

REPO = Path(__file__).resolve().parents[2]


def load_solution(day: str) -> SimpleNamespace:
    """The notebook's imports and solution cells, run in a namespace of their own (an unimportable
    module name, so that cloudpickle ships the classes to the ranks by value, as from a notebook)."""
    nb = nbformat.read(REPO / "solutions" / day / f"{day}.ipynb", as_version=4)
    ns = {"__name__": f"{day.split('_')[0]}_solution"}
    code = [c for c in nb.cells if c.cell_type == "code"]
    exec(compile(code[0].source, "imports", "exec"), ns)
    for c in code:
        if c.metadata.get("nbgrader", {}).get("solution"):
            exec(compile(c.source, c.metadata["nbgrader"]["grade_id"], "exec"), ns)
    return SimpleNamespace(**ns)


@pytest.fixture(scope="module")
def pool():
    """Ranks kept alive for the module's checks."""
    with RankPool() as p:
        yield p


@pytest.fixture
def ranks(pool):
    """This test's checks run their ranks in the module's pool."""
    with pool.serving():
        yield


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The grader's backend for the module's checks: a sandboxed runner (bwrap where available)."""
    with LocalSandbox(tmp_path_factory.mktemp("sandbox")) as sb:
        yield sb


@pytest.fixture(scope="module")
def jail(tmp_path_factory):
    """The grader's sandbox as `dlo grade` makes it: bwrap, and uid 65534 when the tests run as root."""
    spec = make_spec("bwrap", tmp_path_factory.mktemp("jail") / "work", hidden=[])
    spec.make_dirs()
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sb:
        yield sb
