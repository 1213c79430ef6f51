"""The similarity report's rule measured on independent work (issue 33): a class of independent
solutions (tests/harness/similarity_variants.py, five per exercise, plus the one of issue 26 where there
is one) has nothing flagged, and a copy planted in it - of a classmate, of the instructors' solution, of
the library's reference, each disguised as `similarity_snippets.disguised` does - is flagged, except
where the class's own solutions are as close as copies (`dtensor_plan`: the report says it cannot tell).
Issue 26's fixed rule (0.5 with a classmate or the solution) flagged 13 of these independent answers."""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import math
from pathlib import Path

import pytest

from dlo.harness import similarity as S
from tests.harness.similarity_snippets import HONEST, disguised
from tests.harness.similarity_variants import VARIANTS

REPO = Path(__file__).resolve().parents[2]
CANNOT_TELL = {("day7_tensor_parallel", "dtensor_plan")}  # median 0.76 with the solution: copies are no closer
LIBRARY = {("day1_optimizers", "adamw"): "dlo.optim.reference.adamw_step",
           ("day1_optimizers", "warmup_cosine"): "dlo.schedules.warmup_cosine",
           ("day1_optimizers", "clip_grad_norm"): "dlo.optim.utils.clip_grad_norm",
           ("day8_quantization_pruning", "gradual"): "dlo.prune.gradual_sparsity",
           ("day8_quantization_pruning", "distill"): "dlo.distill.distillation_loss",
           ("day7_tensor_parallel", "dtensor_plan"): "dlo.distributed.tensor_parallel.apply_megatron_tp"}


def _class(tmp: Path, day: str, cell: str, answers: dict[str, str]) -> dict:
    release = REPO / "course" / day / f"{day}.ipynb"
    out = {}
    for student, source in answers.items():
        nb = json.loads(release.read_text())
        for c in nb["cells"]:
            if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == cell:
                c["source"] = source
        path = tmp / "course" / "submitted" / student / day / f"{day}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(nb))
        out[(student, day)] = path
    return out


def _honest(day: str, cell: str) -> dict[str, str]:
    answers = {f"v{i}": v for i, v in enumerate(VARIANTS[(day, cell)])}
    if (day, cell) in HONEST:
        answers["h"] = HONEST[(day, cell)]
    return answers


def _source(name: str) -> str:
    module, attr = name.rsplit(".", 1)
    return inspect.getsource(inspect.unwrap(getattr(importlib.import_module(module), attr)))


@pytest.mark.parametrize("day,cell", sorted(VARIANTS))
def test_independent_solutions_are_not_flagged_and_planted_copies_are(day, cell, tmp_path):
    rows, _, info = S.compare([day], REPO / "solutions", REPO / "course", _class(tmp_path / "a", day, cell,
                                                                                   _honest(day, cell)))
    assert not [r for r in rows if r["flagged"]], [r for r in rows if r["flagged"]]
    assert info[(day, cell)]["students"] >= S.MIN_CLASS  # the class's spread is what decides

    solution = S.cells_of(REPO / "solutions" / day / f"{day}.ipynb")[cell]
    planted = {**_honest(day, cell), "copier": disguised(VARIANTS[(day, cell)][0]), "solcopy": disguised(solution)}
    if (day, cell) in LIBRARY:
        planted["libcopy"] = disguised(_source(LIBRARY[(day, cell)]))
    rows, _, info = S.compare([day], REPO / "solutions", REPO / "course", _class(tmp_path / "b", day, cell, planted))
    flagged = {(r["student"], r["other"]) for r in rows if r["flagged"]}
    assert ("copier", "v0") in flagged
    if (day, cell) in CANNOT_TELL:
        assert info[(day, cell)]["cutoffs"]["solution"][0] > 1  # said on the page: it cannot tell
    else:
        assert ("solcopy", "solutions") in flagged
    if (day, cell) in LIBRARY:
        assert ("libcopy", LIBRARY[(day, cell)]) in flagged
    assert all(set(pair) & {"copier", "solcopy", "libcopy"} for pair in flagged), flagged  # no honest pair


def test_the_fixed_rule_of_issue_26_flagged_independent_work():
    """What the class's spread replaces: at 0.5 with a classmate or the solution, 13 of these independent
    answers (dtensor_plan: all five against the solution) were flagged."""
    from dlo.harness.winnowing import Code, share

    flagged = 0
    for (day, cell), _ in VARIANTS.items():
        boiler = frozenset(g for c in json.loads((REPO / "course" / day / f"{day}.ipynb").read_text())["cells"]
                           if c["cell_type"] == "code" for g in Code.of("".join(c["source"])).all_grams)
        solution = Code.of(S.cells_of(REPO / "solutions" / day / f"{day}.ipynb")[cell], boiler)
        codes = [Code.of(src, boiler) for src in _honest(day, cell).values()]
        similar = lambda a, b: max(share(a, b), share(b, a))  # noqa: E731
        flagged += sum(similar(c, solution) >= 0.5 for c in codes)
        flagged += sum(similar(a, b) >= 0.5 for a, b in itertools.combinations(codes, 2))
    assert flagged == 13


@pytest.mark.parametrize("day,cell,check", [
    ("day1_optimizers", "adamw", "dlo.checks.day1.check_adamw_step"),
    ("day1_optimizers", "warmup_cosine", "dlo.checks.day1.check_warmup_cosine"),
    ("day1_optimizers", "clip_grad_norm", "dlo.checks.day1.check_clip_grad_norm"),
    ("day8_quantization_pruning", "gradual", "dlo.checks.day8.check_gradual_sparsity"),
    ("day8_quantization_pruning", "distill", "dlo.checks.day8.check_distillation_loss"),
])
def test_the_independent_solutions_are_right(day, cell, check):
    """Honest and correct: each passes its exercise's check (Days 6 and 7's run on ranks, in
    tests/checks/test_independent_solutions.py)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    module, name = check.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    for source in VARIANTS[(day, cell)]:
        space = {"torch": torch, "F": F, "math": math, "itertools": itertools, "__name__": "__main__"}
        exec(compile(source, f"<{cell}>", "exec"), space)  # noqa: S102 - the test's own snippets
        fn(next(v for k, v in space.items() if callable(v) and getattr(v, "__module__", "") == "__main__"))
