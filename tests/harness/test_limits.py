"""Limits per grading job, in the jail and under `dlo grade` (pytest -m trust; as root in CI): a submission
that exhausts memory, processes, a file's size or a tmpfs fails alone, with the limit named in its feedback,
while a classmate graded beside it keeps full marks and the rows it gets when graded alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from dlo.grading.jail import UID, make_spec, probe
from dlo.grading.limits import GIB, MIB, Limits, UidPool
from tests.harness.conftest import ADAMW, DAY, POINTS, REPO, dlo, grade_id, read_csv, unreachable_by_others

pytestmark = [pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}"),
              pytest.mark.trust]  # a hostile class's evidence: its own CI step, pytest -m trust


def _spec(tmp_path: Path, name: str, lim: Limits, uid: int = UID):
    spec = make_spec("bwrap", tmp_path / name, hidden=[], limits=lim, uid=uid)
    spec.make_dirs()
    return spec


def _python(spec, code: str, **kw):
    return subprocess.Popen([*spec.runner_prefix(), sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


FILLS = """
import errno, resource
def fill(folder, mib=3):
    held = 0
    try:
        for i in range(100):
            with open(f"{folder}/f{i}", "wb") as f:
                f.write(b"x" * (mib << 20))
            held += mib
    except OSError as exc:
        return held, errno.errorcode[exc.errno]
print("tmp", *fill("/tmp"), "shm", *fill("/dev/shm"), "run", *fill("/run"))
print("file", *fill(".", mib=5))
try:
    bytearray(2 << 30)
except MemoryError:
    print("memory MemoryError")
print("nproc", *resource.getrlimit(resource.RLIMIT_NPROC))
"""


def test_each_sandbox_is_bounded(tmp_path):
    """/tmp and /dev/shm hold 8 MiB each, the tmpfs over /run is no place to write, a file stops at 4 MiB,
    an allocation past the memory limit fails, and the process limit cannot be raised from inside."""
    spec = _spec(tmp_path, "work", Limits(memory=GIB, procs=64, file_size=4 * MIB, tmpfs=8 * MIB))
    proc = _python(spec, FILLS)
    out, err = proc.communicate(timeout=120)
    lines = out.splitlines()
    assert lines[0] == "tmp 6 ENOSPC shm 6 ENOSPC run 0 EACCES", out + err
    assert lines[1:] == ["file 0 EFBIG", "memory MemoryError", "nproc 64 64"], out + err
    assert (spec.runner_dir / "f0").stat().st_size == 4 * MIB  # the grader's own side: the file it reached


HOLD = """
import os, sys, time
held = 0
try:
    for _ in range({n}):
        if os.fork() == 0:
            time.sleep({sleep})
            os._exit(0)
        held += 1
except BlockingIOError:
    pass
print("forked", held, flush=True)
sys.stdin.read() if {wait} else None
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="as root each job has a uid of its own; as a user, a user namespace")
def test_each_job_counts_its_own_processes(tmp_path):
    """Job A forks until its process limit while job B starts 20 processes: all start. A sandbox with A's uid
    (the same job) cannot, which is what one uid for every job, as before, did to B."""
    lim = Limits(memory=GIB, procs=48, file_size=MIB, tmpfs=MIB)
    pool = UidPool()
    a, b = pool.lease(2)
    try:
        hog = subprocess.Popen([*_spec(tmp_path, "a", lim, a).runner_prefix(), sys.executable, "-I", "-c",
                                HOLD.format(n=1000, sleep=60, wait=True)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        try:
            held = int(hog.stdout.readline().split()[1])
            assert 30 < held < 48
            others = [_python(_spec(tmp_path, name, lim, uid), HOLD.format(n=20, sleep=1, wait=False))
                      for name, uid in (("b", b), ("a2", a))]
            got = [p.communicate(timeout=120)[0].strip() for p in others]
            assert got[0] == "forked 20" and got[1] != "forked 20", got
        finally:
            hog.kill()
            hog.wait()
    finally:
        pool.release()


# ----------------------------------------------------------------------------- dlo grade

OVER_FILE = "open('big.bin', 'wb').write(b'x' * (9 << 20))  # over the 8 MiB a file may have"
OVER_MEMORY = "hoard = bytearray(3 << 30)  # over the job's 2 GiB, in one process"
FILL_SHM = """def add(a, b):
    for i in range(64):  # 4 MiB files, each under the file size limit; together over /dev/shm's 16 MiB
        with open(f"/dev/shm/fill{i}", "wb") as f:
            f.write(b"x" * (4 << 20))
    return a + b"""
FORK_BOMB = """def norm(x, y):
    import os, time
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)"""
# Three processes of 800 MiB each, each under the job's 2 GiB, together over it: the job's watch stops one.
SPREAD = ADAMW.replace("    ### BEGIN SOLUTION\n", """    import os, time
    if not os.path.exists("spread"):
        open("spread", "w").close()
        kids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                hoard = b"x" * (800 << 20)
                time.sleep(4)
                os._exit(0)
            kids.append(pid)
        for pid in kids:
            os.waitpid(pid, 0)
""").replace("    ### END SOLUTION", "")
LIMITS = ["--mem-per-job", "2G", "--procs-per-job", "128", "--max-file-size", "8M", "--tmpfs-size", "16M"]


def _hog(solution: Path, dest: Path) -> None:
    """The solution with every limit reached: two added cells in the kernel, the three exercises where
    their checks run them."""
    nb = nbformat.read(solution, as_version=4)
    for cell in nb.cells:
        cell.source = {"add": FILL_SHM, "norm": FORK_BOMB, "adamw": SPREAD}.get(grade_id(cell), cell.source)
    at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "add")
    nb.cells[at:at] = [new_code_cell(OVER_FILE), new_code_cell(OVER_MEMORY)]
    dest.parent.mkdir(parents=True)
    nbformat.write(nb, dest)


def _rows(out: Path, student: str) -> list[list[dict]]:
    return [[r for r in read_csv(out / name) if r["student"] == student] for name in ("scores.csv", "cells.csv")]


def _errors(out: Path, student: str) -> dict:
    """{grade id or source's first line: the error's text} of the autograded notebook."""
    nb = json.loads((out / "course" / "autograded" / student / DAY / f"{DAY}.ipynb").read_text())
    return {grade_id(c) or "".join(c["source"]).split("\n")[0]: " ".join(
        o["evalue"] for o in c.get("outputs", []) if o["output_type"] == "error") for c in nb["cells"]}


@pytest.mark.slow
def test_a_job_over_its_limits_fails_alone(toy_root, tmp_path):
    solution = toy_root / "solutions" / DAY / f"{DAY}.ipynb"
    both, alone = tmp_path / "both", tmp_path / "alone"
    _hog(solution, both / "hog" / DAY / f"{DAY}.ipynb")
    for folder in (both, alone):
        (folder / "classmate" / DAY).mkdir(parents=True)
        shutil.copy(solution, folder / "classmate" / DAY)
    beside = dlo("grade", str(both), "--out", str(tmp_path / "g-both"), "--jobs", "2", "--cell-timeout", "120",
                 *LIMITS, root=toy_root, timeout=1200)
    assert "limits per job: memory 2 GiB, 128 processes and threads, files up to 8 MiB" in beside.stdout
    assert "limits reached: hog/toy (5 cell(s))" in beside.stdout  # the run's summary
    scores = {r["student"]: float(r["score"]) for r in read_csv(tmp_path / "g-both" / "scores.csv")}
    assert scores == {"hog": 0.0, "classmate": sum(POINTS.values())}, beside.stdout
    errors = _errors(tmp_path / "g-both", "hog")
    assert "file size limit of 8 MiB per file reached while running this cell" in errors[OVER_FILE.split("\n")[0]]
    assert "memory limit of 2 GiB reached while running this cell" in errors[OVER_MEMORY.split("\n")[0]]
    assert "tmpfs limit of 16 MiB for each of /tmp and /dev/shm reached while running the checks of this cell" \
        in errors["add_test"]
    assert "process limit of 128 processes and threads reached while running the checks of this cell" \
        in errors["norm_test"]
    assert "memory limit of 2 GiB reached while running the checks of this cell; the grader stopped a process " \
           "running your code" in errors["adamw_test"]
    feedback = (tmp_path / "g-both" / "feedback" / "hog" / f"{DAY}.html").read_text()
    assert feedback.count("dlo grade --") >= 5  # each limit named where the student reads it
    dlo("grade", str(alone), "--out", str(tmp_path / "g-alone"), "--jobs", "2", "--cell-timeout", "120", *LIMITS,
        root=toy_root, timeout=1200)
    assert _rows(tmp_path / "g-both", "classmate") == _rows(tmp_path / "g-alone", "classmate")


AS_A_USER = """
import subprocess, sys
from pathlib import Path
from dlo.grading.jail import make_spec
from dlo.grading.limits import GIB, MIB, Limits
spec = make_spec("bwrap", Path({work!r}) / "work", hidden=[], limits=Limits(memory=GIB, procs=40, file_size=MIB,
                 tmpfs=MIB))
spec.make_dirs()
mine = [subprocess.Popen(["sleep", "30"]) for _ in range(60)]  # the grading user's own, outside
inside = subprocess.run([*spec.runner_prefix(), sys.executable, "-I", "-c", {hold!r}], capture_output=True, text=True)
print(inside.stdout.strip(), inside.stderr.strip()[-300:])
more = [subprocess.Popen(["sleep", "30"]) for _ in range(60)]  # and still more of them: the limit is the sandbox's
print("outside", len(mine) + len(more))
for p in mine + more:
    p.kill()
"""


@pytest.mark.skipif(unreachable_by_others(REPO) is not None,  # uid 65534 imports dlo from the checkout
                    reason=f"another user must reach the checkout: {unreachable_by_others(REPO)}")
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="needs root (a private mount namespace, then uid 65534) and util-linux's unshare, setpriv")
def test_as_a_user_each_sandbox_counts_its_own_processes(tmp_path):
    """Grading as a user, the sandbox is a user namespace of its own: the process limit, set inside it, counts
    the sandbox's processes only, not the 60 the grading user already runs, and binds none of the user's."""
    from tests.harness.test_sandbox_root import _as_user, _reach_for_uid_65534

    work = Path(tempfile.mkdtemp(prefix="dlo-user-limits-"))
    try:
        os.chown(work, 65534, 65534)
        code = AS_A_USER.format(work=str(work), hold=HOLD.format(n=1000, sleep=1, wait=False))
        script = " && ".join([*_reach_for_uid_65534(work), _as_user([sys.executable, "-c", code])])
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HOME": str(work)})
        lines = proc.stdout.splitlines()
        assert len(lines) == 2 and lines[0].startswith("forked ") and lines[1] == "outside 120", \
            proc.stdout + proc.stderr
        assert 30 < int(lines[0].split()[1]) < 40
    finally:
        shutil.rmtree(work, ignore_errors=True)
