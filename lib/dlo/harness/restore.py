"""A submission's grading metadata put back as released, and every change said in its feedback.

nbgrader grades the cells its metadata names (`metadata.nbgrader`: grade_id, grade, points, ...). A
student who edits it - by accident (a copied cell, a JupyterLab extension) or not (an extra 100-point
cell) - made nbgrader stop with a KeyError: "autograde failed", 0 on every cell, no reason given. Before
nbgrader sees a submission (`nbgrader_cli`, on the grader's scratch copy; the submission itself is never
changed), each cell is matched with the instructors' notebook:

- a cell whose grade id is the release's gets the release's metadata back whole (flags, points);
- a cell whose grade id is not the release's (changed, made up, missing) is matched by its cell id, then
  by its visible source (a test cell's, hidden tests aside), with a released cell that the submission
  lacks, and gets that cell's metadata; a plain cell whose cell id is a missing graded cell's too;
- a cell that matches nothing (an added "100-point" cell) or repeats a grade id loses its nbgrader
  metadata: it runs as an ordinary cell, and its points are refused.

Each change is a line of a note at the top of the notebook, hence of the feedback; nbgrader then grades
every cell it can (a deleted test cell it adds back itself).
"""

from __future__ import annotations

import re

from nbformat.v4 import new_markdown_cell

FLAGS = ("grade", "solution", "task", "locked", "points")
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", re.DOTALL)
TITLE = ("**Grading metadata changed**: nbgrader's metadata of some cells did not match the release "
         "(the instructors' notebook). What the grader did:")


def _name(value) -> str:
    """A grade id or cell id as the note shows it: word characters only, at most 40."""
    text = re.sub(r"[^\w.-]", "?", str(value))[:40]
    return f"`{text}`" if text else "(none)"


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def _visible(source: str) -> str:
    return HIDDEN.sub("", source).strip()


def released_cells(instructors) -> dict[str, dict]:
    """{grade_id: {"meta": the release's nbgrader metadata, "id": cell id, "type": cell type, "source":
    visible source}} of the instructors' notebook, in order."""
    out = {}
    for cell in instructors["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader")
        if isinstance(meta, dict) and meta.get("grade_id") and (meta.get("grade") or meta.get("solution")
                                                                or meta.get("task") or meta.get("locked")):
            out.setdefault(meta["grade_id"], {
                "meta": {**{k: v for k, v in meta.items() if k != "checksum"}, "cell_type": cell["cell_type"]},
                "id": cell.get("id"), "type": cell["cell_type"], "source": _visible(_source(cell))})
    return out


def _match(cell, released: dict, missing: list[str]) -> str | None:
    """The grade id of the released cell (one the submission lacks) that `cell` is, by cell id then by source."""
    for gid in missing:
        if cell.get("id") and released[gid]["id"] == cell.get("id"):
            return gid
    text = _visible(_source(cell))
    for gid in missing:
        if text and released[gid]["source"] == text and released[gid]["type"] == cell.get("cell_type"):
            return gid
    return None


def _changes(old, new: dict) -> str:
    if not isinstance(old, dict):
        return "its grading metadata was not readable"
    what = [f"{k} {_name(old.get(k, False))} instead of {_name(new.get(k, False))}" for k in FLAGS
            if old.get(k, False) != new.get(k, False) and not (k == "points" and not new.get("grade"))]
    return "; ".join(what)


def restore(nb, instructors) -> list[str]:
    """Put back the release's nbgrader metadata in `nb` (a submission, changed in place); one line per change."""
    released = released_cells(instructors)
    cells = nb.get("cells", [])
    present = set()
    for cell in cells:  # grade ids that are the release's, first occurrence
        meta = cell.get("metadata", {}).get("nbgrader")
        gid = meta.get("grade_id") if isinstance(meta, dict) else None
        if isinstance(gid, str) and gid in released:
            present.add(gid)
    missing = [g for g in released if g not in present]
    notes, seen = [], set()
    for i, cell in enumerate(cells):
        metadata = cell.setdefault("metadata", {})
        meta = metadata.get("nbgrader")
        gid = meta.get("grade_id") if isinstance(meta, dict) else None
        where = f"cell {i + 1} ({_name(gid)})" if meta is not None else f"cell {i + 1}"
        if isinstance(gid, str) and gid in released and gid not in seen:
            target, why = gid, _changes(meta, released[gid]["meta"])
        elif meta is None:
            target = _match_by_id(cell, released, missing)
            why = "its grading metadata was removed" if target else ""
        elif isinstance(gid, str) and gid in seen:
            target, why = None, "a second cell with this grade id"
        else:
            target = _match(cell, released, missing)
            why = f"its grade id is not the release's (released: {_name(target)})" if target else ""
        if target is not None:
            seen.add(target)
            if target in missing:
                missing.remove(target)
            metadata["nbgrader"] = dict(released[target]["meta"])
            if why:
                notes.append(f"{where}: {why}; put back as released, graded as {_name(target)}")
        elif meta is not None:
            del metadata["nbgrader"]
            if isinstance(meta, dict) and not any(meta.get(k) for k in ("grade_id", *FLAGS)):
                continue  # metadata that claims nothing (all flags off): nothing lost, nothing to say
            points = meta.get("points") if isinstance(meta, dict) and meta.get("grade") else None
            claim = f", {_name(points)} points claimed" if points is not None else ""
            notes.append(f"{where}{claim}: " + (why or "not a cell of the release") +
                         "; run as an ordinary cell, not graded" + (", its points refused" if claim else ""))
    return notes


def _match_by_id(cell, released: dict, missing: list[str]) -> str | None:
    """A plain cell (no nbgrader metadata) whose cell id is a released graded cell's that the submission lacks."""
    return next((g for g in missing if cell.get("id") and released[g]["id"] == cell.get("id")
                 and released[g]["type"] == cell.get("cell_type")), None)


def note_cell(notes: list[str], minor: int):
    """The markdown cell that tells the student (and the feedback) what changed."""
    cell = new_markdown_cell("\n".join([TITLE, "", *(f"- {n}" for n in notes)]))
    if minor < 5:
        cell.pop("id", None)
    return cell
