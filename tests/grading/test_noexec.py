"""No new program where the student's code runs for good (issue 33; `dlo.grading.noexec`).

A red team ran Day 10's references in a fresh interpreter (`subprocess.run([sys.executable, "-c", ...])`,
`os.posix_spawn`, fork + exec, a spawn-context pool): 12 of 15 points, since every defence of the grader lives in
one interpreter. Here the same escape on Day 1 fails in the grader's sandbox, every route is refused by the kernel
in a process armed for good (a fork of this one), and what a student may honestly do there still works: fork,
torch, and a torch.compile'd function, which runs as written when its compiler cannot start.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from dlo.checks import day1
from dlo.grading import noexec
from dlo.grading.api import check
from dlo.grading.trusted import LocalSandbox
from tests.forked import in_a_fork
from tests.student_cell import student_cell

pytestmark = pytest.mark.trust  # a hostile class's evidence: its own CI step, pytest -m trust

STUDENT = '''
import pickle, subprocess, sys

PROGRAM = ("import pickle, sys; import dlo.optim.reference as ref; a, hp = pickle.load(sys.stdin.buffer); "
           "ref.adamw_step(*a, **hp); sys.stdout.buffer.write(pickle.dumps(a))")

def adamw_elsewhere(param, grad, exp_avg, exp_avg_sq, step, **hp):  # the reference, in an interpreter of its own
    got = subprocess.run([sys.executable, "-c", PROGRAM], input=pickle.dumps(((param, grad, exp_avg, exp_avg_sq, step),
                         hp)), capture_output=True, check=True).stdout
    p, _, m, v, _ = pickle.loads(got)
    param.copy_(p), exp_avg.copy_(m), exp_avg_sq.copy_(v)
'''

needs_seccomp = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in noexec.ARCHES,
                                   reason="the filter is Linux's, on x86-64 or AArch64")


@pytest.fixture(scope="module")
def student():
    return student_cell(STUDENT, "noexec_student")


def test_the_escape_passes_where_nothing_is_armed(student):
    """The cheat is right: the reference, run elsewhere (a notebook's own check: feedback, not grading)."""
    day1.check_adamw_step(student.adamw_elsewhere, trials=1, steps=1)


@needs_seccomp
def test_a_fresh_interpreter_is_refused_in_the_sandbox(student, tmp_path):
    with LocalSandbox(tmp_path) as sandbox, pytest.raises(PermissionError, match="starting a program is off limits"):
        sandbox.run(day1.check_adamw_step, student.adamw_elsewhere, trials=1, steps=1)


def _every_route(arm: bool) -> str:
    """Each route starts a program that would leave a file; a route that raises or whose child dies is refused."""
    import _posixsubprocess  # what multiprocessing's spawn calls, with no audit event
    import multiprocessing
    import tempfile

    assert not arm or noexec.deny_exec() is None
    folder, out = tempfile.mkdtemp(), []

    def program(name):
        return [sys.executable, "-c", f"open({os.path.join(folder, name)!r}, 'w').close()"]

    def fork_exec(name):
        args, err = program(name), os.pipe()
        pid = _posixsubprocess.fork_exec(args, [args[0].encode()], True, (), None, None, -1, -1, -1, -1, -1, -1,
                                         *err, False, False, False, None, None, None, -1, None, False)
        os.waitpid(pid, 0)

    def fork_then_exec(name):
        pid = os.fork()
        if pid == 0:
            try:
                os.execv(sys.executable, program(name))
            finally:
                os._exit(7)
        os.waitpid(pid, 0)

    def spawned(name):
        p = multiprocessing.get_context("spawn").Process(target=open, args=(os.path.join(folder, name), "w"))
        p.start()
        p.join()

    for name, start in [("subprocess", lambda n: subprocess.run(program(n))),
                        ("posix_spawn", lambda n: os.waitpid(os.posix_spawn(sys.executable, program(n),
                                                                            os.environ), 0)),
                        ("system", lambda n: os.system(f"touch {os.path.join(folder, n)}")),
                        ("fork_exec", fork_exec), ("fork + exec", fork_then_exec), ("spawn", spawned)]:
        try:
            start(name)
        except Exception:  # noqa: BLE001 - refused before it started
            pass
        out.append(f"{name}: {'ran' if os.path.exists(os.path.join(folder, name)) else 'refused'}")
    out.append(f"torch: {torch.ones(3).sum().item()}")
    return "\n".join(out)


def test_every_route_starts_a_program_where_nothing_is_armed():
    """The routes below are real ways in: unarmed, each leaves its file."""
    assert in_a_fork(lambda: _every_route(arm=False)).splitlines() == [
        "subprocess: ran", "posix_spawn: ran", "system: ran", "fork_exec: ran", "fork + exec: ran", "spawn: ran",
        "torch: 3.0"]


@needs_seccomp
def test_every_route_to_a_program_is_refused_and_torch_still_works():
    assert in_a_fork(lambda: _every_route(arm=True)).splitlines() == [
        "subprocess: refused", "posix_spawn: refused", "system: refused", "fork_exec: refused", "fork + exec: refused",
        "spawn: refused", "torch: 3.0"]


def _compiled() -> str:
    assert noexec.deny_exec() is None

    def f(x):
        return torch.sin(x) * 2 + 1
    x = torch.linspace(0, 1, 7)
    return str(bool(torch.equal(torch.compile(f)(x), f(x))))


@needs_seccomp
def test_a_compiled_function_runs_as_written_where_its_compiler_cannot_start():
    assert in_a_fork(_compiled) == "True"


@pytest.mark.parametrize("arch", sorted(noexec.ARCHES))
def test_every_path_through_the_filter_ends_in_a_return(arch):
    """Whole sock_filter instructions (8 bytes), every jump inside the program, the last a return: the kernel
    refuses a program that runs off its end, and this one is only ever loaded on the machine it was made for."""
    import struct

    code = noexec.program(arch)
    steps = list(struct.iter_unpack("=HBBI", code))
    assert len(code) == 8 * len(steps)
    jumps = [(i, jt, jf) for i, (code, jt, jf, _) in enumerate(steps) if code & 0x07 == 0x05]  # BPF_JMP
    assert jumps and all(i + 1 + max(jt, jf) < len(steps) for i, jt, jf in jumps)
    assert steps[-1][0] == noexec.RET_K


def student_holds_the_fork_server():
    from dlo.distributed import _forkserver  # the ranks' fork server forks ranks with none of the grader's blocks

    return repr(_forkserver._SERVER.get("sock"))


@check()
def check_no_fork_server(fn):
    if (got := fn()) != "None":
        raise AssertionError(f"the student's code can ask the ranks' fork server for ranks: {got}")


def test_the_student_s_code_cannot_reach_the_ranks_fork_server(tmp_path):
    """The session child inherits the runner's end of the fork server's socket; once a student object loads, it
    is closed there (a launch asked for through it would fork ranks without the grader's blocks)."""
    with LocalSandbox(tmp_path) as sandbox:
        sandbox.run(check_no_fork_server, student_holds_the_fork_server)
