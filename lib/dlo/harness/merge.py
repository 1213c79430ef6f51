"""`dlo grade --merge DIR`: the parts of a sharded grading (`--shard K/N`) joined into one.

Every part is a complete `dlo grade` output of its share of the students, DIR/part-K-of-N, with a
grading.json that says which course version, settings and students it graded. The merge refuses,
listing every reason and writing nothing, when a part is missing, unfinished, of another split, of
another course version or settings, or graded from another set of students; else it writes
DIR/scores.csv and cells.csv (the rows of a single run, in the same order: the same bytes),
DIR/feedback/, DIR/gradebook.db (every part's submissions, joined by one process) and
DIR/similarity.csv and .html (every student compared with every other, across the parts).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from dlo.errors import BadInput
from dlo.harness import similarity
from dlo.harness.outdir import OwnedDir
from dlo.harness.results import CELL_COLUMNS, SCORE_COLUMNS, merge_gradebooks, read_csv, read_json, write_csv
from dlo.tables import format_table

PART = re.compile(r"part-(\d+)-of-(\d+)$")


def is_part(name: str) -> bool:
    return PART.match(name) is not None


def merge(top_arg: str) -> int:
    """`dlo grade --merge DIR`: DIR/part-K-of-N (every K, one N, one course version, each finished)
    into DIR/scores.csv, cells.csv, feedback/ and gradebook.db; refuses with the list otherwise."""
    top = Path(top_arg).resolve()
    if not top.is_dir():
        raise BadInput(f"--merge {top}: not a folder")
    parts = {p.name: (p, read_json(p / "grading.json")) for p in sorted(top.iterdir()) if is_part(p.name)}
    if not parts:
        raise BadInput(f"--merge {top}: no part-K-of-N folders (made by `dlo grade --shard K/N --out {top}`)")
    problems = merge_problems(parts)
    if problems:
        for p in problems:
            print(f"dlo grade --merge: {p}", file=sys.stderr)
        print("dlo grade --merge: nothing was written", file=sys.stderr)
        return 1
    owned = OwnedDir(top, keep=is_part)
    owned.check()
    owned.claim()
    ordered = sorted(parts.values(), key=lambda pm: pm[1]["shard"][0])
    rows = sorted((r for p, _ in ordered for r in read_csv(p / "scores.csv")), key=lambda r: (r["student"], r["day"]))
    cells = sorted((r for p, _ in ordered for r in read_csv(p / "cells.csv")), key=lambda r: (r["student"], r["day"]))
    write_csv(top / "scores.csv", rows, SCORE_COLUMNS)
    write_csv(top / "cells.csv", cells, CELL_COLUMNS)
    for p, _ in ordered:
        for html in sorted((p / "feedback").glob("*/*.html")):
            copy_feedback_file(html, top / "feedback" / html.parent.name / html.name)
    first = ordered[0][0] / "course"
    merge_gradebooks(top / "gradebook.db", first / "template.db", [p / "course" / "gradebook.db" for p, _ in ordered])
    similarity.write_report(top, ordered[0][1]["days"], first / "source", first / "release",
                            {(nb.parts[-3], nb.parts[-2]): nb for p, _ in ordered
                             for nb in sorted((p / "course" / "submitted").glob("*/*/*.ipynb"))
                             if nb.name == f"{nb.parts[-2]}.ipynb"})
    owned.record()
    print(format_table([{k: r[k] for k in SCORE_COLUMNS[:-1]} for r in rows]))
    print(f"\nmerged {len(ordered)} parts: {top / 'scores.csv'}, {top / 'cells.csv'}, {top / 'feedback'}, "
          f"{top / 'gradebook.db'}, {top / 'similarity.html'}")
    return 0


def merge_problems(parts: dict) -> list[str]:
    problems, ns, versions = [], set(), {}
    for name, (_, m) in parts.items():
        if m is None:
            problems.append(f"{name} has no grading.json (not made by `dlo grade --shard`)")
            continue
        ns.add(int(PART.match(name)[2]))
        versions.setdefault((m.get("course_version"), m.get("profile"), m.get("cell_timeout")), []).append(name)
        if not m.get("complete"):
            problems.append(f"{name} is not finished (run its `dlo grade --shard` again: it resumes)")
    if len(ns) > 1:
        problems.append(f"parts of different splits: {', '.join(sorted(parts))}")
    elif ns:
        n = ns.pop()
        missing = [f"part-{k}-of-{n}" for k in range(1, n + 1) if f"part-{k}-of-{n}" not in parts]
        if missing:
            problems.append(f"missing: {', '.join(missing)} (grade them with --shard K/{n})")
    if len(versions) > 1:
        problems.append("graded with different course versions or settings: " + "; ".join(
            f"{', '.join(names)}: version {v}, profile {p}, cell timeout {t}" for (v, p, t), names in sorted(
                versions.items(), key=lambda kv: kv[1])))
    students = {tuple(m.get("students") or ()) for _, m in parts.values() if m}
    if len(students) > 1:
        problems.append("the parts were graded from different sets of students (another SUBMITTED_DIR?)")
    return problems


def copy_feedback_file(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
