"""`dlo.registry`: the one list of days, what each spec names, and no import cycle through its strings."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dlo.checks
from dlo.harness.days import list_days, notebook_path
from dlo.registry import DAYS, plan_day

REPO = Path(__file__).resolve().parents[1]


def test_the_registry_is_the_course():
    assert list(DAYS) == list_days(REPO) == list_days(REPO, "course")  # in order: day1 ... day8
    assert [d.number for d in DAYS.values()] == list(range(1, len(DAYS) + 1))
    assert dlo.checks.__all__ == [d.short for d in DAYS.values()]


@pytest.mark.parametrize("day", list(DAYS))
def test_a_spec_names_what_its_notebook_uses(day):
    spec = DAYS[day]
    assert set(spec.presets) == {"tiny", "full"} and all(type(p) is spec.preset_class for p in spec.presets.values())
    assert callable(spec.load(spec.planner)) and getattr(dlo.checks, spec.short) is spec.load(spec.checks)
    if spec.preflight:
        assert callable(spec.load(spec.preflight))
    source = notebook_path(REPO, day).read_text()
    experiments = spec.experiments.rpartition(".")
    assert f"from {experiments[0]} import {experiments[2]}" in source and spec.checks in source
    assert f'dlo.setup(\\"{day}\\"' in source


def _imports(module: str) -> set[str]:
    """The dlo modules `module` imports anywhere in its source (function bodies included)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("dlo")}


def test_no_cycle_through_the_registrys_strings():
    named = {t.partition(":")[0] for d in DAYS.values() for t in (d.experiments, d.planner, d.checks, d.preflight) if t}
    for module in named | {"dlo.plan"}:
        assert "dlo.registry" not in _imports(module), module
    assert not any(m.startswith("dlo.experiments") for m in _imports("dlo.plan"))
    assert not any(m.startswith("dlo.models.llama_hf") for m in _imports("dlo.models.llama"))


def test_an_unknown_day_is_one_line():
    with pytest.raises(ValueError, match=r"^no planner for 'day9'; days with one: day1_optimizers, "):
        plan_day("day9")
    with pytest.raises(ValueError, match=r"^day1_optimizers: dlo.experiments.nope cannot be loaded"):
        DAYS["day1_optimizers"].load("dlo.experiments.nope")


def test_every_check_a_notebook_calls_is_reachable_from_dlo_checks_alone():
    """The grader imports `dlo.checks` (each day's one checks module, from the registry) and runs the test
    cells with it: a cell calling `dlo.checks.<module>.<check>` of a module no day's checks module imports
    scores 0 under the grader while it passes in the notebook, where the imports cell imported it."""
    calls = sorted({m for day in DAYS
                    for m in re.findall(r"dlo\.checks\.(\w+)\.(check_\w+)", notebook_path(REPO, day).read_text())})
    assert calls
    probe = ("import dlo.checks, sys\n"
             f"missing = [f'{{m}}.{{f}}' for m, f in {calls!r} if not hasattr(getattr(dlo.checks, m, None), f)]\n"
             "print(missing); sys.exit(bool(missing))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, f"not reachable from `import dlo.checks`: {proc.stdout}{proc.stderr[-500:]}"
