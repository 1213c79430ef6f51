"""`dlo grade SUBMITTED_DIR --out DIR`: autograde every student and day; scores you can sign.

Input: SUBMITTED_DIR/<student>/<day>/<day>.ipynb, never modified (submissions are copied, without
their runs/ folders). It is checked before anything is written; every student folder gets a row for
every day anyone submitted ("no submission" and 0 for a missing, empty or cell-less notebook).

Output, only inside DIR (new, empty, or an earlier `dlo grade` output: see `outdir`): scores.csv (one
row per student and day, with the sandbox the grading ran in), cells.csv (one row per test cell),
feedback/<student>/<day>.html (results and messages, no hidden test), results/ (one record per graded
submission), similarity.html and .csv (code that looks copied: `similarity`; no score depends on it),
and course/, the nbgrader course root built from solutions/ (locked test cells and
hidden tests come from the instructors' notebooks whatever a student edited), whose gradebook.db
holds every submission once grading is done, and whose submitted/ holds a copy of each graded one:
nbgrader's formgrader, `nbgrader export` and `release_feedback` work there (`exchange`).

Each submission is graded on its own (`pool`): its own nbgrader process, course root and gradebook,
its own sandbox scratch; `--jobs N` grades N at once, with the same bytes in the CSVs as one at a
time. The test cells' verdict comes from checks run outside the student's kernel
(`execute.ResilientExecute`), and the student's code runs under bubblewrap (`dlo.grading.jail`):
where no bwrap can run, `dlo grade` refuses to start (exit 2, the cause and its fix on stderr) unless
given --no-sandbox.

Only what can change a score runs: every cell up to the last graded one (`graded`); the experiments
after it are left out, each with a note in the feedback, unless --full-notebook.

Started again with the same --out, a run resumes: submissions with a record (and unchanged input)
are kept, the rest graded; an output graded with another course version is refused (--regrade).
`--shard K/N` grades every N-th student into DIR/part-K-of-N (one SLURM array task each), and
`--merge DIR` joins the parts, refusing when one is missing, unfinished or of another version.
What it reads before writing anything (the submissions, their hashes, the course version) is `submissions`'s.
"""

from __future__ import annotations

import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

from dlo.errors import BadInput, warn
from dlo.grading.jail import probe
from dlo.harness import exchange, pool, schedule, shares, similarity
from dlo.harness.days import list_days, repo_root
from dlo.harness.merge import is_part, merge  # noqa: F401 - merge: `dlo grade --merge`
from dlo.harness.nbgrader_cli import generate_assignments, prestart_warm, stop_warm
from dlo.harness.outdir import OwnedDir
from dlo.harness.results import (
    CELL_COLUMNS,
    SCORE_COLUMNS,
    merge_gradebooks,
    read_json,
    record_path,
    tables,
    templates,
    write_csv,
    write_json,
)
from dlo.harness.submissions import (
    check_paths,
    course_version,
    find_submissions,
    folder_hash,
    notebook_status,
    parse_shard,
)
from dlo.tables import format_table

CONFIG = '''from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.converters.autograde import Autograde
from nbgrader.preprocessors import Execute, GetGrades
from dlo.harness.execute import ResilientExecute
from dlo.harness.feedback_html import FeedbackExporter
from dlo.grading.testcells import StripHiddenTests

c = get_config()
# nbgrader's own pipeline, with Execute swapped for one that runs test cells outside the student's kernel.
c.Autograde.autograde_preprocessors = [
    ResilientExecute if p is Execute else p
    for p in Autograde.class_traits()["autograde_preprocessors"].default()]
c.Execute.timeout = {cell_timeout}
c.ResilientExecute.full_notebook = {full_notebook}  # False: the experiments after the last graded cell are left out
c.Execute.interrupt_on_timeout = True
c.OverwriteCells.add_missing_cells = True  # a deleted test cell comes back, and is graded
# Feedback shows results and messages, never the hidden tests' source.
c.GenerateFeedback.preprocessors = [GetGrades, StripHiddenTests, CSSHTMLHeaderPreprocessor]
c.GenerateFeedback.exporter_class = FeedbackExporter  # HTMLExporter without its second parse of the page
'''


# ----------------------------------------------------------------------------- the command

def main(root: Path, submitted: str, out: str | None, profile: str, cell_timeout: float,
         notebook_timeout: float, require_full: bool, jobs: int | None = None, shard: str | None = None,
         regrade: bool = False, no_sandbox: bool = False, full_notebook: bool = False,
         limits: dict | None = None, arrivals=None) -> int:
    """`limits`: {name: value} of `dlo.grading.limits.Limits` given on the command line (the rest sized per job).
    `arrivals` (`dlo.harness.arrivals`, `dlo run --grade`): the submissions a run in this process is still
    making, each graded once made, in the run's slots."""
    days = list_days(root)
    if not days:
        raise BadInput(f"no day notebooks under {root / 'solutions'}")
    submitted_dir = Path(submitted).resolve()
    students, graded_days, status = (find_submissions(submitted_dir, days) if arrivals is None
                                     else arrivals.submissions())
    part = parse_shard(shard)
    if jobs is not None and jobs < 1:
        raise BadInput(f"--jobs {jobs}: expected a positive number")
    top = Path(out or Path("runs") / f"grade-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    check_paths(submitted_dir, top)
    manifest = {"course_version": course_version(root, graded_days), "days": graded_days, "students": students,
                "profile": profile, "cell_timeout": cell_timeout, "shard": list(part) if part else None,
                "full_notebook": full_notebook,
                "submitted": str(submitted_dir)}
    if part:  # a part of DIR, which may hold the other parts (written at the same time) and a merge
        OwnedDir(top, keep=is_part).check()
        top.mkdir(parents=True, exist_ok=True)
        out_dir = top / f"part-{part[0]}-of-{part[1]}"
        mine = set(students[part[0] - 1::part[1]])
        status = {k: v for k, v in status.items() if k[0] in mine}
    else:
        out_dir = top
    owned = OwnedDir(out_dir, keep=None if part else is_part)
    owned.check()  # refuses before anything is written
    resume = owned.owned() and not regrade and _resumable(out_dir, manifest)
    sandbox = "none (--no-sandbox)" if no_sandbox else probe()
    if sandbox != "bwrap" and not no_sandbox:
        raise BadInput(f"refusing to grade without a sandbox: {sandbox[6:-1]}; or pass --no-sandbox to grade "
                       f"unconfined")
    if sandbox != "bwrap":
        warn("grade", f"grading without a sandbox: {sandbox}. Student code can read the solutions, the "
                      f"gradebook and the other submissions while it runs (the `sandbox` column says so).")
    if arrivals is not None:  # `dlo run --grade`: the run's own checks passed too, then its slots (their count)
        jobs = arrivals.proceed()
        if jobs is None:
            return 1  # the run was refused or stopped: nothing written
    jobs = jobs or shares.default_jobs(profile)
    if resume:
        owned.record()
    else:
        owned.claim()
    try:
        rows = _run(root, submitted_dir, top, out_dir, owned, graded_days, status, manifest, profile, cell_timeout,
                    notebook_timeout, sandbox, jobs, resume, limits, arrivals)
    except KeyboardInterrupt:
        owned.record()
        print(f"\ninterrupted: the submissions graded so far are kept in {top}; run the same command again "
              f"(with --out {top}) to resume", file=sys.stderr, flush=True)
        return 130
    except BaseException:
        owned.discard()
        raise
    print()
    print(format_table([{k: r[k] for k in SCORE_COLUMNS[:-1]} for r in rows]))
    print(f"\nscores: {out_dir / 'scores.csv'}\nper cell: {out_dir / 'cells.csv'}\nfeedback: {out_dir / 'feedback'}"
          f"\ngradebook: {out_dir / 'course' / 'gradebook.db'}\nsimilarity: {out_dir / 'similarity.html'}"
          f"\nsandbox: {sandbox}")
    if part:
        print(f"part {part[0]} of {part[1]}: when every part is done, `dlo grade --merge {top}` joins them")
    if require_full and not all(float(r["max_score"]) > 0 and float(r["score"]) == float(r["max_score"]) for r in rows):
        print("not every submission has full marks (--require-full)")
        return 1
    return 0


def _resumable(out_dir: Path, manifest: dict) -> bool:
    """True when the earlier output in out_dir can be resumed; SystemExit when it was graded with
    another course version or settings (regrading would replace its scores: only with --regrade)."""
    earlier = read_json(out_dir / "grading.json")
    if earlier is None:
        return False  # a run that failed before it began grading: start again
    # an output from before --full-notebook existed ran every cell
    differ = [k for k in ("course_version", "days", "profile", "cell_timeout", "shard", "students", "full_notebook")
              if earlier.get(k, True if k == "full_notebook" else None) != manifest[k]]
    if differ:
        raise BadInput(f"--out {out_dir} holds a grading with other {', '.join(differ)} "
                         f"(course version {earlier.get('course_version')}, now {manifest['course_version']}): "
                         f"nothing was written; add --regrade to grade everything again there, or choose "
                         f"another --out")
    return True


def _run(root, submitted_dir, top, out_dir, owned, graded_days, status, manifest, profile, cell_timeout,
         notebook_timeout, sandbox, jobs, resume, given_limits=None, arrivals=None) -> list[dict]:
    course = out_dir / "course"
    if not resume or not (course / "template.db").is_file():
        shutil.rmtree(course, ignore_errors=True)
        course.mkdir()
        config = (CONFIG.format(cell_timeout=int(cell_timeout), full_notebook=manifest["full_notebook"])
                  + exchange.config_block(exchange.class_exchange()))
        _load_config(config)  # nbgrader only logs a broken config file and goes on without it
        (course / "nbgrader_config.py").write_text(config)
        prestart_warm()
        generate_assignments(root / "solutions", graded_days, course, db=course / "template.db")
    write_json(out_dir / "grading.json", {**manifest, "complete": False})  # until the CSVs are written again
    owned.record()
    keys = sorted(k for k, v in status.items() if v == "ok")
    inputs = {} if arrivals else {k: folder_hash(submitted_dir / k[0] / k[1]) for k in keys}  # else once made
    records = {}
    for key in sorted(inputs):
        rec = read_json(record_path(out_dir, *key)) if resume else None
        if rec and rec.get("final") and rec.get("input") == inputs[key]:
            records[key] = rec
    todo = [k for k in keys if k not in records]
    if resume:
        print(f"resuming in {out_dir}: {len(records)} submission(s) already graded, {len(todo)} to go", flush=True)
    running = min(jobs, max(1, len(todo)))

    def made(key) -> bool:  # `arrivals`: a submission the run has just made, read now as find_submissions would
        status[key] = notebook_status(submitted_dir / key[0] / key[1] / f"{key[1]}.ipynb")
        if status[key] == "ok":
            inputs[key] = folder_hash(submitted_dir / key[0] / key[1])
        return status[key] == "ok"

    limits = shares.job_limits(running, given_limits) if sandbox == "bwrap" else None  # none without the sandbox
    if limits is not None:
        print(f"limits per job: {limits.describe()}", flush=True)
    grading = pool.Run(out=out_dir, submitted=submitted_dir, profile=profile, notebook_timeout=notebook_timeout,
                       sandbox=sandbox, hidden=[root, repo_root(), submitted_dir, top, Path.home()], inputs=inputs,
                       limits=limits)
    key_mode = schedule.mode(profile, manifest["full_notebook"])
    seconds = schedule.expected(todo, records.values(), key_mode)
    start = time.monotonic()
    try:
        prepared = []  # the similarity report's references, read on a core the last jobs leave idle
        records.update(pool.run(grading, todo, running, len(keys), len(records), seconds,
                                (arrivals, made) if arrivals else None,
                                lambda: prepared.append(similarity.prepare(graded_days, course / "source"))))
    finally:
        stop_warm()
        owned.record()
    schedule.remember(records.values(), key_mode)
    print(pool.summary(records, time.monotonic() - start, jobs), flush=True)
    rows, cells = tables(status, records, templates(course / "template.db", graded_days), sandbox)
    write_csv(out_dir / "scores.csv", rows, SCORE_COLUMNS)
    write_csv(out_dir / "cells.csv", cells, CELL_COLUMNS)
    merge_gradebooks(course / "gradebook.db", course / "template.db",
                     [course / "gradebooks" / d / f"{s}.db" for (s, d), r in sorted(records.items())
                      if r["status"] == "graded"])
    exchange.publish(course, submitted_dir, sorted(inputs), sorted({s for s, _ in status}))  # for nbgrader's tools
    for thread in prepared:
        thread.join()
    similarity.write_report(out_dir, graded_days, course / "source", course / "release",
                            {k: course / "submitted" / k[0] / k[1] / f"{k[1]}.ipynb" for k in sorted(inputs)})
    write_json(out_dir / "grading.json", {**manifest, "complete": True})
    owned.record()
    return rows


def _load_config(text: str):
    from traitlets.config import Config

    c = Config()
    exec(compile(text, "nbgrader_config.py", "exec"), {"get_config": lambda: c})
    return c
