"""DLO - Deep Learning Optimized: the library behind the course notebooks.

`dlo.setup(day, profile=...)` turns a notebook's parameters cell into a `Run` (device, preset,
seeded RNGs, log folder). Everything else lives in submodules: `dlo.optim`, `dlo.kernels`,
`dlo.distributed`, `dlo.models`, `dlo.data`, `dlo.checks` (the autograder's checks), `dlo.grading`
(what runs them: the check API, the sandbox, the trusted side) and `dlo.harness` (papermill and
nbgrader behind the `dlo` command).
"""

from dlo.config import Run, setup

__all__ = ["Run", "setup"]
__version__ = "0.1.0"
