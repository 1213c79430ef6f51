"""nbgrader's Execute preprocessor, made to grade what a student's code cannot bend.

**Test cells are not run by the student's kernel.** For every graded test cell (its source is the
instructors', read from the gradebook), the kernel only pickles the objects the cell names into the
capture folder; the cell itself runs in this process (`dlo.grading.testcells`) with those names bound
to handles of objects living in a sandboxed runner (`dlo.grading.trusted`): the student's code runs
there, the comparison with the reference happens here, and the cell's outputs are what the checks
printed (stdout) and, on failure, an error. nbgrader then scores as usual: error -> 0, else the points.

**The kernel runs in the sandbox** (`dlo.grading.jail`: bubblewrap, unless `dlo grade --no-sandbox`)
with its own scratch folder as working directory, out of sight of the solutions, the gradebook and the
other submissions, its channels Unix sockets (the sandbox has a network of its own). Grading as root,
what the grader makes for it (capture folders, the files beside the notebook) is handed to its uid.

**A student cell that kills its kernel or hangs while ignoring interrupts** costs only what depends on
it: the cell gets an error, a fresh kernel starts, the cells before it are replayed silently (except
test cells, which the kernel never runs, and earlier cells that killed or hung a kernel), and grading
goes on. A cell that hangs but obeys SIGINT is interrupted by nbclient as before.

**A limit of the job reached** (`dlo.grading.limits`: memory, processes, a file's size, a tmpfs) is
named in the outputs of the cell that reached it; a graded cell during which the job's watch had to
stop a process over the memory limit (`dlo.grading.jobwatch`) fails.

**The code cells after the last graded cell are not run** unless `full_notebook` (`dlo grade
--full-notebook`): they cannot change a score (`dlo.harness.graded`), and each gets a note saying so.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync
from nbformat.notebooknode import NotebookNode
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.preprocessors import Execute
from traitlets import Bool

from dlo.grading import files, limits, testcells
from dlo.grading.jail import make_spec, probe, spec_from_env
from dlo.grading.jail_kernel import SandboxedKernelManager
from dlo.grading.jobwatch import JobWatch
from dlo.harness import graded

# the grading kernel's first code (silent, no history)
SEAL = "import dlo.grading.seal\ndlo.grading.seal.seal()\ndel dlo"


class ResilientExecute(Execute):
    max_kernel_deaths = 3  # a notebook that keeps killing kernels is not worth more replays
    full_notebook = Bool(True, help="run every cell; False: the code cells after the last graded cell are "
                                    "left out, each with a note (they cannot change a score)").tag(config=True)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)

    def preprocess(self, nb, resources=None, km=None):
        self._deaths, self._skip, self._captures = 0, set(), 0
        self._own_scratch = None
        spec = spec_from_env()
        if spec is None:  # nbgrader called directly: no hiding known, a scratch of our own
            self._own_scratch = tempfile.mkdtemp(prefix="dlo-grade-")
            spec = make_spec(probe(), Path(self._own_scratch), hidden=[])
        spec.make_dirs()
        self._spec = spec
        _copy_extra_files(resources, spec.kernel_dir)
        spec.hand_over(spec.kernel_dir, tree=True)  # before the kernel starts
        self._limits = spec.job_limits
        self._watch = JobWatch(self._limits.memory) if self._limits is not None else None
        self._tests = trusted_test_cells(resources)
        self._last = len(nb.cells) if self.full_notebook else graded.last_graded_index(nb, self._tests)
        self._backend = self._warming = None
        if self._tests:  # torch, the checks and the runner start while the kernel runs the first cells
            self.start_warming(spec)
        try:
            with self._watch or contextlib.nullcontext():
                return super().preprocess(nb, resources, km)
        finally:
            self.end_warming()
            if self._own_scratch:
                shutil.rmtree(self._own_scratch, ignore_errors=True)

    def start_warming(self, spec) -> None:
        """Import the checks and start the sandboxed runner of `spec` in a thread (both mostly wait, as the
        kernel's start does). The thread lives until `end_warming`: bwrap's --die-with-parent is
        PR_SET_PDEATHSIG, whose parent is the *thread* that forked bwrap (prctl(2)). A thread that ended once
        the runner had started killed the runner's bwrap when it ended after bwrap's prctl, and not when it
        ended before: at random, a runner started twice, and a sandbox orphaned."""
        self._spec, self._warm_error = spec, ""
        self._warmed, self._release = threading.Event(), threading.Event()
        self._warming = threading.Thread(target=self._warm, name="dlo-warm-runner", daemon=True)
        self._warming.start()

    def backend(self):
        """The sandboxed backend once warmed (`start_warming`); None if it could not start."""
        self._warmed.wait()
        return self._backend

    def end_warming(self) -> None:
        """The backend closed (its runner ends by itself, its ranks' CPU time counted), then its thread let go:
        in that order, or the thread's end would kill the runner's bwrap first."""
        if self._warming is None:
            return
        self._warmed.wait()
        if self._backend is not None:
            self._backend.close()
        self._release.set()
        self._warming.join()
        self._warming = None

    def _warm(self) -> None:
        try:
            import dlo.checks  # noqa: F401 - what the test cells call
            from dlo.grading.trusted import SandboxBackend

            spec = self._spec
            # the log beside the scratch folders, not in one: nothing in the sandbox can name it
            backend = SandboxBackend(prefix=spec.runner_prefix(), log=spec.runner_log,
                                     env=spec.env(spec.runner_dir), cwd=spec.runner_dir, captures=spec.captured_dir)
            backend.warm()
            self._backend = backend
        except Exception as exc:  # noqa: BLE001 - reported in every test cell, graded 0: the instructor sees it
            self.log.error("the grader's sandbox did not start: %s", exc)
            self._warm_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._warmed.set()
        self._release.wait()  # the runner's bwrap dies with this thread (above)

    async def async_start_new_kernel_client(self):
        """A kernel client, once the kernel has sealed the grader's modules (`dlo.grading.seal`) for good: from
        the first student cell on, `import dlo.checks.<day>` gives a placeholder, never the checks'
        references or test benches. After a restart too."""
        kc = await super().async_start_new_kernel_client()
        reply = await self.async_wait_for_reply(kc.execute(SEAL, silent=True, store_history=False))
        if not reply or reply.get("content", {}).get("status") != "ok":
            self.log.warning("the kernel did not seal the grader's modules: %s", (reply or {}).get("content"))
        return kc

    start_new_kernel_client = run_sync(async_start_new_kernel_client)

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        if isinstance(km, SandboxedKernelManager):
            km.spec = self._spec
        return km

    def preprocess_cell(self, cell, resources, index):
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        start = time.monotonic()
        if cell.cell_type == "code" and gid in self._tests:
            self._grade(cell, index, self._tests[gid])
            self._name_limits(cell, start, "the checks of this cell")
            return cell, self.resources
        if graded.skipped(cell, index, self._last):
            cell.outputs, cell.execution_count = [graded.skipped_output()], None
            return cell, self.resources
        try:
            done = super().preprocess_cell(cell, resources, index)
        except (DeadKernelError, CellTimeoutError) as exc:
            self._skip.add(index)
            cell.outputs.append(_lost_kernel_output(exc, self.timeout))
            self._name_limits(cell, start, "this cell")
            self._recover(index, exc)
            return cell, self.resources
        self._name_limits(cell, start, "this cell")
        return done

    def _name_limits(self, cell, start: float, what: str) -> None:
        """The job's limit each error of the cell reached, named in it; a process stopped by the job's watch
        meanwhile fails the cell."""
        if self._limits is not None and cell.cell_type == "code":
            killed = self._watch.since(start)
            limits.name_limits(cell.outputs, self._limits, what, killed, testcells.error_output)

    # ------------------------------------------------------------------------- graded test cells

    def _grade(self, cell, index: int, source: str) -> None:
        cell.outputs, cell.execution_count = [], None
        try:
            names = testcells.free_names(source)
        except SyntaxError as exc:
            cell.outputs = [testcells.error_output("SyntaxError", f"the test cell does not parse: {exc}")]
            return
        self._captures += 1
        folder = self._spec.capture_dir / f"cell{index}-{self._captures}"
        folder.mkdir(parents=True)
        self._spec.hand_over(folder)  # the kernel writes the pickles there
        if names and not self._capture(names, folder, index):
            cell.outputs = [testcells.error_output(
                "CellTimeoutError", "the grader could not get your objects from the kernel: pickling them did not "
                "finish in time (the kernel was restarted)")]
            return
        if self.backend() is None:
            cell.outputs = [testcells.error_output("RuntimeError", f"the grader's sandbox did not start "
                                                   f"({self._warm_error}); tell your instructor")]
            return
        try:
            bound = testcells.bindings(names, folder, self._backend)
        except testcells.CaptureFailed as exc:
            cell.outputs = [testcells.error_output(exc.ename, exc.evalue)]
            return
        self._backend.deadline = time.monotonic() + (self.timeout or 3600)
        try:
            cell.outputs = testcells.run_cell(source, bound, self._backend)
        finally:
            self._backend.deadline = None

    def _capture(self, names: list[str], folder: Path, index: int) -> bool:
        """Run the capture snippet in the kernel; False (and a fresh kernel) when it hung."""
        try:
            msg_id = self.kc.execute(testcells.capture_code(names, folder), silent=True, store_history=False)
            reply = self.wait_for_reply(msg_id)
        except (DeadKernelError, CellTimeoutError) as exc:
            self._recover(index, exc)
            return (folder / "report.json").exists()
        if reply is None:  # timed out; the interrupt may have been ignored
            self._recover(index, CellTimeoutError("capture"))
            return False
        return True

    # ------------------------------------------------------------------------- lost kernels

    def _recover(self, index: int, exc: Exception) -> None:
        self._deaths += 1
        self.log.warning("kernel lost in cell %d (%s); restarting and replaying the cells before it",
                         index, type(exc).__name__)
        if self._deaths > self.max_kernel_deaths:
            raise exc
        self._restart_and_replay(index)

    def _restart_and_replay(self, index: int) -> None:
        self._kill_kernel()
        self.km = self.create_kernel_manager()
        self.start_new_kernel()
        self.start_new_kernel_client()
        for i, cell in enumerate(self.nb.cells[:index]):
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if cell.cell_type != "code" or i in self._skip or gid in self._tests:
                continue
            try:
                # A copy: replayed outputs must not replace what the first execution recorded.
                self.execute_cell(copy.deepcopy(cell), i, store_history=False)
            except (DeadKernelError, CellTimeoutError) as exc:
                self._skip.add(i)
                self._recover(index, exc)
                return

    def _kill_kernel(self) -> None:
        try:
            self.kc.stop_channels()
        except Exception:  # noqa: BLE001 - the channels of a dead kernel may be half gone
            pass
        try:  # the manager is async: its calls are awaited here
            run_sync(self.km.shutdown_kernel)(now=True)  # SIGKILL: a kernel ignoring SIGINT/SIGTERM goes too
        except Exception:  # noqa: BLE001
            pass
        try:
            run_sync(self.km.cleanup_resources)()
        except Exception:  # noqa: BLE001
            pass


def _lost_kernel_output(exc: Exception, timeout) -> NotebookNode:
    if isinstance(exc, DeadKernelError):
        return testcells.error_output("DeadKernelError", "the kernel died while running this cell (os._exit, a "
                                      "crash, or out of memory); the grader restarted it and went on")
    return testcells.error_output("CellTimeoutError", f"this cell ran for more than {timeout} s and did not stop "
                                  f"when interrupted; the grader restarted the kernel and went on")


def trusted_test_cells(resources) -> dict[str, str]:
    """{grade_id: source} of the notebook's autograded test cells, from the gradebook (the instructors'
    notebook): a cell a student added or relabelled is never run outside the kernel."""
    meta = (resources or {}).get("nbgrader") or {}
    if not all(k in meta for k in ("db_url", "assignment", "notebook")):
        return {}
    out = {}
    with Gradebook(meta["db_url"]) as gb:
        try:
            nb = gb.find_notebook(meta["notebook"], meta["assignment"])
        except MissingEntry:
            return {}
        solutions = {c.name for c in nb.solution_cells}
        for gc in nb.grade_cells:
            if gc.cell_type != "code" or gc.name in solutions:
                continue
            src = gb.find_source_cell(gc.name, meta["notebook"], meta["assignment"])
            out[gc.name] = src.source
    return out


def _copy_extra_files(resources, dest: Path) -> None:
    """The files beside the notebook (data a student submitted with it, instructors' extras) into the
    kernel's working directory, which is not the autograded folder (that one ends up in the output)."""
    path = ((resources or {}).get("metadata") or {}).get("path")
    if not path or not Path(path).is_dir():
        return
    for rel, fd, why in files.walk(path):
        top = rel.split("/", 1)[0]
        if why is not None or top.startswith(".") or (top == rel and rel.endswith(".ipynb")):
            continue  # links and special files are not followed (`dlo grade` named them in the feedback)
        if fd is None:
            (dest / rel).mkdir(exist_ok=True)
        else:
            with open(dest / rel, "wb") as out:
                while chunk := os.read(fd, files.CHUNK):
                    out.write(chunk)
