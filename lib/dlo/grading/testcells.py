"""A graded test cell, run where the student's code cannot reach it.

The cell's source (the instructors', hidden tests included, read from the gradebook) never goes to the
student's kernel. The kernel only pickles the objects the cell names (`capture_code`); the cell then
runs here, in the grading process, with those names bound to handles of the objects living in the
sandboxed runner (`dlo.grading.trusted`), and its outputs are written as the checks produced them:
printed lines as stdout (never stderr: nbgrader would score that 0), a failure as an error output
whose traceback holds the message and, for an exception raised by the student's own code, that
code's traceback - never a line of the hidden tests.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import io
import json
import sys
import warnings
from pathlib import Path

from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from dlo.grading import files

# Modules a test cell may name directly (bound here, not taken from the student's kernel).
MODULES_OK = ("torch", "numpy", "math", "random", "dlo", "cmath", "statistics", "itertools", "functools",
              "collections", "operator")


def free_names(source: str) -> list[str]:
    """Names the cell reads but never assigns, other than builtins and `dlo` (bound by the grader)."""
    tree = ast.parse(source)
    loaded, stored = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded.append(node.id) if isinstance(node.ctx, ast.Load) else stored.add(node.id))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            stored.add(node.name)
    skip = stored | set(dir(builtins)) | {"dlo"}
    return sorted({n for n in loaded if n not in skip})


def capture_code(names: list[str], folder: Path) -> str:
    """Code for the student's kernel: each named object into folder/<name>.data when it is plain data
    (`dlo.grading.wire`, read here without unpickling), else folder/<name>.pkl (`dlo.pickling`, by value,
    read only by the sandboxed runner); folder/report.json says which, or why a name could not be
    sent. Runs silently, leaves no name behind."""
    return f'''
def __dlo_capture(names, folder):
    import json, os, types
    from dlo.pickling import dumps
    user_ns = get_ipython().user_ns
    report = {{}}
    for name in names:
        if name not in user_ns:
            report[name] = "not defined"
            continue
        value = user_ns[name]
        if isinstance(value, types.ModuleType):
            report[name] = {{"module": value.__name__}}
            continue
        try:  # plain data (a number, a list, tensors) crosses as data, readable without unpickling
            from dlo.grading.wire import encode
            data = encode(value)
        except BaseException:
            data = None
        if data is not None:
            with open(os.path.join(folder, name + ".data"), "wb") as f:
                f.write(data)
            report[name] = "data"
            continue
        try:
            data = dumps(value)  # the cells' names and lines kept for the feedback's tracebacks
        except BaseException as exc:
            report[name] = ("could not be sent to the grader: " + type(exc).__name__ + ": " + str(exc))[:400]
            continue
        with open(os.path.join(folder, name + ".pkl"), "wb") as f:
            f.write(data)
        report[name] = "ok"
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(report, f)
try:
    __dlo_capture({names!r}, {str(folder)!r})
finally:
    del __dlo_capture
'''


class CaptureFailed(Exception):
    """A name the cell uses is missing in the student's notebook or could not be pickled."""

    def __init__(self, ename: str, evalue: str):
        super().__init__(evalue)
        self.ename, self.evalue = ename, evalue


def bindings(names: list[str], folder: Path, backend) -> dict:
    """The cell's namespace entries from the capture folder; CaptureFailed for the first bad name.
    The report is the student's kernel's word: it is read as data, and a handle only exists for a
    pickle that is there."""
    try:
        report = json.loads(_read(folder, "report.json", limit=1 << 20))
    except (OSError, ValueError):
        report = {}
    if not isinstance(report, dict):
        report = {}
    out = {}
    for name in names:
        status = report.get(name)
        if status == "ok" and files.is_regular(folder.parent, folder.name, f"{name}.pkl"):
            out[name] = backend.captured(name, folder / f"{name}.pkl")  # read in the sandbox only
        elif status == "data" and files.is_regular(folder.parent, folder.name, f"{name}.data"):
            out[name] = _data(name, folder)
        elif isinstance(status, dict) and isinstance(status.get("module"), str):
            out[name] = _module(name, status["module"])
        elif status == "not defined":
            raise CaptureFailed("NameError", f"name {name!r} is not defined (run the cell that defines it)")
        elif isinstance(status, str) and status.startswith("could not be sent"):
            raise CaptureFailed("RuntimeError", f"{name} {status[:400]}")
        else:
            raise CaptureFailed("RuntimeError", f"{name} could not be sent to the grader (the kernel gave no answer)")
    return out


def _read(folder: Path, name: str, limit: int | None = None) -> bytes:
    """A file the student's kernel wrote into the capture folder: a regular file inside `folder`,
    inside the grader's capture folder, reached without following a link (a link to the instructors'
    files or a fifo is refused, never read)."""
    return files.read_file(folder.parent, folder.name, name, limit=limit)


def _data(name: str, folder: Path):
    from dlo.grading.wire import decode

    try:
        return decode(_read(folder, f"{name}.data"))  # JSON and raw tensor bytes: no unpickling
    except (OSError, ValueError) as exc:
        raise CaptureFailed("RuntimeError", f"{name} could not be read by the grader ({exc})") from None


def _module(name: str, module: str):
    top = module.split(".")[0]
    if module in sys.modules or top in MODULES_OK:
        with contextlib.suppress(ImportError):
            return importlib.import_module(module)
    raise CaptureFailed("RuntimeError", f"{name} is the module {module[:80]!r}, which the grader does not import")


def run_cell(source: str, names: dict, backend) -> list[NotebookNode]:
    """Execute the instructors' test cell here, with `names` bound; the cell's outputs."""
    import dlo
    import dlo.checks  # noqa: F401 - the test cells call dlo.checks.<day>.check_...
    from dlo.grading.api import use_backend

    ns = {"__name__": "__dlo_test_cell__", "__builtins__": builtins, "dlo": dlo, **names}
    out, error = io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings(), \
            use_backend(backend):
        warnings.simplefilter("ignore")  # a library warning is not the student's failure (nor stdout noise)
        try:
            exec(compile(source, "<test cell>", "exec"), ns)  # noqa: S102 - the instructors' own cell
        except BaseException as exc:  # noqa: BLE001 - every failure is the cell's verdict
            error = exc
        finally:
            with contextlib.suppress(Exception):
                backend.end_cell()
    outputs = []
    if out.getvalue():
        outputs.append(NotebookNode(output_type="stream", name="stdout", text=out.getvalue()))
    if error is not None:
        outputs.append(error_output(type(error).__name__, _message(error), _student_traceback(error)))
    return outputs


def error_output(ename: str, evalue: str, extra: list[str] | None = None) -> NotebookNode:
    return NotebookNode(output_type="error", ename=ename, evalue=evalue,
                        traceback=[f"{ename}: {evalue}", *(extra or [])])


def _message(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "the checks of this cell did not finish in time; the grader stopped your code"
    try:
        return str(exc)
    except Exception:  # noqa: BLE001
        return f"<{type(exc).__name__}>"


def _student_traceback(exc: BaseException) -> list[str]:
    """The frames of an exception the student's code raised in the sandbox, as the runner sent them:
    the student's code first, the grader's frames folded into a count (no test cell line)."""
    tb = getattr(exc, "remote_traceback", "")
    if not tb or isinstance(exc, AssertionError):
        return []
    return ["", *tb.rstrip().splitlines()[:40]]


class StripHiddenTests(NbGraderPreprocessor):
    """Feedback preprocessor: drop the hidden-test regions of graded cells (an unterminated region
    runs to the end of the cell). Unlike nbgrader's ClearHiddenTests it never fails a student's
    feedback over a marker typed in another cell."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = strip_hidden(cell.source)
        return cell, resources


def strip_hidden(source: str, begin: str = "BEGIN HIDDEN TESTS", end: str = "END HIDDEN TESTS") -> str:
    kept, hidden = [], False
    for line in source.split("\n"):
        if begin in line:
            hidden = True
        elif end in line and hidden:
            hidden = False
        elif not hidden:
            kept.append(line)
    return "\n".join(kept)
