"""Where a student's code runs while `dlo grade` grades it: a bubblewrap sandbox.

Both the student's Jupyter kernel and the checks' runner (`dlo.checks.runner`) run under
`bwrap` (Debian's bubblewrap) with:

- a read-only view of the whole system (`--ro-bind / /`), GPUs included (`--dev-bind /dev /dev`);
- tmpfs over what a student must not read: the course checkout (solutions/, its git history, earlier
  runs), the submissions folder (other students' notebooks) and the grading output (the nbgrader
  course root with the instructors' notebooks, hidden tests and gradebooks); from these only the
  `dlo` library and the Python environment come back, read-only;
- its own writable scratch folders under OUT/work/<student>/<day>/ (the kernel's working directory
  and HOME, the capture folder where the kernel pickles the objects a test cell uses, the runner's
  folder), a private /tmp, and a private PID namespace (`--unshare-pid --die-with-parent`: killing
  the sandbox kills every process in it, ranks included);
- the network namespace shared: the kernel's ZMQ sockets and the ranks' rendezvous are on localhost.

Where bwrap is missing or cannot run (no user namespaces), grading goes on unconfined: `probe()`
says why, `dlo grade` prints a warning and writes it into the CSV's `sandbox` column.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import site
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

SPEC_ENV = "DLO_SANDBOX_SPEC"  # path of the JSON spec `dlo grade` writes for one submission
BASE = ["--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--unshare-pid", "--die-with-parent", "--unsetenv", "JPY_PARENT_PID", "--unsetenv", SPEC_ENV]


def probe() -> str:
    """"bwrap" when bubblewrap runs here with the flags the grader uses, else "none (why)"."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "none (bwrap not installed: apt-get install bubblewrap)"
    try:
        proc = subprocess.run([exe, *BASE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"none (bwrap failed: {exc})"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return f"none (bwrap cannot run here: {why[:120]})"
    return "bwrap"


@dataclass
class Spec:
    """What one graded notebook's sandboxes hide and where they may write (JSON on disk for the
    nbgrader child; `dlo grade` writes one per submission)."""

    mode: str  # "bwrap" or "none (...)"
    scratch: str  # OUT/work/<student>/<day>: kernel/, capture/, runner/ below
    hidden: list[str] = field(default_factory=list)
    exposed: list[str] = field(default_factory=list)  # read-only again inside hidden folders

    @property
    def kernel_dir(self) -> Path:
        return Path(self.scratch) / "kernel"

    @property
    def capture_dir(self) -> Path:
        return Path(self.scratch) / "capture"

    @property
    def runner_dir(self) -> Path:
        return Path(self.scratch) / "runner"

    @property
    def confined(self) -> bool:
        return self.mode == "bwrap"

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> Spec:
        return cls(**json.loads(Path(path).read_text()))

    def make_dirs(self) -> None:
        for d in (self.kernel_dir / ".home", self.capture_dir, self.runner_dir / ".home"):
            d.mkdir(parents=True, exist_ok=True)

    def kernel_prefix(self) -> list[str]:
        return self._prefix(writable=[self.kernel_dir, self.capture_dir], readonly=[], cwd=self.kernel_dir)

    def runner_prefix(self) -> list[str]:
        return self._prefix(writable=[self.runner_dir], readonly=[self.capture_dir], cwd=self.runner_dir)

    def env(self, cwd: Path) -> dict:
        """HOME and the caches in the sandbox's own scratch (the real HOME is read-only there)."""
        home = cwd / ".home"
        return {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "MPLCONFIGDIR": str(home / ".mpl"),
                "TRITON_CACHE_DIR": str(home / ".triton"), "IPYTHONDIR": str(home / ".ipython")}

    def _prefix(self, writable: list[Path], readonly: list[Path], cwd: Path) -> list[str]:
        if not self.confined:
            return []
        args = [shutil.which("bwrap") or "bwrap", *BASE]
        for h in self.hidden:
            if Path(h).is_dir():
                args += ["--tmpfs", h]
            elif Path(h).exists():
                args += ["--ro-bind", "/dev/null", h]
        for p in self.exposed:
            args += ["--ro-bind", p, p]
        for p in readonly:
            args += ["--ro-bind", str(p), str(p)]
        for p in writable:
            args += ["--bind", str(p), str(p)]
        for k, v in self.env(cwd).items():
            args += ["--setenv", k, v]
        return [*args, "--chdir", str(cwd), "--"]


def make_spec(mode: str, scratch: Path, hidden: list[Path]) -> Spec:
    """The spec of one submission: `hidden` folders (and nothing nested in another), the library and
    the Python environment exposed again where they lie inside a hidden folder."""
    hidden = sorted({p.resolve() for p in hidden if p.exists()})
    hidden = [h for h in hidden if not any(o != h and o in h.parents for o in hidden)]
    import dlo

    needed = {Path(dlo.__file__).resolve().parents[1], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              *(Path(p).resolve() for p in site.getsitepackages())}
    masked = [*hidden, Path("/tmp")]  # BASE gives the sandbox a private /tmp: a checkout or venv there needs it too
    exposed = sorted(str(p) for p in needed if p.exists() and any(h == p or h in p.parents for h in masked))
    return Spec(mode=mode, scratch=str(scratch.resolve()), hidden=[str(h) for h in hidden], exposed=exposed)


def spec_from_env() -> Spec | None:
    path = os.environ.get(SPEC_ENV)
    return Spec.read(path) if path else None


# ----------------------------------------------------------------------------- the kernel

class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started inside the sandbox (`spec` set by the executor before the kernel starts):
    its command gets the bwrap prefix, its working directory, HOME and connection file are in the
    submission's scratch, and an interrupt (SIGINT) goes to the kernel itself: the process group the
    provisioner would signal begins with bwrap, which SIGINT would kill."""

    spec: Spec | None = None

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        return (self.spec.kernel_prefix() if self.spec else []) + cmd

    async def _async_pre_start_kernel(self, **kw):
        if self.spec is not None:
            kw["cwd"] = str(self.spec.kernel_dir)
            kw["env"] = {**(kw.get("env") or os.environ), **self.spec.env(self.spec.kernel_dir)}
            self.connection_file = str(self.spec.kernel_dir / f".kernel-{os.getpid()}-{id(self)}.json")
        return await super()._async_pre_start_kernel(**kw)

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
            kids = _children(pid) if pid else []
            if not kids:
                return None
            pid = kids[0]
            if _comm(pid) != "bwrap":
                return pid
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
