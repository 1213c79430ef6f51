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


# ----------------------------------------------------------------------------- the grader's own errors

def _student(source: str, name: str):
    """A function as a notebook cell defines it (its frames are the student's: "<cell>")."""
    ns: dict = {}
    exec(compile(source, "<cell 7>", "exec"), ns)  # noqa: S102 - the test's own source
    return ns[name]


@check()
def check_looks_up(fn):
    """A check with a bug of its own: it looks the student's (right) answer up in a table that lacks it."""
    return {"tcp": 1}[fn(0)]


@pytest.fixture
def grader_here(monkeypatch):
    """This file's frames count as the grader's (as dlo/checks/'s do), so that its checks can have bugs."""
    from dlo.grading import frames

    files = frames.grader_files()
    monkeypatch.setattr(frames, "grader_files", lambda: files | {__file__.removesuffix("c")})


def _returns_wire(x):
    return "wire"


def test_a_check_s_own_error_is_reported_as_the_grader_s_not_the_student_s(grader_here):
    """A KeyError in a check's comparison used to reach the student as `KeyError: 'wire'`, "(5 grader
    frames hidden)": the message now says that the check failed, not the student's code."""
    from dlo.grading.frames import GraderError

    with pytest.raises(GraderError, match=r"looks_up: internal error of the check, not of your code \(KeyError: "
                                          r"'wire', raised by the grader at test_common.py:\d+, in check_looks_up\): "
                                          r"if what your code returns is of the type and shape the exercise "
                                          r"asks, tell your instructor"):
        check_looks_up(_student("def answer(x):\n    return 'wire'\n", "answer"))


def test_the_student_s_own_exception_stays_the_student_s(grader_here):
    with pytest.raises(KeyError, match="mine"):
        check_looks_up(_student("def answer(x):\n    return {}['mine']\n", "answer"))
    with pytest.raises(AssertionError):  # a verdict is never relabelled
        check_divides(_student("def answer(x):\n    assert x, 'zero'\n", "answer"))


def test_what_the_student_s_code_returned_is_not_the_grader_s_fault(grader_here):
    from dlo.grading.api import run_student

    @check()
    def check_worker(fn):
        return run_student(_calls, fn)
    with pytest.raises(TypeError, match="plain data only"):
        check_worker(_student("def answer(x):\n    return object()\n", "answer"))


def test_the_sandbox_reports_a_check_s_own_error_as_the_grader_s(sandbox, grader_here):
    from dlo.grading.frames import GraderError

    with pytest.raises(GraderError, match="internal error of the check, not of your code"):
        sandbox.run(check_looks_up, _returns_wire)
    with pytest.raises(ZeroDivisionError):
        sandbox.run(check_divides, _divides)


def test_a_worker_s_own_error_on_the_ranks_is_reported_as_the_grader_s():
    """A rank's worker that fails before the student's code runs (here: a part of the case it lacks) is the
    grader's bug: the student used to read `rank 0 raised KeyError: 'net'`."""
    from dlo.checks import day4
    from dlo.grading.frames import GraderError

    with pytest.raises(GraderError, match=r"bucket_ddp: internal error of the check, not of your code \(KeyError: "
                                          r"'net', raised by the grader at day4.py:\d+, in _bucket_run\)"):
        DirectSession("bucket_ddp", ()).on_ranks(day4._bucket_worker, 2, (dict,), {}, 120, "gloo", per_rank=[{}, {}])


def _many_calls(fn, n):
    return [fn(i) for i in range(n)]


def test_a_worker_s_calls_of_the_student_s_function_are_guarded_once_and_still_refuse(monkeypatch):
    """A direct check's worker runs guarded and sealed (`api.run_worker`): the student's function it calls
    once per step is not blocked and sealed again per call (Day 1's schedule checks: ~1 ms a call), yet a
    forbidden reference called there is refused, and the check's own call outside the worker is guarded."""
    import dlo.schedules
    from dlo.grading import forbid
    from dlo.grading.api import run_student
    from dlo.grading.forbid import ForbiddenCall

    entered = []
    real = forbid.forbidden

    def counting(*args, **kwargs):
        entered.append(args[0])
        return real(*args, **kwargs)
    from dlo.grading import api

    monkeypatch.setattr(forbid, "forbidden", counting)  # Guarded's
    monkeypatch.setattr(api, "forbidden", counting)  # run_worker's
    paths = ("dlo.schedules.warmup_cosine",)

    @check(forbid=paths)
    def check_steps(fn):
        return run_student(_many_calls, fn, 50)

    assert check_steps(lambda step: step * 2) == [2 * i for i in range(50)]
    assert len(entered) == 1  # the worker's block, not one per call
    with pytest.raises(ForbiddenCall, match="off limits"):
        check_steps(lambda step: dlo.schedules.warmup_cosine(step, base_lr=1.0, warmup_steps=1, total_steps=9))

    @check(forbid=paths)
    def check_called_here(fn):
        assert not forbid.guarding(paths, "called_here")
        return fn(3)

    entered.clear()
    assert check_called_here(lambda step: step + 1) == 4
    assert len(entered) == 1  # the check's own call of the student's function: guarded by itself
    with pytest.raises(ForbiddenCall, match="off limits"):
        check_called_here(lambda step: dlo.schedules.warmup_cosine(step, base_lr=1.0, warmup_steps=1, total_steps=9))


def test_assert_close_matches_equal_infinities_only():
    """An infinity equal to the expected one is no error (inf - inf would be nan, counted as infinite); the
    other sign, a finite value or nan where -inf is expected still fails (Day 10's merge keeps lse = -inf)."""
    import math

    import torch

    from dlo.grading.compare import assert_close, need_dtype

    want = torch.tensor([-math.inf, 1.0, math.inf], dtype=torch.float64)
    assert_close("t", "x", want.clone(), want)
    for bad in (math.inf, -1e300, math.nan):
        got = want.clone()
        got[0] = bad
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_close("t", "x", got, want)
    with pytest.raises(AssertionError, match="x is float32, expected the inputs' float64"):
        need_dtype("t", "x", want.float(), torch.float64, {}, "the inputs' ")
    with pytest.raises(AssertionError, match="x must be a int64 tensor, got list"):
        need_dtype("t", "x", [1], torch.int64, {})


def _checks_drawing_from_the_public_seed() -> list[str]:
    """The checks whose own source seeds a generator from `seed` without `case_seed`."""
    import importlib
    import inspect
    import pkgutil

    import dlo.checks

    found = []
    for info in pkgutil.iter_modules(dlo.checks.__path__):
        module = importlib.import_module(f"dlo.checks.{info.name}")
        for name, fn in vars(module).items():
            if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                src = inspect.getsource(inspect.unwrap(fn))
                if re.search(r"(Random|manual_seed)\(seed\b", src) and "case_seed" not in src:
                    found.append(f"{module.__name__}.{name}")
    return found


def test_every_check_draws_its_cases_from_case_seed():
    """Graded, `case_seed` makes the cases secret; drawn from the public seed, a table of answers recorded in
    an earlier cell (the library's reference is off limits only while the check runs) got full marks (Day 7's
    comm_compute; Days 1, 2, 3, 6 and 8 drew theirs so until 2026-11-30)."""
    assert _checks_drawing_from_the_public_seed() == []
