"""No new thread where the student's code runs in the sandbox's session child (issue 33; `forbid.no_threads`); a ranks
reply that says less than the launch made fails.

The grader's meters and watches are the calling thread's (saved-tensor hooks, dispatch modes): a red team's Day 3
ran its forward on a thread of its own, so that the checkpoint check's meters saw nothing of the graph it kept
(3/3, 2026-12-02). Once the student's code has run in the session child, starting a thread is refused there for
good, as on the ranks; a library that starts a helper thread and copes without it (tqdm's monitor) still works.
"""

from __future__ import annotations

import pytest

from dlo.grading.api import check
from dlo.grading.forbid import ForbiddenCall
from dlo.grading.trusted import LocalSandbox, Session
from tests.student_cell import student_cell

pytestmark = pytest.mark.trust  # a hostile class's evidence: its own CI step, pytest -m trust

STUDENT = '''
import threading

def in_a_thread():
    out = []
    worker = threading.Thread(target=lambda: out.append(1))
    worker.start()
    worker.join()
    return len(out)

def with_a_progress_bar():
    from tqdm.auto import tqdm
    return sum(1 for _ in tqdm(range(3), disable=False))
'''


@check()
def check_runs(fn):
    if fn() not in (1, 3):
        raise AssertionError("wrong")


@pytest.fixture(scope="module")
def student():
    return student_cell(STUDENT, "threads_student")


def test_a_thread_is_refused_in_the_session(student, tmp_path):
    check_runs(student.in_a_thread)  # a notebook's own check: feedback, nothing refused
    with LocalSandbox(tmp_path) as sandbox, pytest.raises(ForbiddenCall, match="starting a thread is off limits "
                                                                              "while this check runs: "):
        sandbox.run(check_runs, student.in_a_thread)


def test_a_library_s_helper_thread_is_not_needed(student, tmp_path):
    with LocalSandbox(tmp_path) as sandbox:
        sandbox.run(check_runs, student.with_a_progress_bar)


class _Replying(Session):
    """A session whose sandbox gives the ranks request's reply `reply` (and no stub)."""

    def __init__(self, reply):
        super().__init__(backend=None, name="ring", forbid=())
        self.reply = reply

    def request(self, req, full=False):
        return None if req["op"] == "stub" else self.reply


@pytest.mark.parametrize(("reply", "match"), [({"results": [1], "wire": [8, 8]}, "malformed reply"),
                                              ({"results": [1, 2], "wire": None}, "without their sockets' count")])
def test_a_ranks_reply_that_says_less_fails(reply, match):
    """The session child that launched the ranks ran no student code, but what it sends is checked anyway: one
    result per rank, and a byte count for a gloo launch (a check reads a missing count as unmetered ranks and
    would skip its byte and memory rules)."""
    with pytest.raises(RuntimeError, match=match):
        _Replying(reply).on_ranks("w", 2, (), {}, 10, "gloo")
