"""The student's Jupyter kernel, started in the jail (`dlo.grading.jail`) by the grader.

nbgrader's executor (`dlo.harness.execute`) starts each submission's kernel through this manager: the
kernel's command gets the bwrap prefix of the submission's `Spec`, its working directory and HOME are
its scratch folder, its channels are Unix sockets in a private folder both sides see, and an interrupt
reaches the kernel itself rather than bwrap.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from dlo.grading.jail import Spec, as_root
from dlo.reaper import children, comm


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started inside the sandbox (`spec` set by the executor before the kernel starts):
    its command gets the bwrap prefix, its working directory, HOME and connection file are in the
    submission's scratch, its channels are Unix sockets in a private folder bound into the sandbox
    (the sandbox has no network of its own to reach), and an interrupt (SIGINT) goes to the kernel
    itself: the process group the provisioner would signal begins with bwrap, which SIGINT would kill."""

    spec: Spec | None = None
    sockets: Path | None = None

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        return (self.spec.kernel_prefix(self.sockets) if self.spec else []) + cmd

    async def _async_pre_start_kernel(self, **kw):
        if self.spec is not None:
            kw["cwd"] = str(self.spec.kernel_dir)
            kw["env"] = {**(kw.get("env") or os.environ), **self.spec.env(self.spec.kernel_dir)}
            self.connection_file = str(self.spec.kernel_dir / f".kernel-{os.getpid()}-{id(self)}.json")
            if self.spec.confined:
                if self.sockets is None:
                    self.sockets = self.spec.socket_dir()
                self.transport, self.cache_ports, self.ip = "ipc", False, str(self.sockets / "k")
        return await super()._async_pre_start_kernel(**kw)

    def write_connection_file(self, **kw) -> None:
        super().write_connection_file(**kw)
        if self.spec is not None and self.spec.confined and as_root():  # the kernel reads it as the sandbox's uid
            os.chown(self.connection_file, self.spec.uid, self.spec.uid, follow_symlinks=False)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if self.sockets is not None and not restart:
            shutil.rmtree(self.sockets, ignore_errors=True)
            self.sockets = None

    cleanup_resources = _async_cleanup_resources  # async, as AsyncKernelManager's

    async def _async_signal_kernel(self, signum: int) -> None:
        if self.spec is not None and self.spec.confined and signum == signal.SIGINT and self.has_kernel:
            pid = self._inner_kernel_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
                return
        await super()._async_signal_kernel(signum)

    def _inner_kernel_pid(self) -> int | None:
        """The first process below the bwrap processes: the kernel."""
        pid = getattr(self.provisioner, "pid", None) or getattr(getattr(self.provisioner, "process", None), "pid", None)
        for _ in range(4):
            kids = children(pid) if pid else []
            if not kids:
                return None
            pid = kids[0]
            if comm(pid) != "bwrap":
                return pid
        return None
