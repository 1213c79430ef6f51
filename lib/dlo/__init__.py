"""DLO - Deep Learning Optimized: the library behind the course notebooks.

`dlo.setup(day, profile=...)` turns a notebook's parameters cell into a `Run` (device, preset,
seeded RNGs, log folder). Everything else lives in submodules: `dlo.optim`, `dlo.kernels`,
`dlo.distributed`, `dlo.models`, `dlo.data`, `dlo.checks` (the autograder's checks), `dlo.grading`
(what runs them: the check API, the sandbox, the trusted side) and `dlo.harness` (papermill and
nbgrader behind the `dlo` command).

`Run` and `setup` are imported on first use (PEP 562): `import dlo` alone does not import torch, so
the `dlo` command and the grading processes that never touch a tensor start in a fraction of the
time (torch's import is ~2 CPU seconds, paid by every `dlo` invocation before).
"""

__all__ = ["Run", "setup"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in __all__:
        from dlo import config

        return getattr(config, name)
    raise AttributeError(f"module 'dlo' has no attribute {name!r}")
