"""One prepared GPU session: the course's GPU path proven step by step, the riskiest first, into one JSON.

    bash bench/gpu_check.sh [--cpu] [--budget S] [--jobs N] [--only A,B] [--skip A,B] [--resume OLD.json]
    python bench/gpu_session.py --list [--cpu]            # the steps, their budgets and the risk each retires

`bench/gpu_check.sh` installs what the node lacks (`bench/carry_wheels.sh`'s wheels) and then runs this.
Each step of `STEPS` is one command (`bench/gpu_steps.py NAME`, a child process in a session of its own)
with its own time budget (the seconds it should take: it starts only if the session has that much left)
and timeout (then its process tree is stopped). Steps start in their order, up to `--jobs` at a time;
an `exclusive` step (a timing another process on the GPU would spoil: the 3B MFU, `dlo bench`) waits
for the others and runs alone. What each one did is written to OUT/<date>T<HHMM>_<device>_gpu-session.json
as soon as it ends (so a run cut off at its limit keeps the steps done): ok / failed / timeout / skipped
with the reason, its seconds, the steps that ran beside it, its numbers (every number it measured,
agreeing with the course's claims or not: the step writes them to $DLO_STEP_RESULT) and the tail of its
log. Beside it: ..._gpu-session-logs.txt (every step's log) and ..._gpu-session-files.tar.gz (executed
notebooks, grading CSVs, bench JSON: what the steps kept). `--resume OLD.json` takes OLD's finished
steps (ok or failed) as they are and runs the rest, into a new file. `--cpu` is the dry run on a machine
without a GPU: the same runner and steps at the tiny profile's sizes, those needing CUDA skipped ("no GPU").

Stdlib only, and `dlo.reaper` (stdlib too) for the process trees: the runner must record a step whose
import of torch or dlo fails. (Over 300 lines with the step list: the list is the session's plan.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
from dlo import reaper  # noqa: E402 - stdlib only; after the path of this checkout's lib

SHARE_ENV = "DLO_CORES"  # dlo.claims.SHARE_ENV (tests/test_gpu_session.py checks they agree): a step's core share
RESULT_ENV = "DLO_STEP_RESULT"  # the JSON file a step writes its numbers to
WORK_ENV = "DLO_STEP_WORK"  # the step's scratch folder
KEEP_ENV = "DLO_STEP_KEEP"  # what the step keeps: into the session's files archive
CPU_SLOWER = 4  # --cpu: a shared CPU box is slower than the GPU node's 16 cores at every step
TAIL_LINES = 40
LOG_CAP = 400_000  # bytes of one step's log in the logs file (its tail)
FILES_CAP = 15 << 20  # the archive of kept files (the device tool returns files up to 16 MiB)
BUDGET_GPU_S = 540  # 9 minutes, the session's limit in issue 32 (the device tool's call: 600 s at most)


@dataclass
class Step:
    """One command of the session. `budget`: the seconds it should need on the GPU node (it starts only
    when that much is left); `timeout`: when it is stopped; `cpu`: whether it has a CPU version (the dry
    run; else it is skipped there, "no GPU"); `exclusive`: runs alone."""

    name: str
    why: str
    budget: float
    timeout: float
    args: list[str] = field(default_factory=list)
    cpu: bool = True
    exclusive: bool = False
    cmd: list[str] | None = None  # the command, when not `bench/gpu_steps.py NAME ARGS` (tests)


DAYS_BY_RISK = ["day5_fsdp", "day7_tensor_parallel", "day10_context_experts", "day6_pipeline", "day4_ddp",
                "day8_quantization_pruning", "day1_optimizers", "day2_mixed_precision", "day3_checkpointing",
                "day11_learning_faster", "day9_inference"]  # never run on a GPU first; Day 11: its studies on the
                                                            # GPU, NVML's energy; Day 9: its day9_serve step too

STEPS = [
    Step("env", "the node's torch/CUDA/NCCL/Triton (the locked versions cannot be carried), the carried packages "
                "importable as the grader's isolated runner imports them, bwrap, a C compiler", 20, 90),
    Step("doctor", "`dlo doctor` on a GPU node: every line ok, or the FIX a TA would read", 40, 150),
    Step("launch", "`launch` with NCCL at world 1 from a parent holding a CUDA context, in every start mode "
                   "(fork server, zygote, exec)", 40, 150),
    Step("sandbox", "CUDA, a Triton JIT, torch.compile and NCCL world 1 inside the grading sandbox (bubblewrap, "
                    "uid 65534, private /dev and network): never run before", 60, 240),
    Step("day5_3b", "Day 5's recipe on Llama 3.2 3B at world 1 (FSDP2, bf16, activation checkpointing, compile; "
                    "random weights of the real config): MFU, and peak memory beside `dlo plan`", 150, 360,
         exclusive=True),
    Step("grade", "`dlo grade` of one notebook on the GPU (the student's kernel and the checks' runner in the "
                  "sandbox, the full profile's smoke sizes): full marks", 120, 360),
    Step("day4_ddp", "Day 4's data-parallel versions (dlo's naive and bucketed, torch DDP) on NCCL at world 1, "
                     "ResNet-18 at 224 px", 45, 180),
    Step("day10_cp", "Day 10's ring attention on NCCL (world = the GPUs) against SDPA on one process and torch's "
                     "context_parallel (GPU only); the MoE layer's step against a dense one of its active parameters",
         60, 240),
    Step("day3_resume", "Day 3 at the full profile (155M model, 8 x 1024 tokens) with a 15-step resume: "
                        "bit-identical losses after preemption on a GPU", 150, 360, ["--max-steps", "15"]),
    *[Step(f"smoke_{d.split('_')[0]}", f"{d} at the full profile with cut steps (`dlo run {d} --profile full "
                                       f"--smoke`)", 90, 300, ["--day", d]) for d in DAYS_BY_RISK],
    Step("day9_serve", "Day 9 at the full profile (Llama 3.2 3B, bf16): decode with and without the cache, "
                       "reserved vs used paged vs contiguous, continuous vs static tokens/s, speculative speed-up",
         240, 600, exclusive=True),
    Step("day9_decode", "Day 9's split-K W4A16 decode kernel against Day 8's W4A16 kernel and torch bf16 at M = 1, "
                        "4, 16 on Llama 3.2 1B/3B's projections: does int4 beat bf16 at one token (never run on a GPU)",
         90, 300, exclusive=True),
    Step("gpu_tests", "the kernel, optimizer, AMP and quantization tests on the GPU (Triton compiled, "
                      "not interpreted), and the checks' CUDA paths (Days 2-3)", 60, 240, cpu=False),
    Step("bench", "`dlo bench`: every kernel beside torch and its roofline on this GPU (Day 9's decode kernel: its "
                  "own step)", 60, 240, cpu=False,
         exclusive=True),
]


# ----------------------------------------------------------------------------- the record

def device_name(cpu: bool) -> tuple[str, str]:
    """(the GPU's name, its slug for file names: "nvidia-h200"), ("cpu", "cpu") in the dry run."""
    if cpu:
        return "cpu", "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    name = out[0].strip() if out else "unknown-gpu"
    return name, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_state() -> dict:
    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        return ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def read(path: str | None) -> str:
    with contextlib.suppress(OSError, TypeError):
        return Path(path).read_text()[-4000:]
    return ""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, io.SEEK_END) - 16_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Session:
    """The JSON record, rewritten whole (atomically) at every change."""

    def __init__(self, path: Path, meta: dict, steps: list[Step]):
        self.path, self.meta = path, meta
        self.steps = {s.name: {"name": s.name, "why": s.why, "status": "pending", "budget_s": s.budget,
                               "timeout_s": s.timeout, "exclusive": s.exclusive} for s in steps}
        self.write()

    def update(self, step: str, **values) -> None:
        self.steps[step].update(values)
        self.write()

    def write(self, finished: bool = False) -> None:
        counts: dict[str, int] = {}
        for rec in self.steps.values():
            counts[rec["status"]] = counts.get(rec["status"], 0) + 1
        data = {"session": {**self.meta, "finished": finished}, "summary": counts, "steps": list(self.steps.values())}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


# ----------------------------------------------------------------------------- running the steps

@dataclass
class Running:
    step: Step
    proc: subprocess.Popen
    start: float
    deadline: float
    log: Path
    result: Path
    beside: set = field(default_factory=set)


class Runner:
    def __init__(self, steps: list[Step], session: Session, work: Path, *, budget: float, jobs: int, cpu: bool,
                 t0: float, python: str, logs: Path | None = None):
        self.todo, self.session, self.work = list(steps), session, work
        self.budget, self.jobs, self.cpu, self.t0, self.python = budget, max(1, jobs), cpu, t0, python
        self.logs = logs
        self.running: dict[str, Running] = {}

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def run(self) -> None:
        try:
            while self.todo or self.running:
                self._start_what_may_start()
                self._reap()
                time.sleep(0.05)
        except KeyboardInterrupt as stop:  # the session itself was stopped (SIGTERM at a limit, Ctrl-C)
            for name in list(self.running):
                self._finish(name, status="timeout", reason=f"the session was stopped ({stop})")
            for step in self.todo:
                self.session.update(step.name, status="skipped", reason=f"the session was stopped ({stop})")
            self.todo = []

    def _may_start(self, step: Step) -> bool:
        if not self.running:
            return True
        if step.exclusive or any(r.step.exclusive for r in self.running.values()):
            return False
        return len(self.running) < self.jobs

    def _start_what_may_start(self) -> None:
        while self.todo:
            step = self.todo[0]
            if self.cpu and not step.cpu:
                self.todo.pop(0)
                self.session.update(step.name, status="skipped", reason="no GPU (the --cpu dry run)")
                continue
            need = step.budget * (CPU_SLOWER if self.cpu else 1)
            if self.left() < need:
                self.todo.pop(0)
                self.session.update(step.name, status="skipped", reason=f"out of time: {max(0, self.left()):.0f} s "
                                    f"of the session's {self.budget:.0f} s left, the step needs ~{need:.0f} s")
                continue
            if not self._may_start(step):
                return
            self.todo.pop(0)
            self._start(step)

    def _start(self, step: Step) -> None:
        scratch = self.work / step.name
        keep = self.work / "keep" / step.name
        for d in (scratch, keep, self.work / "logs", self.work / "results"):
            d.mkdir(parents=True, exist_ok=True)
        log, result = self.work / "logs" / f"{step.name}.log", self.work / "results" / f"{step.name}.json"
        cmd = step.cmd or [self.python, str(ROOT / "bench" / "gpu_steps.py"), step.name, *step.args,
                           *(["--cpu"] if self.cpu else [])]
        env = {**os.environ, RESULT_ENV: str(result), WORK_ENV: str(scratch), KEEP_ENV: str(keep),
               "PYTHONUNBUFFERED": "1", "DLO_PROGRESS": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "lib"), os.environ.get("PYTHONPATH")]))}
        if self.jobs > 1 and not step.exclusive:  # a share of the cores, as `dlo run --jobs N` gives its notebooks
            share = str(max(1, len(os.sched_getaffinity(0)) // self.jobs))
            env = {SHARE_ENV: share, "OMP_NUM_THREADS": share, **env}
        timeout = min(step.timeout * (CPU_SLOWER if self.cpu else 1), max(1.0, self.left()))
        with open(log, "wb") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        now = time.time()
        run = Running(step, proc, now, now + timeout, log, result, beside=set(self.running))
        for other in self.running.values():
            other.beside.add(step.name)
        self.running[step.name] = run
        self.session.update(step.name, status="running", started_s=round(now - self.t0, 1),
                            timeout_s=round(timeout, 1), log=str(log.relative_to(self.work)))

    def _reap(self) -> None:
        for name, run in list(self.running.items()):
            if run.proc.poll() is not None:
                self._finish(name, status="ok" if run.proc.returncode == 0 else "failed")
            elif time.time() > run.deadline:
                self._finish(name, status="timeout", reason=f"stopped after {run.deadline - run.start:.1f} s")

    def _finish(self, name: str, status: str, reason: str = "") -> None:
        run = self.running.pop(name)
        if run.proc.poll() is None:
            stop(run.proc)
        numbers = {}
        with contextlib.suppress(OSError, ValueError):
            numbers = json.loads(run.result.read_text())
        rc = run.proc.returncode
        if status == "failed" and not reason:
            reason = numbers.pop("failure", "") or f"exit status {rc}"
        self.session.update(name, status=status, reason=reason, rc=rc, seconds=round(time.time() - run.start, 1),
                            beside=sorted(run.beside), numbers=numbers, log_tail=tail(run.log))
        if self.logs is not None:
            append_log(self.logs, name, status, run.log)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM first (`dlo run`/`dlo grade` and the steps end their own trees and write what they have),
    then the whole tree, killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    reaper.kill_tree(proc.pid)
    proc.wait()


def append_log(logs: Path, name: str, status: str, log: Path) -> None:
    try:
        data = log.read_bytes()
    except OSError:
        data = b""
    cut = b"" if len(data) <= LOG_CAP else f"[... first {len(data) - LOG_CAP} bytes left out ...]\n".encode()
    with open(logs, "ab") as f:
        f.write(f"\n{'=' * 100}\n== {name}: {status}\n{'=' * 100}\n".encode() + cut + data[-LOG_CAP:])


def archive(keep: Path, dest: Path, cap: int = FILES_CAP) -> list[str]:
    """Tar.gz of what the steps kept, smallest files first up to `cap` bytes; the files left out."""
    files = sorted((p for p in keep.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    left_out, total = [], 0
    with tarfile.open(dest, "w:gz") as tar:
        for p in files:
            size = p.stat().st_size
            if total + size > cap:
                left_out.append(f"{p.relative_to(keep)} ({size} bytes)")
                continue
            tar.add(p, arcname=str(p.relative_to(keep)))
            total += size
    return left_out


# ----------------------------------------------------------------------------- the command

def select(steps: list[Step], only: str, skip: str) -> list[Step]:
    names = {s.name for s in steps}
    wanted = [n for n in (only + "," + skip).split(",") if n]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"gpu_session: no step {', '.join(unknown)}; steps: {', '.join(s.name for s in steps)}")
    only_set, skip_set = set(filter(None, only.split(","))), set(filter(None, skip.split(",")))
    return [s for s in steps if (not only_set or s.name in only_set) and s.name not in skip_set]


def carried(old: Path) -> dict[str, dict]:
    """The finished steps (ok or failed) of an earlier session's JSON, as they were."""
    try:
        data = json.loads(old.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"gpu_session: --resume {old}: not a session's JSON ({exc})") from None
    return {r["name"]: {**r, "from": old.name} for r in data.get("steps", []) if r.get("status") in ("ok", "failed")}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the dry run: no GPU, tiny sizes, CUDA-only steps skipped")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the three files go")
    p.add_argument("--work", type=Path, default=None, help="scratch (default: a new folder under $TMPDIR)")
    p.add_argument("--budget", type=float, default=None, help=f"seconds for the whole session (GPU: {BUDGET_GPU_S})")
    p.add_argument("--jobs", type=int, default=None, help="steps at once (GPU: 4; --cpu: 1)")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated step names to leave out")
    p.add_argument("--resume", type=Path, default=None, help="an earlier session's JSON: its finished steps kept")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    args = parse(argv)
    steps = select(steps or STEPS, args.only, args.skip)
    if args.list:
        for s in steps:
            print(f"{s.name:<13} {s.budget:>4.0f} s (stop at {s.timeout:.0f}){' alone' if s.exclusive else ''}"
                  f"{'' if s.cpu else ' GPU only'}: {s.why}")
        return 0
    if not args.cpu and shutil.which("nvidia-smi") is None:
        print("gpu_session: no GPU here (nvidia-smi not found): --cpu runs the dry run", file=sys.stderr)
        return 2
    t0 = float(os.environ.get("DLO_SESSION_T0") or time.time())  # gpu_check.sh's start: its set-up counts
    budget = args.budget or (BUDGET_GPU_S if not args.cpu else 3600.0)
    jobs = args.jobs or (1 if args.cpu else 4)
    done = carried(args.resume) if args.resume else {}
    name, slug = device_name(args.cpu)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{stamp}_{slug}_gpu-session"
    work = (args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"dlo-gpu-session-{stamp}-{os.getpid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    meta = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": name,
            "mode": "cpu (dry run)" if args.cpu else "gpu", "budget_s": budget, "jobs": jobs, "argv": sys.argv[1:],
            "python": sys.executable, "cores": len(os.sched_getaffinity(0)), "work": str(work), **git_state(),
            "resumed_from": str(args.resume or ""), "setup": read(os.environ.get("DLO_SESSION_SETUP")),
            "note": "torch and Triton are the node's own: the locked CUDA build of requirements/gpu.txt is GBs of "
                    "wheels, over the device tool's 64 MiB carry limit (the env step records both versions)"}
    session = Session(Path(f"{base}.json"), meta, steps)
    for rec in done.values():
        if rec["name"] in session.steps:
            session.update(rec["name"], **rec)
    logs = Path(f"{base}-logs.txt")
    logs.write_text(f"GPU session {stamp} on {name}: every step's log (its last {LOG_CAP} bytes)\n")
    todo = [s for s in steps if s.name not in done]
    print(f"gpu_session: {len(todo)} steps, {budget:.0f} s, {jobs} at a time -> {base}.json", flush=True)
    with reaper.stopping():
        Runner(todo, session, work, budget=budget, jobs=jobs, cpu=args.cpu, t0=t0, python=sys.executable,
               logs=logs).run()
        reaper.kill_tree(os.getpid(), include_root=False)  # anything a step left behind
    left_out = archive(work / "keep", Path(f"{base}-files.tar.gz"))
    session.meta.update(seconds=round(time.time() - t0, 1), files_left_out=left_out)
    session.write(finished=True)
    for rec in session.steps.values():
        print(f"{rec['name']:<13} {rec['status']:<8} {rec.get('seconds', '-'):>6} s  {rec.get('reason', '')}")
    return 0 if all(r["status"] == "ok" for r in session.steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
