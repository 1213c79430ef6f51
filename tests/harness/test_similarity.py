"""The similarity report (issue 26) on made-up submissions of the toy course: a renamed copy scores
about 1, independent code low, the untouched release never, and the library's reference is found."""

from __future__ import annotations

import csv
import inspect
import re
from pathlib import Path

from dlo.harness import similarity as S
from dlo.harness.winnowing import Code, normalized_tokens, share
from tests.harness.conftest import ADAMW, DAY, edit_cells, grade_id
from tests.harness.similarity_snippets import COPIES, HONEST, disguised, padded

REPO = Path(__file__).resolve().parents[2]

ADAMW_OWN = ADAMW.replace("    ### BEGIN SOLUTION\n", "").replace("\n    ### END SOLUTION", "")
RENAMES = {"param": "w", "grad": "g", "exp_avg_sq": "second", "exp_avg": "first", "step": "t", "lr": "eta",
           "beta1": "b_one", "beta2": "b_two", "eps": "tiny", "weight_decay": "decay"}
# The same AdamW step written another way: moments out of place, bias-corrected estimates, one update.
INDEPENDENT = '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=1e-2):
    new_first = beta1 * exp_avg + (1.0 - beta1) * grad
    new_second = beta2 * exp_avg_sq + (1.0 - beta2) * grad ** 2
    first_hat = new_first / (1.0 - beta1 ** step)
    second_hat = new_second / (1.0 - beta2 ** step)
    update = first_hat / (second_hat ** 0.5 + eps)
    with torch.no_grad():
        exp_avg.copy_(new_first)
        exp_avg_sq.copy_(new_second)
        param.copy_(param * (1.0 - lr * weight_decay) - lr * update)
'''


NORM = """def norm(x, y):
    squares = [value * value for value in (x, y)]
    total = sum(squares)
    return math.sqrt(total)
"""


def rename(source: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        source = re.sub(rf"\b{old}\b", new, source)
    return source


def library_copy() -> str:
    """dlo.optim.reference.adamw_step's body under the exercise's signature, every name changed."""
    from dlo.optim.reference import adamw_step

    lines = inspect.getsource(adamw_step).splitlines()
    body = lines[next(i for i, line in enumerate(lines) if "_check_same_shape" in line):]
    return rename(ADAMW.split("    ### BEGIN SOLUTION")[0] + "\n".join(body), RENAMES)


def _students(toy_root: Path, submitted: Path, answers: dict[str, str | None]) -> dict:
    release = toy_root / "course" / DAY / f"{DAY}.ipynb"
    paths = {}
    for student, code in answers.items():
        def edit(cell, code=code, student=student):
            if code is not None and grade_id(cell) == "adamw":
                cell["source"] = code
            if grade_id(cell) == "add" and code is not None:
                cell["source"] = "def add(a, b):\n    return a + b"  # one line: the same in every answer
            if grade_id(cell) == "norm" and student == "eve":
                cell["source"] = NORM
        paths[(student, DAY)] = edit_cells(release, submitted / student / DAY / f"{DAY}.ipynb", edit)
    return paths


def test_renamed_copies_score_high_independent_code_low_stubs_never(toy_template, tmp_path):
    copied = rename(ADAMW_OWN, RENAMES).replace("    w.mul_", "    # <script>alert('x')</script> mine!\n    w.mul_")
    answers = {"ann": ADAMW_OWN, "dan": copied, "eve": INDEPENDENT, "lib": library_copy(),
               "bob": None, "fay": None}  # bob and fay: the untouched release
    submissions = _students(toy_template, tmp_path / "submitted", answers)
    source, release = tmp_path / "source", tmp_path / "release"
    for folder, src in ((source, "solutions"), (release, "course")):
        (folder / DAY).mkdir(parents=True)
        (folder / DAY / f"{DAY}.ipynb").write_bytes((toy_template / src / DAY / f"{DAY}.ipynb").read_bytes())

    out = tmp_path / "out"
    out.mkdir()
    rows = S.write_report(out, [DAY], source, release, submissions)
    assert rows is not None
    got = {(r["student"], r["other"]): r["similarity"] for r in rows}
    assert got[("ann", "dan")] >= 0.95  # every name changed: still a copy
    assert got[("ann", "solutions")] >= 0.95 and got[("dan", "solutions")] >= 0.95
    assert got[("lib", "dlo.optim.reference.adamw_step")] >= 0.9  # the library's reference, renamed
    kinds = {(r["student"], r["other"]): (r["match"], r["flagged"]) for r in rows}
    assert kinds[("lib", "dlo.optim.reference.adamw_step")] == ("likely copied from dlo", 1)
    assert kinds[("ann", "dan")] == ("similar to a classmate", 1)
    assert kinds[("dan", "solutions")] == ("similar to the instructors' solution", 1)
    # ann's cell is the toy's solution: not flagged as copied from the library (here not even listed)
    assert kinds.get(("ann", "dlo.optim.reference.adamw_step"), ("", 0))[1] == 0
    assert [r["flagged"] for r in rows] == sorted((r["flagged"] for r in rows), reverse=True)  # flagged first
    assert not any("eve" in pair for pair in got), got  # independent: below the threshold everywhere
    assert not any({"bob", "fay"} & set(pair) for pair in got), got  # untouched stubs: never compared
    assert {r["cell"] for r in rows} == {"adamw"}  # `return a + b` is too short to say anything

    # independent code is low against each of the others, not just under the threshold
    cells = {s: S.cells_of(p)["adamw"] for (s, _), p in submissions.items()}
    stub = frozenset(Code.of(S.cells_of(release / DAY / f"{DAY}.ipynb")["adamw"]).all_grams)
    eve = Code.of(cells["eve"], stub)
    for other in ("ann", "dan", "lib"):
        code = Code.of(cells[other], stub)
        assert max(share(eve, code), share(code, eve)) < 0.3, other
    assert Code.of(cells["bob"], stub).fingerprints == set()  # the stub is all boilerplate

    # the CSV holds the same rows, most similar first; the page escapes the students' code
    with (out / "similarity.csv").open() as f:
        listed = list(csv.DictReader(f))
    assert [(r["student"], r["other"]) for r in listed] == [(r["student"], r["other"]) for r in rows]
    flagged = [float(r["similarity"]) for r in listed if r["flagged"] == "1"]
    assert flagged == sorted(flagged, reverse=True) and {r["kind"] for r in listed} >= {"student", "library"}
    again = tmp_path / "again"
    again.mkdir()
    S.write_report(again, [DAY], source, release, submissions)
    assert (again / "similarity.csv").read_bytes() == (out / "similarity.csv").read_bytes()  # byte-identical
    page = (out / "similarity.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<mark>" in page and page.index("ann</b>") < page.index("dan</b>")
    assert "dlo.optim.reference.adamw_step" in page and "likely copied from dlo" in page
    assert "none mapped" in page and "not looked up" in page  # norm: plain asserts; add: nothing to compare


def test_tokens_ignore_names_comments_and_layout():
    a = normalized_tokens("def f(x, y):\n    # add them\n    return x.add(y)  # done\n")
    b = normalized_tokens("def g(p,q):\n\n    return p.add(q)\n")
    assert [t[0] for t in a] == [t[0] for t in b] == ["def", "V", "(", "V", ",", "V", ")", ":", "return", "V", ".",
                                                      "add", "(", "V", ")"]
    assert normalized_tokens("x = (1,\n") != []  # unfinished code counts as far as it goes
    src = "value = 'text'\n"
    assert [(t, src[s:e]) for t, s, e in normalized_tokens(src)] == [("V", "value"), ("=", "="), ("S", "'text'")]


def test_a_broken_report_never_fails_grading(tmp_path, capsys):
    assert S.write_report(tmp_path, [DAY], tmp_path / "nothing", tmp_path / "nothing", {}) is None
    assert "no similarity report" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _exercise(day: str, cell: str) -> tuple[frozenset, dict[str, Code], Code]:
    """The released stub's k-grams, the library references of the cell's checks, the instructors' cell."""
    notebook = REPO / "solutions" / day / f"{day}.ipynb"
    boiler = frozenset(Code.of(S.cells_of(REPO / "course" / day / f"{day}.ipynb").get(cell, "")).all_grams)
    refs = {name: Code.of(src, boiler) for name, src in S.library_references(S.exercises(notebook)[cell]).items()}
    return boiler, refs, Code.of(S.cells_of(notebook)[cell], boiler)


def _source(name: str) -> str:
    import importlib

    module, attr = name.rsplit(".", 1)
    return inspect.getsource(getattr(importlib.import_module(module), attr))


def _similarity(student: Code, other: Code, kind: str) -> float:
    return S._row("d", "c", "student", "other", kind, student, other)["similarity"]  # noqa: SLF001 - the row's own rule


def test_the_threshold_lets_independent_work_pass_and_flags_disguised_copies():
    """Calibration (issue 26): cells written independently stay below THRESHOLD against every library
    reference of their exercise and against the instructors' solution; the library's references copied
    with every name changed and lines reordered are flagged as copied from dlo; with a dead line after
    each line (where lines are long enough) or with more code of the student's own around the copy,
    they are still listed (resembling the reference)."""
    for (day, cell), source in HONEST.items():
        boiler, refs, solution = _exercise(day, cell)
        honest = Code.of(source, boiler)
        assert len(honest.fingerprints) >= S.MIN_FINGERPRINTS  # compared, not left out
        scores = {name: _similarity(honest, ref, "library") for name, ref in refs.items()}
        scores["solution"] = _similarity(honest, solution, "solution")
        assert max(scores.values()) < S.THRESHOLD - 0.1, (cell, scores)  # with a margin
    student_only = []
    for day, cell, name, caught_padded in COPIES:
        boiler, refs, _ = _exercise(day, cell)
        source = disguised(_source(name))
        assert S.match("library", _similarity(Code.of(source, boiler), refs[name], "library")) == \
            ("likely copied from dlo", 1), cell
        if caught_padded:
            assert _similarity(Code.of(padded(source), boiler), refs[name], "library") >= S.LIBRARY_LISTED, cell
        # diluted: the copy with more code of the student's own after it (here another exercise's):
        # little of the cell is the library's, most of the library is in the cell
        diluted = Code.of(source + "\n\n" + HONEST[("day6_pipeline", "one_f_one_b")], boiler)
        assert _similarity(diluted, refs[name], "library") >= S.LIBRARY_LISTED, cell
        student_only.append(share(diluted, refs[name]))
    assert min(student_only) < S.LIBRARY_LISTED  # the student's share alone (the rule before) misses some


def test_no_solution_cell_is_flagged_as_copied_from_the_library():
    """Every day's solution cells were written from the library's references (measured: up to 0.875):
    a student who answers as the solution does resembles the reference, is never flagged as a copier."""
    scores = {}
    for notebook in sorted((REPO / "solutions").glob("day*/day*.ipynb")):
        day = notebook.parent.name
        for cell in S.exercises(notebook):
            _, refs, solution = _exercise(day, cell)
            if len(solution.fingerprints) >= S.MIN_FINGERPRINTS:
                scores.update({(day, cell, n): _similarity(solution, ref, "library") for n, ref in refs.items()})
    highest = max(scores.items(), key=lambda kv: kv[1])
    assert len(scores) >= 40 and S.match("library", highest[1]) == (S.RESEMBLES, 0), highest  # listed, no flag
