"""dlo.grading.api: what every day's checks are written against."""

from __future__ import annotations

import re
import traceback

import pytest

from dlo.grading.api import DirectSession, check, is_stub


def released(x, y):
    """The release's answer: nbgrader leaves only the docstring and the raise."""
    # YOUR CODE HERE
    raise NotImplementedError()


def bare(x):
    raise NotImplementedError


def started(x):
    print(x + 1)
    raise NotImplementedError()


def says_why(x):
    raise NotImplementedError("not yet")


class ReleasedEngine:
    def __init__(self, model):
        # YOUR CODE HERE
        raise NotImplementedError()


class StartedEngine:
    def __init__(self, model):
        self.model = model
        raise NotImplementedError()


@pytest.mark.parametrize("obj,stub", [(released, True), (bare, True), (ReleasedEngine, True), (started, False),
                                      (says_why, False), (StartedEngine, False), (len, False), (3, False)])
def test_a_stub_is_only_the_release_s_bare_raise(obj, stub):
    assert is_stub(obj) is stub


def test_a_stub_fails_on_ranks_without_starting_them(monkeypatch):
    import sys

    import dlo.distributed.launch  # noqa: F401 - the module, which the package's `launch` function hides

    launch_module = sys.modules["dlo.distributed.launch"]

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started for a stub")

    monkeypatch.setattr(launch_module, "launch", no_launch)
    with pytest.raises(AssertionError, match="released raised NotImplementedError on every rank"):
        DirectSession("check_x", ()).on_ranks(print, 2, (released,), {}, 10, "gloo")


# ----------------------------------------------------------------------------- the student's frames first

def _divides(x):
    return 1 / x


def _calls(fn):
    """A worker: the student's function on each rank."""
    return fn(0)


@check()
def check_divides(fn):
    fn(0)


def _grader_paths(text: str) -> list[str]:
    return [p for p in ("dlo/checks/", "dlo/grading/", "_worker.py", "launch.py") if p in text]


def test_a_direct_check_shows_the_student_s_frames_and_folds_the_grader_s():
    """What a notebook (and nbgrader's Validate) shows: the test cell's line, the student's frames,
    a note for the grader's (the @check wrapper, the check's source, the guard around the call)."""
    from dlo.checks import day1

    def adamw_step(param, *args, **hp):
        return _divides(0)
    with pytest.raises(ZeroDivisionError) as err:
        day1.check_adamw_step(adamw_step)
    frames = traceback.extract_tb(err.value.__traceback__)
    assert [f.name for f in frames[-2:]] == ["adamw_step", "_divides"]
    assert not _grader_paths("".join(f.filename for f in frames)), frames
    assert any(re.fullmatch(r"\(\d+ grader frames hidden\)", n) for n in err.value.__notes__)


def test_the_sandbox_sends_the_student_s_frames_first(sandbox):
    with pytest.raises(ZeroDivisionError) as err:
        sandbox.run(check_divides, _divides)
    tb = err.value.remote_traceback.splitlines()
    assert tb[0] == "in your code (most recent call last):" and "_divides" in tb[1]
    assert re.fullmatch(r"  \(\d+ grader frames? hidden\)", tb[-1]) and not _grader_paths("\n".join(tb))


def test_a_rank_s_error_names_the_exception_then_the_student_s_frames():
    with pytest.raises(AssertionError) as err:
        DirectSession("folded", ()).on_ranks(_calls, 2, (_divides,), {}, 120, "gloo")
    lines = str(err.value).splitlines()
    assert re.fullmatch(r"folded: rank \d raised ZeroDivisionError: division by zero", lines[0]), lines
    assert lines[1] == "in your code (most recent call last):" and any("_divides" in x for x in lines[2:])
    assert re.fullmatch(r"  \(\d+ grader frames? hidden\)", lines[-1]) and not _grader_paths(str(err.value))
