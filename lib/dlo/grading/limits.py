"""Limits per grading job: what one submission's sandboxes may take of the machine, so that a submission
that exhausts memory, processes, a file's size or a tmpfs fails alone, with the limit named.

`dlo grade` grades several submissions at once (`--jobs`). A job is one submission: its kernel's sandbox
and its checks runner's sandbox (`dlo.grading.jail`), with every process they start. Each job gets:

- **memory** (`--mem-per-job`): the job's sandboxed processes together hold at most this many bytes of
  their own pages. Each process is bounded by RLIMIT_DATA (its private writable memory: an allocation
  past it fails, MemoryError; not where GPUs are bound, see `Limits.rlimits`), and the job's watch
  (`dlo.grading.jobwatch`) adds the processes up a few times a second and stops the largest when the sum
  is over, as the kernel's OOM killer would, but within the job;
- **processes** (`--procs-per-job`): RLIMIT_NPROC, which counts processes *and threads* per uid. Grading
  as root, each job's sandboxes run as a uid of their own (`UidPool`: leased for the run, FIRST_UID and
  up), so one job forking to its limit leaves the others' count alone; as any other user each sandbox is
  a user namespace of its own, where the count is its own;
- **file size** (`--max-file-size`): RLIMIT_FSIZE (a write past it fails, EFBIG: Python ignores SIGXFSZ);
- **tmpfs** (`--tmpfs-size`): the sandbox's /tmp and /dev/shm are each a tmpfs of this size (bwrap's
  `--size`; the empty tmpfs that only hide folders get `HIDING_TMPFS`), their pages are memory too.

The rlimits are set inside the sandbox, after bwrap has made its namespaces and setpriv has become the
job's uid (`wrapper`): set on bwrap, RLIMIT_NPROC would also become the limit of the user namespace bwrap
creates as a non-root user, counted against every process of the grading user. No cgroup: where a grader
may make one (cgroup v2 with the memory and pids controllers delegated to it) the limits could be exact,
but the machines the course grades on (CI containers, SLURM nodes) do not delegate one; the watch gives
the same bound per job within a fraction of a second.

Sizes come from the job's share of the memory available when the run starts (`for_jobs`), each at least
what the heaviest day takes at the tiny profile (`HONEST`, bench/grade_peaks.py), or from the command
line. A limit reached is named in the feedback of the cell that reached it (`name_limits`): "memory
limit of 3 GiB reached while running this cell".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

GIB, MIB = 2 ** 30, 2 ** 20
FIRST_UID, UIDS = 1_900_000_000, 4096  # grading as root: the jobs' uids (no account has them; above systemd's)
HIDING_TMPFS = MIB  # an empty tmpfs over a hidden folder: only mount points are made in it
# The heaviest day at the tiny profile (bench/grade_peaks.py), with room above: what a default never goes under
HONEST = {"memory": 3 * GIB, "procs": 256, "file_size": 64 * MIB, "tmpfs": 512 * MIB}
MINIMUM = {"memory": 512 * MIB, "procs": 32, "file_size": MIB, "tmpfs": MIB}  # below: a kernel cannot start
WHY_MINIMUM = {"memory": "a kernel with torch holds about 300 MiB", "procs": "a kernel with torch runs 10 threads",
               "file_size": "a notebook's own files need room", "tmpfs": "Python and torch write there"}
GRADER_RESERVE = GIB  # dlo grade, its warm process: outside every job
TRUSTED_PER_JOB = GIB // 2  # each job's grading process (nbgrader, the references): outside its limits
OPTIONS = {"memory": "--mem-per-job", "procs": "--procs-per-job", "file_size": "--max-file-size",
           "tmpfs": "--tmpfs-size"}


@dataclass(frozen=True)
class Limits:
    """One job's limits (bytes, and tasks for `procs`)."""

    memory: int
    procs: int
    file_size: int
    tmpfs: int

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Limits | None:
        return None if not d else cls(**{k: int(d[k]) for k in ("memory", "procs", "file_size", "tmpfs")})

    def rlimits(self, gpus: bool = False) -> dict[str, int]:
        """The rlimits set in the sandbox. Not RLIMIT_DATA where GPUs are bound: CUDA maps large regions of
        its own, which no GPU grading has been tried with yet (the job's watch bounds the memory there)."""
        data = {} if gpus else {"RLIMIT_DATA": self.memory}
        return {**data, "RLIMIT_NPROC": self.procs, "RLIMIT_FSIZE": self.file_size}

    def describe(self) -> str:
        return (f"memory {size_text(self.memory)}, {self.procs} processes and threads, files up to "
                f"{size_text(self.file_size)}, /tmp and /dev/shm {size_text(self.tmpfs)} each")


# ----------------------------------------------------------------------------- sizes

_UNITS = {"": 1, "K": 2 ** 10, "M": MIB, "G": GIB, "T": 2 ** 40}


def parse_size(text: str) -> int:
    """Bytes from "3G", "512M", "1.5GiB", "64k" or "1048576" (binary units); ValueError with the way to write one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 3G, 512M, 1.5GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_text(n: int) -> str:
    """3 GiB, 1.5 GiB, 512 MiB, 4 KiB: the largest binary unit with at most one decimal."""
    for unit, name in ((2 ** 40, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (2 ** 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f}".removesuffix(".0") + f" {name}"
    return f"{n} bytes"


def check_value(name: str, value: int) -> str | None:
    """Why `value` cannot be the limit `name` (one line), or None."""
    if value < MINIMUM[name]:
        shown = str(MINIMUM[name]) if name == "procs" else size_text(MINIMUM[name])
        return f"{value if name == 'procs' else size_text(value)} is too small: at least {shown} ({WHY_MINIMUM[name]})"
    return None


def for_jobs(jobs: int, available: int, threads: int, given: dict | None = None) -> tuple[Limits, list[str]]:
    """Each job's limits: `given` ({name: value} from the command line) as they are, the others from the
    job's share of `available` bytes (less what the grader's own processes hold) and its `threads` (the
    cores each job's processes may use), never under `HONEST`. Returns them with the warnings to print:
    a share under what an honest submission takes."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    share = max(0, (available - GRADER_RESERVE) // max(1, jobs) - TRUSTED_PER_JOB)
    derived = {"memory": share * 3 // 4, "tmpfs": share // 8,
               "procs": 64 * max(1, threads) + 192}  # a few torch processes' threads, ranks' included
    derived["file_size"] = derived["memory"]
    warnings = []
    if "memory" not in given and derived["memory"] < HONEST["memory"]:
        warnings.append(f"{jobs} job(s) leave {size_text(derived['memory'])} of memory each, under the "
                        f"{size_text(HONEST['memory'])} a limit never goes below (twice what the heaviest day takes): "
                        f"each job gets that much, and together they may exceed what is available; lower --jobs")
    values = {k: given.get(k, max(derived[k], HONEST[k])) for k in HONEST}
    for name, value in given.items():
        if value < HONEST[name]:
            shown = str(HONEST[name]) if name == "procs" else size_text(HONEST[name])
            warnings.append(f"{OPTIONS[name]} is under {shown}, the default's floor (room above what the heaviest "
                            f"day takes, bench/grade_peaks.py): honest submissions may reach it")
    return Limits(**values), warnings


# ----------------------------------------------------------------------------- in the sandbox

# Run by the sandbox's Python before the command: the rlimits (soft = hard: code inside cannot raise them), then exec.
_SET = ("import os, resource, sys\n"
        "i = sys.argv.index('--')\n"
        "for item in sys.argv[1:i]:\n"
        "    name, value = item.split('=')\n"
        "    resource.setrlimit(getattr(resource, name), (int(value), int(value)))\n"
        "os.execvp(sys.argv[i + 1], sys.argv[i + 1:])\n")


def wrapper(limits: Limits | None, gpus: bool = False) -> list[str]:
    """The command that sets `limits`' rlimits (`Limits.rlimits`), then execs what follows it ([] without limits)."""
    if limits is None:
        return []
    return [sys.executable, "-I", "-S", "-c", _SET, *(f"{k}={v}" for k, v in limits.rlimits(gpus).items()), "--"]


def tmpfs_args(limits: Limits | None, where: str, hiding: bool = False) -> list[str]:
    """bwrap's arguments for a tmpfs at `where`: sized by `limits` (`HIDING_TMPFS` for one that only hides)."""
    if limits is None:
        return ["--tmpfs", where]
    return ["--size", str(HIDING_TMPFS if hiding else limits.tmpfs), "--tmpfs", where]


# ----------------------------------------------------------------------------- uids (grading as root)

class UidPool:
    """Uids for the jobs of one run, each held (a lock on a file named by it) until `release`: two `dlo grade`
    on one machine (shards of a SLURM array) never share one. Uids with an account are skipped."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or _lease_folder()
        self._held: dict[int, int] = {}

    def lease(self, n: int) -> list[int]:
        for uid in range(FIRST_UID, FIRST_UID + UIDS):
            if len(self._held) == n:
                break
            if _has_account(uid):
                continue
            fd = os.open(self.folder / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another run holds it
                os.close(fd)
                continue
            self._held[uid] = fd
        if len(self._held) < n:
            self.release()
            raise RuntimeError(f"no free uid for the sandboxes in {FIRST_UID}..{FIRST_UID + UIDS - 1} "
                               f"(held by other dlo grade runs: see {self.folder})")
        return sorted(self._held)

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _lease_folder() -> Path:
    """A folder only root may write: /run/dlo-grade-uids (else in the temporary folder), never a link."""
    base = Path("/run") if os.path.isdir("/run") and os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    folder = base / "dlo-grade-uids"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != 0 or st.st_mode & 0o022:
        raise RuntimeError(f"{folder} is not a folder only root may write: remove it")
    return folder


# ----------------------------------------------------------------------------- naming a limit reached

# (limit, what an error's text shows when the sandbox reached it), first match wins. Out of *CUDA* memory is
# the GPU's, not a limit of the job.
SIGNS = [
    ("memory", re.compile(r"^MemoryError|DefaultCPUAllocator: can't allocate memory|\[Errno 12\]|"
                          r"Cannot allocate memory|std::bad_alloc", re.M)),
    ("procs", re.compile(r"can't start new thread|\[Errno 11\] Resource temporarily unavailable.*"
                         r"(?:fork|Popen|spawn|[Pp]rocess|thread|clone)", re.S)),
    ("file_size", re.compile(r"\[Errno 27\]|File too large")),
    ("tmpfs", re.compile(r"\[Errno 28\]|No space left on device")),
]


def note(name: str, limits: Limits, what: str, stopped: str = "") -> str:
    """'memory limit of 3 GiB reached while running this cell ...': the line the feedback shows."""
    value = {"memory": size_text(limits.memory), "procs": f"{limits.procs} processes and threads",
             "file_size": f"{size_text(limits.file_size)} per file",
             "tmpfs": f"{size_text(limits.tmpfs)} for each of /tmp and /dev/shm"}[name]
    label = {"memory": "memory", "procs": "process", "file_size": "file size", "tmpfs": "tmpfs"}[name]
    return (f"{label} limit of {value} reached while running {what}{stopped} (each submission is graded within "
            f"its own limits; your instructor sets them: dlo grade {OPTIONS[name]})")


def is_note(text: str) -> bool:
    """Whether `text` names a limit reached (`note`)."""
    return bool(_NOTE.search(text))


_NOTE = re.compile(r"limit of .+ reached while running")


def reached(output: dict) -> str | None:
    """The limit an error output shows the sandbox reached, or None."""
    text = "\n".join([f"{output.get('ename', '')}: {output.get('evalue', '')}", *output.get("traceback", [])])
    return next((name for name, sign in SIGNS if sign.search(_plain(text))), None)


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # IPython's colours


def name_limits(outputs: list, limits: Limits | None, what: str, killed: list | None = None,
                error_output=None) -> list:
    """`outputs` with the limit each error reached named in it; `killed`: the job watch's events during them
    (processes stopped over the memory limit). A graded cell (`error_output` given: how to make one) that
    had a process stopped fails even where its checks did not notice."""
    if limits is None:
        return outputs
    named = False
    for out in outputs:
        if out.get("output_type") != "error":
            continue
        name = "memory" if killed else reached(out)
        if name is None:
            continue
        line = note(name, limits, what, _stopped(killed))
        out["evalue"] = f"{out['evalue']} - {line}" if out.get("evalue") else line
        out["traceback"] = [line, *out.get("traceback", [])]
        named = True
    if killed and not named and error_output is not None:
        outputs.append(error_output("MemoryError", note("memory", limits, what, _stopped(killed))))
    return outputs


def _stopped(killed: list | None) -> str:
    if not killed:
        return ""
    return "; the grader stopped " + ", ".join(sorted({k.what for k in killed}))
