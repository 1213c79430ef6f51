"""The student's frames first: tracebacks as a notebook shows them, the grader's frames folded.

A check's failure names the student's code (the test cell's line, the student's frames, the libraries
it called); the frames of the grader (`grader_files`: the grading runtime, the checks, the launcher that
runs a check's ranks) are folded into a count. Used where the check raises (`fold_exception`), on a
rank's traceback text (`fold_traceback_text`) and in the sandboxed runner (`fold_frames`).
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

