"""dlo.checks.common: what every day's checks share."""

from __future__ import annotations

import pytest

from dlo.checks.common import DirectSession, is_stub


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
