"""`dlo run --grade DIR`: each notebook graded as soon as it has run, in the run's own slots.

Run, then grade, leaves cores idle three times: while the run's last notebook runs alone, while the
grading builds its course and starts its warm process, and while its last submission is graded alone.
Here the grading (`dlo.harness.grade.main`) starts with the run, in a thread of the same process, with
its submissions named up front:

1. `start`: the grading's own checks (its --out, the sandbox) run beside the run's (the parameters,
   the presets); either one's refusal stops both before anything is written (`begin` raises it);
2. `begin`: both passed; the grading claims its --out and builds its course while the first
   notebooks run;
3. each grading job waits for its notebook (`Arrivals.take`), then for a slot of the run: the same
   queue of (index, env) slots the notebooks take theirs from, so never more notebooks and gradings at
   once than the run's slots, each with its slot's share of the cores and GPUs;
4. `finish`: after the run, the grading's return code.

What is graded, and how, is what `dlo grade <the run's --out parent> --out DIR` would do after the
run: the run's --out folder is the one student (named as the folder) of its parent, which must hold
nothing else; an earlier grading in DIR is graded again (the notebooks are new).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from dlo.errors import BadInput


class Arrivals:
    """The submissions a run is still making, and the slots it shares with their grading (`go`)."""

    def __init__(self, student: str, days: list[str]):
        self.student, self.days = student, list(days)
        self.slots: queue.Queue | None = None  # the run's (index, env) slots, and how many, given at `go`
        self.count = 0
        self._made = {day: threading.Event() for day in days}
        self._stopped, self._go = threading.Event(), threading.Event()
        self.checked = threading.Event()  # set by `grade.main` once its input and --out are checked

    def submissions(self) -> tuple[list[str], list[str], dict]:
        """(students, days, {(student, day): "ok"}) as `submissions.find_submissions` gives them: the status
        is said again once each notebook exists (`take`'s check)."""
        return [self.student], sorted(self.days), {(self.student, d): "ok" for d in sorted(self.days)}

    def proceed(self) -> int | None:
        """On the grading's side, its checks passed: wait for the run's; the slots' count, None if stopped."""
        self.checked.set()
        self._go.wait()
        return None if self.stopped else self.count

    def go(self, slots: queue.Queue) -> None:
        """On the run's side, every check passed and no notebook started yet: the grading may write, and
        grade in these slots (counted now: the notebooks are about to take theirs)."""
        self.slots, self.count = slots, slots.qsize()
        self._go.set()

    def made(self, day: str) -> None:
        """The run is done with `day`'s notebook (whatever its status: the grading reads what it wrote)."""
        self._made[day].set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """The run was stopped or refused: no grading job waits any longer, none starts, the running ones
        are killed (as Ctrl-C in `dlo grade` kills them) and not tried again."""
        began = self._go.is_set()  # before `go` the grading has started no process (and may not: its check)
        self._stopped.set()
        for event in (*self._made.values(), self._go):
            event.set()
        if began:
            from dlo.harness.nbgrader_cli import kill_children

            kill_children()

    def take(self, key: tuple[str, str], ready) -> tuple[int, dict] | None:
        """A slot for grading `key` once its notebook is made and `ready(key)` (its folder read) says it can
        be graded; None when the run stopped or it cannot."""
        self._made[key[1]].wait()
        if self.stopped or not ready(key):
            return None
        slot = self.slots.get()
        if self.stopped:
            self.slots.put(slot)
            return None
        return slot


class Grading:
    """The grading thread of a run (`start`), what it returned (`result`) and its submissions."""

    def __init__(self, arrivals: Arrivals, thread: threading.Thread, result: list):
        self.arrivals, self.thread, self.result = arrivals, thread, result

    def begin(self, slots: queue.Queue) -> None:
        """The run's checks passed: wait for the grading's; BadInput if it refused (nothing written),
        else it goes on with the run's slots."""
        self.arrivals.checked.wait()
        if self.result and isinstance(self.result[0], BadInput):
            raise BadInput(f"--grade: {self.result[0].code}")
        self.arrivals.go(slots)

    def finish(self) -> int:
        """After the run: wait for its grading; its return code (1 if it failed)."""
        self.thread.join()
        return self.result[0] if self.result else 1  # a refusal (BadInput) came before `begin`, which raised it


def check_layout(out_dir: Path) -> None:
    """BadInput (before any notebook starts) unless the run's --out can be graded as one student's folder: its
    parent holds nothing else (that the grading's folder neither holds it nor lies inside it is `grade`'s
    own check, `submissions.check_paths`)."""
    parent = out_dir.parent
    others = sorted(p.name for p in parent.iterdir() if p.name != out_dir.name) if parent.is_dir() else []
    if others:
        raise BadInput(f"--grade grades {parent} as the submissions of one student ({out_dir.name}), but it also holds "
                       f"{', '.join(others[:5])}{' ...' if len(others) > 5 else ''}: give --out a folder of its own "
                       f"(e.g. runs/mine/submitted/{out_dir.name}) or grade afterwards with dlo grade")


def start(root: Path, out_dir: Path, days: list[str], grade_out: Path, profile: str, require_full: bool) -> Grading:
    """The grading of the run's notebooks, started in a thread (daemon: a stopped run does not wait for
    it); its checks run now, beside the run's, and it waits for `Grading.begin` before writing anything."""
    from dlo.harness import GRADE_CELL_TIMEOUT, GRADE_NOTEBOOK_TIMEOUT, grade

    check_layout(out_dir)
    arrivals = Arrivals(out_dir.name, days)
    result: list = []

    def grading() -> None:
        try:
            result.append(grade.main(root, str(out_dir.parent), str(grade_out), profile, GRADE_CELL_TIMEOUT,
                                     GRADE_NOTEBOOK_TIMEOUT, require_full, regrade=True, arrivals=arrivals))
        except BadInput as exc:
            result.append(exc)
        except BaseException as exc:  # noqa: BLE001 - said here: the run's thread reports the status
            print(f"dlo run --grade: the grading failed: {type(exc).__name__}: {exc}", flush=True)
            result.append(1)
        finally:
            arrivals.checked.set()

    thread = threading.Thread(target=grading, name="dlo-grade", daemon=True)
    thread.start()
    return Grading(arrivals, thread, result)
