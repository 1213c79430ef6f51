"""Grading many submissions at once: one process and one scratch course root per submission.

A submission is graded by `grade_one` in its own nbgrader process (`nbgrader_cli`; forked from the run's
warm process, `warm`, which paid the interpreter's start and imports once), inside its own
nbgrader course root (OUT/work/<student>/<day>/nbgrader: the shared source/ linked, the submission
copied, a private copy of the template gradebook), so N of them can run side by side with no shared
file written by two processes. Only when it is finished are its autograded notebook, feedback and
gradebook moved into OUT/course, and its record (`results`) written last: the record is the proof
that a submission is done, which is what a resumed run trusts.

`run` drives `jobs` such workers from threads (each waits on its child process), longest expected
first, with a progress line from the start (`schedule`: queued, running, done, the slowest running,
time left) and a summary at the end. Each job runs within limits sized from its share of the machine
(`dlo.harness.shares`; `dlo.grading.limits`), grading as root under a uid of its own, leased for the
run. A worker whose process is killed (the out-of-memory killer, an administrator) is retried once;
killed again, the submission is marked and the run goes on. Ctrl-C or SIGTERM (a job's time limit) kills the children
and stops; the records already written let the same command resume.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from dlo.grading import files, limits
from dlo.grading.jail import SPEC_ENV, UID, as_root, make_spec
from dlo.harness.nbgrader_cli import autograde_and_feedback, kill_children
from dlo.harness.results import copy_feedback, graded, record_path, write_json
from dlo.harness.schedule import Progress, fmt_time, order
from dlo.harness.shares import slot_env

TIMEOUT_ERRORS = ("CellTimeoutError", "CheckTimeout", "KeyboardInterrupt")


class Killed(RuntimeError):
    """The submission's grading process was killed by a signal (not by the grader's own timeout)."""


@dataclass
class Run:
    """What every submission of one `dlo grade` run shares."""

    out: Path  # this run's output folder (a shard's part folder with --shard)
    submitted: Path
    profile: str
    notebook_timeout: float
    sandbox: str
    hidden: list[Path]
    inputs: dict = field(default_factory=dict)  # {(student, day): hash of the submitted folder}
    limits: limits.Limits | None = None  # each job's (`job_limits`); None: unlimited

    @property
    def course(self) -> Path:
        return self.out / "course"


# ----------------------------------------------------------------------------- one submission

def grade_one(run: Run, student: str, day: str, env: dict, attempt: int = 1, uid: int = UID) -> dict:
    """Grade one submission in its own course root and process, its sandboxes as `uid` when grading as root;
    its record (also written to disk)."""
    work = run.out / "work" / student / day
    shutil.rmtree(work, ignore_errors=True)
    root = work / "nbgrader"
    (root / "submitted" / student).mkdir(parents=True)
    os.symlink(run.course / "source", root / "source")
    shutil.copyfile(run.course / "nbgrader_config.py", root / "nbgrader_config.py")
    skipped = copy_submission(run.submitted / student / day, root / "submitted" / student / day, day)
    db = root / "gradebook.db"
    shutil.copyfile(run.course / "template.db", db)
    spec = make_spec(run.sandbox, work, run.hidden, limits=run.limits, uid=uid)
    spec.make_dirs()
    spec.write(work / "sandbox.json")
    child_env = {"DLO_PROFILE": run.profile, "DLO_GRADING": "1", "DLO_HEADLESS": "1",
                 SPEC_ENV: str(work / "sandbox.json"), **env}
    start = time.perf_counter()
    proc = None
    try:
        proc = autograde_and_feedback(root, db, day, student, env=child_env, timeout=run.notebook_timeout)
        status = "graded" if proc.returncode == 0 else "error: autograde failed"
    except TimeoutError:
        status = f"error: autograde took over {run.notebook_timeout:.0f} s"
    finally:
        # the sandbox's folders are not kept; the runner's log beside them (the student's output during checks) is
        for scratch in (spec.kernel_dir, spec.capture_dir, spec.runner_dir):
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - start
    if proc is not None and proc.returncode < 0:
        raise Killed(f"killed by {_signal_name(-proc.returncode)}")
    logs = run.course / "logs" / student / day
    if proc is not None and (proc.returncode != 0 or not (root / "feedback" / student / day).is_dir()):
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "autograde.log").write_text(proc.stdout + proc.stderr)
        if status == "graded":
            print(f"error: generate_feedback {student}/{day} failed (see course/logs/{student}/{day}); no feedback",
                  flush=True)
        else:
            status += f" (see course/logs/{student}/{day}/autograde.log)"
    record = {"student": student, "day": day, "status": status, "score": 0.0, "cells": {}, "seconds": round(seconds, 1),
              "attempts": attempt, "input": run.inputs.get((student, day), ""), "sandbox": run.sandbox, "final": True,
              "timeouts": 0, "kernel_deaths": 0, "skipped": skipped}
    if status == "graded":
        record.update(_keep(run, root, student, day, db))
    shutil.rmtree(root, ignore_errors=True)
    write_json(record_path(run.out, student, day), record)
    return record


def copy_submission(src: Path, dest: Path, day: str) -> list[str]:
    """The submission's regular files and folders into the grading scratch (its runs/ and caches left
    behind), never following a link nor opening a special file; what was skipped, as "data.txt (a
    symlink)", is also said at the top of the copied notebook, hence in the student's feedback."""
    skipped = files.copy_tree(src, dest, files.NOT_SUBMITTED)
    nb_path = dest / f"{day}.ipynb"
    if skipped and nb_path.is_file():
        import nbformat
        from nbformat.v4 import new_markdown_cell

        try:
            nb = nbformat.read(nb_path, as_version=4)
        except Exception:  # noqa: BLE001 - nbgrader reports an unreadable notebook itself
            return skipped
        note = new_markdown_cell("**Not graded** (only regular files and folders are read by the grader; links and "
                                 "special files are skipped): " + ", ".join(f"`{s}`" for s in skipped))
        if nb.get("nbformat_minor", 0) < 5:
            note.pop("id", None)
        nb.cells.insert(0, note)
        nbformat.write(nb, nb_path)
    return skipped


def _keep(run: Run, root: Path, student: str, day: str, db: Path) -> dict:
    """Move a graded submission's files from its scratch root into OUT; its scores and incidents."""
    for kind in ("autograded", "feedback"):
        dest = run.course / kind / student / day
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if (root / kind / student / day).is_dir():
            shutil.move(root / kind / student / day, dest)
    kept_db = run.course / "gradebooks" / day / f"{student}.db"
    kept_db.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(db, kept_db)
    copy_feedback(run.course, run.out / "feedback", student, day)
    score, cells = graded(kept_db, day, student) or (0.0, {})
    return {"score": score, "cells": cells, **incidents(run.course / "autograded" / student / day / f"{day}.ipynb")}


def incidents(nb: Path) -> dict:
    """Cells that hit the time limit, kernels that died and limits of the job reached, as the autograded
    notebook records them."""
    try:
        cells = json.loads(nb.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return {}
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    names = [o.get("ename") for o in errors]
    return {"timeouts": sum(n in TIMEOUT_ERRORS for n in names), "kernel_deaths": names.count("DeadKernelError"),
            "limits": sum(limits.is_note(str(o.get("evalue", ""))) for o in errors)}


def killed_record(run: Run, student: str, day: str, why: str) -> dict:
    """A submission whose grading process was killed twice: marked (0), graded again on resume."""
    record = {"student": student, "day": day, "status": f"error: grading process {why}, twice", "score": 0.0,
              "cells": {}, "seconds": 0.0, "attempts": 2, "input": run.inputs.get((student, day), ""),
              "sandbox": run.sandbox, "final": False, "timeouts": 0, "kernel_deaths": 0}
    write_json(record_path(run.out, student, day), record)
    return record


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ----------------------------------------------------------------------------- many submissions

def run(grading: Run, todo: list[tuple[str, str]], jobs: int, total: int, done: int, seconds: dict,
        arriving=None, drained=None) -> dict:
    """Grade `todo` with `jobs` workers, the longest expected (`seconds`) first; {(student, day): record}.
    `total`/`done` count the whole run (a resumed run starts with done > 0). KeyboardInterrupt (Ctrl-C,
    SIGTERM) stops every worker. `arriving`: (`dlo.harness.arrivals.Arrivals`, ready) of a run still making
    the submissions: each job waits for its own, then takes a slot (index, env) of the run's. `drained()` is
    called once the last job has its slot (cores are about to be idle)."""
    todo = order(todo, seconds)
    bar = Progress(todo, seconds, jobs, total, done)
    slots: queue.Queue[tuple[int, dict]] = queue.Queue()
    for s in range(jobs):
        slots.put((s, slot_env(s, jobs, grading.profile)))
    stop, lock, left = threading.Event(), threading.Lock(), set(todo)
    uids = limits.UidPool() if grading.limits is not None and grading.sandbox == "bwrap" and as_root() else None
    try:
        slot_uids = uids.lease(jobs) if uids else [UID] * jobs  # RLIMIT_NPROC counts per uid: one each
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None

    def work(key):
        taken = slots.get() if arriving is None else arriving[0].take(key, arriving[1])
        if taken is None:  # the run stopped, or did not make this notebook
            bar.left_out(key)
            with lock:
                left.discard(key)
            return None
        slot, env = taken
        bar.started(key)
        with lock:
            left.discard(key)
            if not left and drained is not None:
                drained()
        try:
            for attempt in (1, 2):
                try:
                    return grade_one(grading, *key, env, attempt, slot_uids[slot])
                except Killed as exc:
                    if stop.is_set() or (arriving is not None and arriving[0].stopped):
                        return None
                    if attempt == 2:
                        return killed_record(grading, *key, str(exc))
                    bar.say(f"{key[0]}/{key[1]}: its grading process was {exc}; trying once more")
        finally:
            (slots if arriving is None else arriving[0].slots).put(taken)

    records = {}
    old = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    pool = ThreadPoolExecutor(max_workers=jobs if arriving is None else max(jobs, len(todo)))  # waiting: a thread each
    bar.begin()
    try:
        pending = {pool.submit(work, key): key for key in todo}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                key = pending.pop(fut)
                rec = fut.result()
                if rec is not None:
                    records[key] = rec
                    bar.update(rec)
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        kill_children()
        pool.shutdown(wait=True)
        raise
    finally:
        bar.end()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        if uids is not None:
            uids.release()
    pool.shutdown()
    return records


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def summary(records: dict, wall: float, jobs: int, slowest: int = 5) -> str:
    """The end of a run: counts, the slowest notebooks, timeouts, kernels that died, failures."""
    recs = sorted(records.values(), key=lambda r: (-r["seconds"], r["student"], r["day"]))
    name = lambda r: f"{r['student']}/{r['day']}"  # noqa: E731
    failed = [f"{name(r)}: {r['status']}" for r in recs if r["status"] != "graded"]
    lines = [f"graded {len(recs)} submission(s) in {fmt_time(wall)} with {jobs} job(s), {len(failed)} failed",
             "slowest: " + (", ".join(f"{name(r)} {r['seconds']:.1f} s" for r in recs[:slowest]) or "-"),
             "timeouts: " + (", ".join(f"{name(r)} ({r['timeouts']} cell(s))" for r in recs if r.get("timeouts"))
                             or "none"),
             "kernels that died: " + (", ".join(f"{name(r)} ({r['kernel_deaths']})" for r in recs
                                                if r.get("kernel_deaths")) or "none")]
    lines.append("limits reached: " + (", ".join(f"{name(r)} ({r['limits']} cell(s))" for r in recs if r.get("limits"))
                                       or "none"))
    skipped = [f"{name(r)}: {', '.join(r['skipped'])}" for r in sorted(recs, key=name) if r.get("skipped")]
    lines.append("skipped (links and special files are never read): " + ("; ".join(skipped) or "none"))
    return "\n".join(lines + [f"failed: {f}" for f in failed])
