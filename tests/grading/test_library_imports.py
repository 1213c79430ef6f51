"""A library module imported while a check runs is not the student's copy of a forbidden reference.

torch imports `torch._dynamo` at the first optimizer a process makes; one of its modules holds a context
manager with the bytecode of torch DDP's `no_sync` (save a flag, set it, yield, restore). Where Day 4's
checks forbid DDP, the audit hook refused that import as "a copy of DistributedDataParallel": a fresh
notebook kernel's `check_naive_ddp` failed for every student, the instructors' solution included. The hook
now lets a library module's own code through (under the interpreter's prefixes or dlo's package, read from
its file), and still refuses a copy compiled under a library file's name and a reload of the reference's
own module. (Since 2026-12-02 `no_sync`, 27 instructions, is below `bytecode.SUBSTANTIAL` and a shape keeps the
attribute names a code uses: the module here holds a copy of the course's `all_reduce_gradients` instead.)
"""

from __future__ import annotations

import importlib
import sys

import pytest

from dlo.grading.forbid import ForbiddenCall, forbidden

# a substantial forbidden reference (33 instructions) whose code a library could hold: DDP's `no_sync` (27) no
# longer is one (bytecode.SUBSTANTIAL, 2026-12-02)
DDP = ("dlo.distributed.ddp.all_reduce_gradients",)

IDIOM = '''
import torch.distributed as dist


def average_gradients(model):
    """Not the course's: every .grad averaged over the ranks, as a library might write it."""
    n = dist.get_world_size()
    for q in model.parameters():
        if q.grad is not None:
            dist.all_reduce(q.grad)
            q.grad.div_(n)
'''


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A folder that counts as the interpreter's (sys.prefix), on sys.path, with a module of the idiom."""
    (tmp_path / "dlo_test_idiom_lib.py").write_text(IDIOM)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("dlo_test_idiom_lib", None)


def test_the_idiom_is_a_copy_of_ddp_by_bytecode(library):
    """The premise: compiled anywhere else (a student's cell), the same code is refused."""
    with forbidden(DDP, "naive_ddp"), pytest.raises(ForbiddenCall, match="copy of dlo.distributed.ddp"):
        exec(compile(IDIOM, "student cell", "exec"), {})


def test_a_library_module_imported_during_a_check_is_let_through(library):
    with forbidden(DDP, "naive_ddp"):
        module = importlib.import_module("dlo_test_idiom_lib")
    assert callable(module.average_gradients)


def test_a_copy_compiled_under_a_library_file_s_name_is_refused(library):
    """The file is genuine, the code is not what it compiles to (an extra line): the student's."""
    fake = compile(IDIOM + "\nEXTRA = 1\n", str(library / "dlo_test_idiom_lib.py"), "exec")
    with forbidden(DDP, "naive_ddp"), pytest.raises(ForbiddenCall, match="copy of dlo.distributed.ddp"):
        exec(fake, {})


def test_a_reload_of_the_reference_s_own_module_is_still_refused():
    import dlo.distributed.ddp as ddp

    with forbidden(("dlo.distributed.ddp.all_reduce_gradients",), "naive_ddp"), pytest.raises(ForbiddenCall):
        importlib.reload(ddp)
    importlib.reload(ddp)  # outside the check: the module as it was
