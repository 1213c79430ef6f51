"""slurm/jupyterhub_config.py run the way JupyterHub's loader runs it, where batchspawner is not installed (make
test's environment: only a hub has it): a stand-in `batchspawner` module whose SlurmSpawner has what the profile's
subclass uses (start, poll, job_id, req_homedir), scripted by the tests."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

from traitlets import HasTraits, Unicode
from traitlets.config import Config

PROFILE = Path(__file__).resolve().parents[2] / "slurm" / "jupyterhub_config.py"


class StandInSlurmSpawner(HasTraits):
    """batchspawner's start as the issue met it: the job runs, the server never reports its port, start waits.
    `alive_polls`: how many polls find the job pending or running before it has ended (None: never ends)."""

    job_id = Unicode("")
    req_homedir = Unicode("/home/student")

    def __init__(self, alive_polls: int | None = None, starts_in: float | None = None, **kw):
        super().__init__(**kw)
        self.alive_polls, self.starts_in, self.polls, self.cancelled = alive_polls, starts_in, 0, False

    async def start(self):
        self.job_id = "42"
        try:
            await asyncio.sleep(3600 if self.starts_in is None else self.starts_in)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "10.0.0.7", 8888

    async def poll(self):
        self.polls += 1
        if self.alive_polls is None or self.polls <= self.alive_polls:
            return None
        self.job_id = ""  # batchspawner's poll clears the state of an ended job
        return 1


def run_profile(source: str | None = None) -> tuple[Config, dict]:
    """The profile's config and namespace (its CourseSlurmSpawner built on the stand-in); `source` replaces the
    file's text."""
    c = Config()
    stand_in = types.ModuleType("batchspawner")
    stand_in.SlurmSpawner = StandInSlurmSpawner
    saved = sys.modules.get("batchspawner")
    sys.modules["batchspawner"] = stand_in
    try:
        namespace = {"get_config": lambda: c}
        exec(compile(source or PROFILE.read_text(), str(PROFILE), "exec"), namespace)  # as JupyterHub's loader does
    finally:
        if saved is None:
            del sys.modules["batchspawner"]
        else:
            sys.modules["batchspawner"] = saved
    return c, namespace
