"""The kernels `dlo run` and Validate start: their channels on Unix sockets in a private folder, not TCP.

A Jupyter kernel listens by default on five TCP ports of 127.0.0.1, which every user of a shared login
or compute node can connect to (the messages are signed with the connection file's key, but not
encrypted: the "Kernel is running over TCP without encryption" warning every run printed). On IPC the
channels are Unix sockets in a folder only this user can enter (mkdtemp: 0700), removed with the kernel.
The grader's sandboxed kernels do the same in their own folder (`dlo.grading.jail_kernel`).

    python -m dlo.harness.kernels ARGS...   papermill's command line (`dlo run` runs each notebook so)
    c.Execute.kernel_manager_class = "dlo.harness.kernels.IPCKernelManager"   Validate (`dlo setup`)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

# A Unix socket's path holds 107 bytes (sun_path); zmq adds "-N" to the base: under a very long TMPDIR the
# kernel keeps TCP rather than fail to start
MAX_SOCKET_PATH = 100


class IPCKernelManager(AsyncKernelManager):
    """A local kernel on IPC sockets in a private temporary folder (TCP where that folder's path is too long)."""

    sockets: Path | None = None

    async def _async_pre_start_kernel(self, **kw):
        if self.transport == "tcp" and self.sockets is None:
            folder = Path(tempfile.mkdtemp(prefix="dlo-kernel-"))
            if len(str(folder / "k-5")) <= MAX_SOCKET_PATH:
                self.sockets = folder
                self.transport, self.cache_ports, self.ip = "ipc", False, str(folder / "k")
            else:
                folder.rmdir()
        return await super()._async_pre_start_kernel(**kw)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if self.sockets is not None and not restart:
            shutil.rmtree(self.sockets, ignore_errors=True)
            self.sockets = None

    cleanup_resources = _async_cleanup_resources  # async, as AsyncKernelManager's


def papermill_main(argv: list[str] | None = None) -> None:
    """papermill's command line, unchanged but for the kernel it starts (IPCKernelManager)."""
    import functools

    from papermill import cli
    from papermill.execute import execute_notebook

    cli.execute_notebook = functools.partial(execute_notebook,
                                             kernel_manager_class="dlo.harness.kernels.IPCKernelManager")
    cli.papermill.main(args=sys.argv[1:] if argv is None else argv, prog_name="papermill")


if __name__ == "__main__":
    papermill_main()
