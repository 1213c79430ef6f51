"""`dlo grade` against a class that reads the grader's code (issue 33), end to end on the toy course:
broken grading metadata explained and graded anyway, feedback and the autograded notebook that run no
script of the student's, and the similarity report fed by what the checks received (a clone's bytecode,
a copy run from compressed text)."""

from __future__ import annotations

import base64
import copy
import json
import zlib

import pytest

from tests.harness.conftest import ADAMW, DAY, POINTS, dlo, edit_cells, grade_id, read_csv
from tests.harness.test_sanitize import live_script

TOTAL = sum(POINTS.values())
ADAMW_OWN = ADAMW.replace("    ### BEGIN SOLUTION\n", "").replace("\n    ### END SOLUTION", "")
SOLVED = {"add": "def add(a, b):\n    return a + b", "norm": "def norm(x, y):\n    return (x * x + y * y) ** 0.5",
          "adamw": ADAMW_OWN}
SCRIPTS = '''from IPython.display import HTML, Javascript, Markdown, SVG, display
display(HTML("<b>hello from mallory</b><script>window.top.__pwned = 'html'</script>"))
display(HTML("<img src=x onerror=\\"window.top.__pwned = 'img'\\">"))
display(Javascript("window.top.__pwned = 'js'"))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9" onload="window.top.__pwned = 1">'
            '<script>window.top.__pwned = 2</script><circle r="4"/></svg>'))
display(Markdown("[click](javascript:window.top.__pwned=3) <img src=x onerror=window.top.__pwned=4>"))
print("plain text stays")'''
NOTES_MD = "<img src=x onerror=\"window.top.__pwned = 'md'\"> My notes."
CLONE = '''import inspect, types
import dlo.optim.reference as _r
_f = inspect.unwrap(_r.adamw_step)
adamw_step = types.FunctionType(_f.__code__, _f.__globals__, "adamw_step", _f.__defaults__, _f.__closure__)
adamw_step.__kwdefaults__ = _f.__kwdefaults__'''
PACKED = base64.b64encode(zlib.compress(ADAMW_OWN.replace("param", "p").encode())).decode()


def _added(source: str, cell_type: str = "code", cid: str = "added") -> dict:
    cell = {"cell_type": cell_type, "id": cid, "metadata": {}, "source": source}
    return {**cell, "outputs": [], "execution_count": None} if cell_type == "code" else cell


def _notebook(toy_root, submitted, student: str, change) -> None:
    def solve(cell):
        if grade_id(cell) in SOLVED:
            cell["source"] = SOLVED[grade_id(cell)]
    path = edit_cells(toy_root / "course" / DAY / f"{DAY}.ipynb", submitted / student / DAY / f"{DAY}.ipynb", solve)
    nb = json.loads(path.read_text())
    nb["cells"] = change(nb["cells"])
    path.write_text(json.dumps(nb))


def _fumbler(cells):
    """A test cell's grade id changed, an extra 100-point cell added (a copy of a test cell)."""
    out = []
    for cell in cells:
        out.append(cell)
        if grade_id(cell) == "norm_test":
            cell["metadata"]["nbgrader"]["grade_id"] = "norm_test_mine"
        if grade_id(cell) == "add_test":
            bonus = copy.deepcopy(cell)
            bonus.update(id="bonus-cell", source="pass")
            bonus["metadata"]["nbgrader"].update(grade_id="bonus", points=100)
            out.append(bonus)
    return out


def _insert_after(gid: str, *added):
    def change(cells):
        out = []
        for cell in cells:
            out.append(cell)
            if grade_id(cell) == gid:
                out += list(added)
        return out
    return change


def _replace(gid: str, source: str):
    def change(cells):
        for cell in cells:
            if grade_id(cell) == gid:
                cell["source"] = source
        return cells
    return change


@pytest.mark.slow
@pytest.mark.trust  # a hostile class's evidence (issue 33), ~60 CPU s: pytest -m trust
def test_grading_explains_metadata_runs_no_script_and_sees_hidden_copies(toy_root, tmp_path):
    submitted, out = tmp_path / "submitted", tmp_path / "grading"
    _notebook(toy_root, submitted, "fumbler", _fumbler)
    _notebook(toy_root, submitted, "mallory", _insert_after("add", _added(SCRIPTS), _added(NOTES_MD, "markdown", "md")))
    _notebook(toy_root, submitted, "cloner", _replace("adamw", CLONE))
    _notebook(toy_root, submitted, "packer", _replace("adamw", f"import base64, zlib\n"
                                                               f"exec(zlib.decompress(base64.b64decode('{PACKED}')))"))
    proc = dlo("grade", str(submitted), "--out", str(out), "--cell-timeout", "60", root=toy_root, check=False,
               timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {r["student"]: r for r in read_csv(out / "scores.csv")}

    # Broken metadata: every released cell graded, the 100 points refused, the feedback says what changed.
    assert (float(scores["fumbler"]["score"]), scores["fumbler"]["status"]) == (TOTAL, "graded")
    assert float(scores["fumbler"]["max_score"]) == TOTAL
    feedback = (out / "feedback" / "fumbler" / f"{DAY}.html").read_text()
    assert "Grading metadata changed" in feedback and "its points refused" in feedback
    assert "its grade id is not the release&#39;s (released: <code>norm_test</code>)" in feedback or \
        "its grade id is not the release's (released: <code>norm_test</code>)" in feedback, feedback[:3000]

    # Scripts: graded as usual; nothing of the student's can run where the instructor opens it.
    assert (float(scores["mallory"]["score"]), scores["mallory"]["status"]) == (TOTAL, "graded")
    page = (out / "feedback" / "mallory" / f"{DAY}.html").read_text()
    assert "Content-Security-Policy" in page and not live_script(page), live_script(page)
    assert "hello from mallory" in page and "plain text stays" in page and "data:image/svg+xml;base64," in page
    autograded = json.loads((out / "course" / "autograded" / "mallory" / DAY / f"{DAY}.ipynb").read_text())
    bundles = [o.get("data", {}) for c in autograded["cells"] for o in c.get("outputs", [])]
    assert {m for b in bundles for m in b} <= {"text/plain", "text/html", "text/markdown", "image/png"}
    html_outputs = "".join("".join(b["text/html"]) for b in bundles if "text/html" in b)
    assert "hello from mallory" in html_outputs and not live_script(html_outputs)  # the SVG: an <img> now
    notes = next(c for c in autograded["cells"] if c.get("id") == "md")
    assert "".join(notes["source"]).startswith("\\<img src\\=x")  # shown as the student typed it, no tag

    # The similarity report: the clone found by the bytecode the checks received, the exec'd copy decoded.
    rows = {(r["student"], r["other"]): r for r in read_csv(out / "similarity.csv") if r["cell"] == "adamw"}
    clone = rows[("cloner", "dlo.optim.reference.adamw_step")]
    assert (clone["match"], clone["flagged"], clone["bytecode"]) == ("a clone of dlo's code", "1", "1.0")
    digests = json.loads((out / "course" / "autograded" / "cloner" / DAY / ".dlo-bytecode.json").read_text())
    assert digests["adamw_step"]["digests"]  # read from the capture folder's pickle, never unpickled
    packed = rows[("fumbler", "packer")]
    assert float(packed["similarity"]) >= 0.95 and packed["flagged"] == "1" and "exec of" in packed["obfuscated"]
