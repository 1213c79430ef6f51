"""nbgrader's Execute preprocessor, made to survive a student cell that kills its kernel.

nbgrader gives up on the whole notebook when the kernel dies (`os._exit`, a segfault, the OOM
killer), so that student would get no grade at all. Here the dying cell is marked with an error,
a fresh kernel is started, the cells before it are replayed silently to rebuild the state, and
execution goes on: the student loses the points that depend on that cell, nothing more.
Hangs are nbgrader's own business: a cell past `Execute.timeout` is interrupted and marked.
"""

from __future__ import annotations

import copy

from nbclient.exceptions import DeadKernelError
from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import Execute


class ResilientExecute(Execute):
    max_kernel_deaths = 3  # a notebook that keeps killing kernels is not worth more replays

    def preprocess(self, nb, resources=None, km=None):
        self._deaths = 0
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        try:
            return super().preprocess_cell(cell, resources, index)
        except DeadKernelError:
            self._deaths += 1
            self.log.warning("kernel died in cell %d; restarting and replaying the cells before it", index)
            cell.outputs.append(NotebookNode(
                output_type="error", ename="DeadKernelError", evalue="the kernel died while running this cell",
                traceback=["DeadKernelError: the kernel died while running this cell (os._exit, a crash, "
                           "or out of memory); the grader restarted it and went on"]))
            if self._deaths > self.max_kernel_deaths:
                raise
            self._restart_and_replay(index)
            return cell, self.resources

    def _restart_and_replay(self, dead_index: int) -> None:
        self.kc.stop_channels()
        self._cleanup_kernel()
        self.km = self.create_kernel_manager()
        self.start_new_kernel()
        self.start_new_kernel_client()
        for i, cell in enumerate(self.nb.cells[:dead_index]):
            if cell.cell_type == "code":
                # A copy: replayed outputs must not replace what the first execution recorded.
                self.execute_cell(copy.deepcopy(cell), i, store_history=False)
