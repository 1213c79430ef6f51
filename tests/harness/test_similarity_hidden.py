"""Copies a class hides from the similarity report (issue 33): in a cell the student added, in text
run by `exec` after decompression, as a clone of a reference's code object. The report reads every
unlocked cell, decodes without running, and compares bytecode."""

from __future__ import annotations

import base64
import inspect
import json
import types
import zlib
from pathlib import Path

import pytest

from dlo.harness import bytecode, decode
from dlo.harness import similarity as S
from dlo.harness.authored import Program
from dlo.pickling import dumps
from tests.harness.conftest import ADAMW, DAY, grade_id
from tests.harness.test_similarity import ADAMW_OWN, INDEPENDENT, RENAMES, rename

REF = "dlo.optim.reference.adamw_step"
IMPL = rename(ADAMW_OWN, RENAMES).replace("def adamw_step(", "def _impl(")
PACKED = base64.b64encode(zlib.compress(rename(ADAMW_OWN, {"param": "p", "grad": "g"}).encode())).decode()
CLONE = '''import inspect, types
_m = __import__("dlo.optim." + "reference", fromlist=["_"])
_f = inspect.unwrap(getattr(_m, "adamw" + "_step"))
adamw_step = types.FunctionType(_f.__code__, _f.__globals__, "adamw_step", _f.__defaults__, _f.__closure__)'''
STUB = ADAMW.split("    ### BEGIN SOLUTION")[0] + "    raise NotImplementedError()"


def _code(student: str) -> dict:
    """{(cell after which to add, or None to replace the exercise): source} of each student."""
    return {
        "ann": {None: ADAMW_OWN},  # the instructors' solution, as written
        "eve": {None: INDEPENDENT},
        "hider": {None: "adamw_step = _impl", "add": IMPL},  # the copy in a cell of its own, before the exercise
        "packer": {None: STUB, "adamw": f"import base64, zlib\nexec(zlib.decompress(base64.b64decode('{PACKED}')))"},
        "cloner": {None: CLONE},
    }[student]


def _class(toy_template: Path, course: Path, students: list[str]) -> dict:
    """Submissions laid out as `dlo grade` keeps them: course/submitted/<student>/<day>/<day>.ipynb."""
    out = {}
    for student in students:
        nb = json.loads((toy_template / "course" / DAY / f"{DAY}.ipynb").read_text())
        cells = []
        for cell in nb["cells"]:
            code = _code(student)
            if grade_id(cell) == "adamw":
                cell["source"] = code[None]
            cells.append(cell)
            if grade_id(cell) is not None and grade_id(cell) in code:
                cells.append({"cell_type": "code", "id": f"added-{student}", "metadata": {}, "outputs": [],
                              "execution_count": None, "source": code[grade_id(cell)]})
        nb["cells"] = cells
        path = course / "submitted" / student / DAY / f"{DAY}.ipynb"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(nb))
        out[(student, DAY)] = path
    return out


def _clone():
    """What the cloner's kernel holds: the reference's own code object under another function."""
    import dlo.optim.reference as ref

    f = inspect.unwrap(ref.adamw_step)
    return types.FunctionType(f.__code__, f.__globals__, "adamw_step", f.__defaults__, f.__closure__)


def _report(toy_template, tmp_path, students):
    course = tmp_path / "course"
    submissions = _class(toy_template, course, students)
    # the grader's record of what the cloner's checks received (nbgrader_cli does this from the capture folder)
    found = bytecode.of_pickle(dumps(_clone()))
    (course / "autograded" / "cloner" / DAY).mkdir(parents=True)
    (course / "autograded" / "cloner" / DAY / bytecode.FILE).write_text(json.dumps({"adamw_step": found}))
    for folder, src in ((course / "source", "solutions"), (course / "release", "course")):
        (folder / DAY).mkdir(parents=True)
        (folder / DAY / f"{DAY}.ipynb").write_bytes((toy_template / src / DAY / f"{DAY}.ipynb").read_bytes())
    rows = S.write_report(tmp_path, [DAY], course / "source", course / "release", submissions)
    assert rows is not None
    return {(r["student"], r["other"]): r for r in rows if r["cell"] == "adamw"}, rows


@pytest.mark.trust  # a hostile class's evidence (issue 33): pytest -m trust
def test_copies_in_added_cells_exec_and_clones_are_found(toy_template, tmp_path):
    got, rows = _report(toy_template, tmp_path, ["ann", "eve", "hider", "packer", "cloner"])
    assert got[("ann", "hider")]["similarity"] >= 0.95 and got[("ann", "hider")]["flagged"] == 1  # the added cell
    packer = got[("ann", "packer")]
    assert packer["similarity"] >= 0.95 and packer["flagged"] == 1
    assert "exec of base64 + zlib text (decoded)" in packer["obfuscated"]
    assert got[("packer", "(its own code)")]["match"].startswith("obfuscated: exec of base64 + zlib text")
    clone = got[("cloner", REF)]
    assert (clone["match"], clone["flagged"], clone["bytecode"], clone["similarity"]) == (S.CLONE, 1, 1.0, 1.0)
    assert "takes a code object" in got[("cloner", "(its own code)")]["obfuscated"]
    assert not any("eve" in pair for pair in got)  # independent work: not even listed
    page = (tmp_path / "similarity.html").read_text()
    assert "obfuscated: exec of base64 + zlib text" in page and "def p" not in page  # decoded text, shown escaped
    assert "mul_(1 - lr * weight_decay)" in page  # the decoded copy, side by side with ann's


def test_a_clone_named_in_the_source_is_found_without_the_grading_run(toy_template, tmp_path):
    """The static half: `ref.__code__` resolved through the notebook's imports names the reference."""
    program = Program.of([(0, "import dlo.optim.reference as r\nimport types\n"
                               "adamw_step = types.FunctionType(r.adamw_step.__wrapped__.__code__, {})")])
    part = program.exercise({"adamw_step"}, None)[-1]
    assert part.clones[0] == REF + ".__wrapped__" and any("__code__" in w for w in part.obfuscated)
    assert S._same_object(REF + ".__wrapped__", __import__("dlo.optim.reference").optim.reference.adamw_step)  # noqa: SLF001


def test_decoding_runs_nothing_and_stops_at_a_bomb():
    import ast

    bomb = base64.b64encode(zlib.compress(b"x" * (64 << 20))).decode()  # 64 MiB of x: 64 KiB compressed
    tree = ast.parse(f"zlib.decompress(base64.b64decode('{bomb}'))", mode="eval")
    assert decode.literal(tree.body, {}, {}, []) is None  # capped at MAX_TEXT, never 64 MiB in memory
    ran = ast.parse("exec(__import__('os').system('touch /tmp/dlo-pwned') or 'x = 1')", mode="eval")
    assert decode.literal(ran.body.args[0], {}, {}, []) is None  # a call it does not know: not made
    blob = base64.b64encode(b"print(1)").decode()
    env_tree = ast.parse(f"blob = '{blob}'\nexec(base64.b64decode(blob[::-1][::-1]).decode())")
    program = Program.of([(0, ast.unparse(env_tree))])
    assert [p.source for p in program.parts][-1] == "print(1)"
    assert program.parts[-1].obfuscated == ["exec of base64 text (decoded)"]


def test_decoding_stops_at_its_budget():
    blob = base64.b64encode(zlib.compress(b"#" * (3 << 20))).decode()  # 3 MiB of comment each
    program = Program.of([(i, f"exec(zlib.decompress(base64.b64decode('{blob}')))") for i in range(8)])
    decoded = [w for p in program.parts for w in p.obfuscated if w.endswith("(decoded)")]
    assert len(decoded) == 5 and sum("could not be decoded" in w for p in program.parts for w in p.obfuscated) == 3


class _Trap:
    """Unpickling this would run a command."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_the_pickle_reader_makes_no_object(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    assert bytecode.of_pickle(pickle.dumps(_Trap(str(marker)))) == {"digests": {}, "refs": []}
    deep = b"\x80\x05" + b"(" * 200_000 + b"t" * 200_000 + b"."  # tuples nested 200 000 deep
    assert bytecode.of_pickle(deep) == {"digests": {}, "refs": []}
    assert bytecode.of_pickle(b"not a pickle") == {"digests": {}, "refs": []}
    assert not marker.exists()
