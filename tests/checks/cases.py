"""The tests every day's checks get, made from the day's table of cases (one way, for Days 8-11).

A day's test module lists its exercises as `CASES = [(check, good, bads), ...]`: `good` the arguments of a
correct answer, each of `bads` a wrong answer's arguments, or `(arguments, slip)` where `slip` is a piece of
the message that must name the mistake. Arguments are a tuple, or one callable. Then, at module level:

    test_reference_passes = cases.reference_passes(CASES)
    test_wrong_versions_fail_and_are_named = cases.wrong_versions_fail(CASES)
    test_library_is_refused = cases.library_refused([(check, library_args), ...], ids)
    test_reference_passes_sandboxed = cases.reference_passes_sandboxed(CASES)
    test_wrong_fails_sandboxed = cases.wrong_fails_sandboxed([(check, wrong_args), ...], ids)

(pytest collects each under the module's name for it; the `sandbox` fixture is tests/checks/conftest.py's.)
"""

from __future__ import annotations

import pytest

from dlo.grading.forbid import ForbiddenCall


def as_args(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def named(args) -> str:
    return "-".join(getattr(f, "__name__", type(f).__name__) for f in as_args(args))


def wrong_cases(cases) -> list[tuple]:
    """(check, arguments, slip or None) of every wrong answer in `cases`."""
    out = []
    for check, _, bads in cases:
        for bad in bads:
            slip = bad[1] if isinstance(bad, tuple) and len(bad) == 2 and isinstance(bad[1], str) else None
            out.append((check, as_args(bad if slip is None else bad[0]), slip))
    return out


def goods(cases) -> list[tuple]:
    return [(c, as_args(g)) for c, g, _ in cases]


def reference_passes(cases, seeds=(0, 1, 2)):
    @pytest.mark.parametrize("check,good", goods(cases), ids=[c.__name__ for c, _, _ in cases])
    @pytest.mark.parametrize("seed", seeds)
    def test(check, good, seed, capsys):
        check(*good, seed=seed)
        assert ": ok (" in capsys.readouterr().out
    return test


def wrong_versions_fail(cases):
    wrong = wrong_cases(cases)

    @pytest.mark.parametrize("check,bad,slip", wrong, ids=[f"{c.__name__}-{named(b)}" for c, b, _ in wrong])
    def test(check, bad, slip):
        with pytest.raises((AssertionError, NotImplementedError)) as err:
            check(*bad, seed=0)
        assert not isinstance(err.value, ForbiddenCall), "a wrong version must fail for its own slip"
        said = f"{type(err.value).__name__}: {err.value}"
        assert slip is None or slip in said, said
    return test


def library_refused(pairs, ids):
    """`pairs`: (check, the library's own functions as arguments): refused as off limits."""
    @pytest.mark.parametrize("check,lib", [(c, as_args(lib)) for c, lib in pairs], ids=ids)
    def test(check, lib):
        with pytest.raises(ForbiddenCall, match="off limits"):
            check(*lib, seed=0)
    return test


def reference_passes_sandboxed(cases, seed: int = 1):
    @pytest.mark.parametrize("check,good", goods(cases), ids=[c.__name__ for c, _, _ in cases])
    def test(sandbox, check, good, capsys):
        sandbox.run(check, *good, seed=seed)
        assert ": ok (" in capsys.readouterr().out
    return test


def wrong_fails_sandboxed(pairs, ids):
    """`pairs`: (check, a wrong answer's arguments): fails for its own slip in the grader's sandbox too."""
    @pytest.mark.parametrize("check,bad", [(c, as_args(b)) for c, b in pairs], ids=ids)
    def test(sandbox, check, bad):
        with pytest.raises(AssertionError) as err:
            sandbox.run(check, *bad, seed=0)
        assert not isinstance(err.value, ForbiddenCall)
    return test
