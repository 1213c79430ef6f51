"""The student's frames first: tracebacks as a notebook shows them, the grader's frames folded.

A check's failure names the student's code (the test cell's line, the student's frames, the libraries
it called); the frames of the grader (`grader_files`: the grading runtime, the checks, the launcher that
runs a check's ranks) are folded into a count. Used where the check raises (`fold_exception`), on a
rank's traceback text (`fold_traceback_text`) and in the sandboxed runner (`fold_frames`). A failure that
is the grader's own (`grader_fault`: no student frame below the check) becomes a `GraderError` that says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
import types


def grader_files() -> set[str]:
    """The files whose frames are the grader's, not the student's: the grading runtime (this package,
    the sealing among it), the checks, and the launcher that runs a check's ranks."""
    import dlo.distributed

    here = os.path.dirname(os.path.abspath(__file__))
    dist_dir = os.path.dirname(os.path.abspath(dlo.distributed.__file__))
    return {here, os.path.join(os.path.dirname(here), "checks")} | {
        os.path.join(dist_dir, f) for f in ("launch.py", "_worker.py", "_spawn.py", "_ranks.py")}


def is_grader_frame(filename: str, extra: tuple[str, ...] = ()) -> bool:
    path = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
    files = grader_files()
    return path in files or os.path.dirname(path) in files or any(path.endswith(e) for e in extra)


def fold_frames(frames: list, extra: tuple[str, ...] = ()) -> list[str]:
    """Formatted frames (traceback.FrameSummary), the grader's left out: the student's code and the
    libraries it called, then one line saying how many of the grader's frames were hidden."""
    kept = [f for f in frames if not is_grader_frame(f.filename, extra)]
    lines = traceback.format_list(kept)
    hidden = len(frames) - len(kept)
    return lines + ([f"  ({hidden} grader frame{'s' * (hidden != 1)} hidden)\n"] if hidden else [])


_FRAME_LINE = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.*)$')


def fold_traceback_text(text: str, extra: tuple[str, ...] = ()) -> str:
    """A formatted traceback (a rank's, as text) with the exception first, then the frames of the
    student's code (and of the libraries it called), the grader's frames folded into a count:

        ForbiddenCall: zero1: dlo.distributed.zero._Sharded is off limits ...
        in your code (most recent call last):
          File "<cell 12>", line 4, in __init__
            super().__init__(module)
          (4 grader frames hidden)

    Text that is not a traceback comes back as it is."""
    lines = text.rstrip("\n").split("\n")
    if not lines or not lines[0].startswith("Traceback (most recent call last):"):
        return text
    frames: list[list[str]] = []  # [header, source lines...]
    i = 1
    while i < len(lines) and _FRAME_LINE.match(lines[i]):
        frame = [lines[i]]
        i += 1
        while i < len(lines) and lines[i].startswith("    "):
            frame.append(lines[i])
            i += 1
        frames.append(frame)
    error = "\n".join(lines[i:])
    kept = [f for f in frames if not is_grader_frame(_FRAME_LINE.match(f[0])["file"], extra)]
    hidden = len(frames) - len(kept)
    out = [error]
    if kept:
        out.append("in your code (most recent call last):")
        out += [line for f in kept for line in f]
    if hidden:
        out.append(f"  ({hidden} grader frame{'s' * (hidden != 1)} hidden)")
    return "\n".join(out)


def _pruned(tb) -> tuple[object, int]:
    """A traceback chain without the grader's frames, and how many it left out."""
    frames, hidden = [], 0
    while tb is not None:
        if is_grader_frame(tb.tb_frame.f_code.co_filename):
            hidden += 1
        else:
            frames.append(tb)
        tb = tb.tb_next
    new = None
    for t in reversed(frames):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new, hidden


def fold_exception(exc: BaseException) -> None:
    """The exception a check raises, as a notebook shows it: the test cell's line and the student's
    frames, the grader's folded into a note."""
    if getattr(exc, "__dlo_folded__", False):
        return
    tb, hidden = _pruned(exc.__traceback__)
    if hidden:
        exc.__traceback__ = tb
        with contextlib.suppress(Exception):
            exc.add_note(f"({hidden} grader frame{'s' * (hidden != 1)} hidden)")
    with contextlib.suppress(Exception):
        exc.__dlo_folded__ = True



# ----------------------------------------------------------------------------- the grader's own errors

class GraderError(RuntimeError):
    """A check failed by its own fault (a KeyError in its comparison, a reference that raised), not by
    the student's code: the message says so, so that a student does not rewrite correct code."""


def _library_dirs() -> tuple[str, ...]:
    """Where code that is neither the student's nor the grader's lives: the standard library, the
    installed packages, and dlo itself (a reference the check calls is the grader's side too)."""
    import sysconfig

    import dlo

    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.abspath(p) + os.sep for p in paths | {os.path.dirname(dlo.__file__)} if p)


def _is_students(filename: str) -> bool:
    if filename.startswith("<frozen") or filename == "<test cell>":
        return False
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not is_grader_frame(filename) and not path.startswith(_library_dirs())


def grader_fault(exc: BaseException) -> str | None:
    """Where the grader's own code raised `exc`, or None when the failure is the student's: an
    assertion (a check's verdict), an exception the student's code raised (a frame of it below the
    check, or one rebuilt from the sandbox: `remote_traceback`), a timeout, memory, or one the grader
    raised about the student's objects on purpose (`student_side`). What is left was raised with no
    student frame between the check and the raise: the check's own bug."""
    if not isinstance(exc, Exception) or isinstance(exc, (AssertionError, TimeoutError, MemoryError, EOFError,
                                                          NotImplementedError)):
        return None
    if hasattr(exc, "remote_traceback") or getattr(exc, "student_side", False):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    first = next((i for i, f in enumerate(frames) if is_grader_frame(f.filename)), None)
    if first is None or any(_is_students(f.filename) for f in frames[first:]):
        return None
    last = next(f for f in reversed(frames) if is_grader_frame(f.filename))
    return f"{os.path.basename(last.filename)}:{last.lineno}, in {last.name}"


def as_grader_error(exc: BaseException, name: str) -> GraderError | None:
    """`exc` as the student reads it when it is the grader's fault (`grader_fault`), else None."""
    where = grader_fault(exc)
    if where is None:
        return None
    return GraderError(f"{name}: internal error of the check, not of your code ({type(exc).__name__}: {exc}, raised "
                       f"by the grader at {where}): if what your code returns is of the type and shape the exercise "
                       f"asks, tell your instructor; your code may well be right")


def grader_error_text(text: str) -> str:
    """The message of a GraderError a rank raised, from its traceback text ("" if it raised another)."""
    prefix = f"{GraderError.__module__}.{GraderError.__qualname__}: "
    last = next((line for line in reversed(text.rstrip().splitlines()) if line.startswith(prefix)), "")
    return last.removeprefix(prefix)
