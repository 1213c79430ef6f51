"""The grading process starts the checks' sandboxed runner in a thread while the kernel starts
(`dlo.harness.execute.ResilientExecute.start_warming`): the runner must live as long as the submission's
checks, however soon or late that thread would have ended."""

from __future__ import annotations

import time

from dlo.grading import trusted
from dlo.grading.jail import make_spec
from dlo.grading.trusted import SandboxBackend
from dlo.harness.execute import ResilientExecute
from tests.harness.test_sandbox import needs_bwrap


@needs_bwrap
def test_the_runner_lives_on_when_the_thread_that_started_it_would_have_ended(tmp_path, monkeypatch):
    """bwrap's --die-with-parent fires when the *thread* that forked bwrap ends (PR_SET_PDEATHSIG). The
    warming thread ended as soon as the runner had started: after bwrap's prctl (the GIL, a loaded node;
    here made certain with a pause), that killed the runner's bwrap, and the first check started another."""
    started = SandboxBackend.warm

    def warm_then_pause(self):
        started(self)
        time.sleep(1.0)  # where the thread would have ended: well after bwrap's prctl

    made = []

    class Counted(trusted.Runner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(SandboxBackend, "warm", warm_then_pause)
    monkeypatch.setattr(trusted, "Runner", Counted)
    spec = make_spec("bwrap", tmp_path / "work", hidden=[])
    spec.make_dirs()
    grader = ResilientExecute()
    grader.start_warming(spec)
    backend = grader.backend()
    try:
        assert backend is not None, grader._warm_error
        time.sleep(1.0)
        assert backend.runner().alive() and len(made) == 1  # the runner warmed is the one the checks use
    finally:
        grader.end_warming()
    assert made[0].proc.returncode == 0  # the runner ended by itself (its ranks' CPU counted), then the thread went
