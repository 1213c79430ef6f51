"""The kernels of `dlo run` and Validate (dlo.harness.kernels): Unix sockets in a private folder, not TCP."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from dlo.harness.kernels import MAX_SOCKET_PATH, IPCKernelManager

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def spy_run(nb) -> dict:
    seen = {}

    class Spy(IPCKernelManager):
        async def _async_pre_start_kernel(self, **kw):
            out = await super()._async_pre_start_kernel(**kw)
            seen.update(transport=self.transport, folder=self.sockets,
                        mode=stat.S_IMODE(os.stat(self.sockets).st_mode) if self.sockets else None)
            return out

    NotebookClient(nb, kernel_name="python3", kernel_manager_class=Spy, timeout=120).execute()
    return seen


def test_a_kernel_on_unix_sockets_in_a_private_folder_removed_with_it():
    nb = new_notebook(cells=[new_code_cell("print(6 * 7)")])
    seen = spy_run(nb)
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    assert seen["transport"] == "ipc" and seen["mode"] == 0o700  # only this user enters the folder
    assert not seen["folder"].exists()  # removed with the kernel


def test_a_temporary_folder_too_deep_for_a_socket_keeps_tcp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH + 10 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    nb = new_notebook(cells=[new_code_cell("print('ran')")])
    seen = spy_run(nb)
    assert nb.cells[0].outputs[0]["text"] == "ran\n"
    assert seen["transport"] == "tcp" and seen["folder"] is None and not any(deep.iterdir())


def test_dlo_runs_papermill_without_a_tcp_kernel(tmp_path):
    """`dlo run`'s notebook process: papermill's command line; every run warned "Kernel is running over TCP
    without encryption" before."""
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                                       new_code_cell("print(x + 1)")], metadata={"kernelspec": KERNELSPEC}), src)
    proc = subprocess.run([sys.executable, "-m", "dlo.harness.kernels", str(src), str(out), "-p", "x", "41",
                           "--no-progress-bar"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "over TCP" not in proc.stderr, proc.stderr[-2000:]
    assert nbformat.read(out, as_version=4).cells[-1].outputs[0]["text"] == "42\n"
