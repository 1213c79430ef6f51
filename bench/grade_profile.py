"""Where the CPU seconds of grading one notebook go: a profile by process, for one or more days.

    .venv/bin/python bench/grade_profile.py [--day day3_checkpointing ...] [--kind solution|release]
                                            [--students 1] [-- extra dlo grade options, e.g. --full-notebook]

Each day's notebook (the instructors' solution, or the blank release) is graded by `dlo grade --jobs 1
--profile tiny` as a class of `--students` copies, while this process samples /proc every 0.1 s and keeps,
for every process of the grading tree, its last CPU seconds (user + system) and what it is: the `dlo grade`
process, the course build (nbgrader generate_assignment), the per-submission nbgrader process (autograde
and feedback: nbgrader, its database, the trusted checks), the student's Jupyter kernel (the notebook's
own cells), the sandboxed checks runner (dlo.grading.jail_runner) and its per-check forks, the ranks
(under the kernel: the notebook's experiments; under the runner: the checks'; a launch's zygote counts
as one of them), bubblewrap and the sandbox probe. The total is
the sum of the sampled processes (a lower bound: a process loses what it spent in its last 0.1 s, and
one shorter than that is not seen); getrusage(RUSAGE_CHILDREN) is recorded beside it but undercounts:
the kernel and the runner run under bubblewrap as another user, and their CPU never reaches this process
through wait(). CPU seconds, not wall time: on a shared machine they are the steadier figure. The result
goes to bench/results/grade-profile-<date>.json and is printed; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
# (category, words that all appear in the command line), first match wins
KINDS = [
    ("ranks", ("dlo.distributed._worker",)),
    ("checks runner", ("jail_runner",)),
    ("kernel", ("ipykernel",)),
    ("course build (generate_assignment)", ("nbgrader_cli", "generate")),
    ("nbgrader (autograde, feedback, checks)", ("nbgrader_cli",)),
    ("dlo grade", ("dlo.cli", "grade")),
    ("bwrap", ("bwrap",)),
    ("sandbox probe", ("-I", "-c")),
]


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def read_proc(pid: int) -> tuple[int, float, str] | None:
    """(ppid, CPU seconds of the process itself, command line) or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, cmd


def kind_of(cmd: str) -> str:
    for name, words in KINDS:
        if all(w in cmd for w in words):
            return name
    return "other: " + " ".join(Path(w).name for w in cmd.split()[:3])


def sample_tree(proc: subprocess.Popen, every: float = 0.1) -> dict:
    """{pid: {"ppid", "cpu", "cmd"}} of `proc` and its descendants, until it ends."""
    seen: dict[int, dict] = {}
    while proc.poll() is None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            info = read_proc(pid)
            if info is None:
                continue
            ppid, cpu, cmd = info
            if pid in seen:
                seen[pid]["cpu"] = max(seen[pid]["cpu"], cpu)
                if cmd:
                    seen[pid]["cmd"] = cmd  # a fork takes its exec's command line later
            elif pid == proc.pid or ppid in seen:
                seen[pid] = {"ppid": ppid, "cpu": cpu, "cmd": cmd}
        time.sleep(every)
    return seen


def attribute(seen: dict) -> dict:
    """CPU seconds and process counts by category; ranks named by who started them."""
    by: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0})
    for p in seen.values():
        kind = kind_of(p["cmd"])
        if kind == "ranks":
            parent, owner = p["ppid"], "?"
            while parent in seen:
                owner = kind_of(seen[parent]["cmd"])
                if owner in ("kernel", "checks runner"):
                    break
                parent = seen[parent]["ppid"]
            kind = "ranks of the experiments (kernel)" if owner == "kernel" else f"ranks of the checks ({owner})"
        by[kind]["cpu_s"] += p["cpu"]
        by[kind]["processes"] += 1
    return {k: {"cpu_s": round(v["cpu_s"], 1), "processes": v["processes"]} for k, v in sorted(by.items())}


def profile_day(day: str, kind: str, students: int, extra: list[str], tmp: Path) -> dict:
    sub, out = tmp / day / "submitted", tmp / day / "out"
    src = REPO / ("solutions" if kind == "solution" else "course") / day / f"{day}.ipynb"
    for i in range(students):
        (sub / f"s{i:02d}" / day).mkdir(parents=True)
        shutil.copyfile(src, sub / f"s{i:02d}" / day / f"{day}.ipynb")
    cmd = [sys.executable, "-m", "dlo.cli", "grade", str(sub), "--out", str(out), "--jobs", "1", "--profile",
           "tiny", *extra]
    before, load = children_cpu(), os.getloadavg()[0]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DLO_PROFILE": "tiny"})
    seen = sample_tree(proc)
    log = proc.stdout.read()
    proc.wait()
    total = children_cpu() - before
    if proc.returncode != 0:
        raise SystemExit(f"{day}: dlo grade failed\n{log[-3000:]}")
    parts = attribute(seen)
    rusage, total = total, sum(p["cpu"] for p in seen.values())
    scores = (out / "scores.csv").read_text()
    per_run = sum(v["cpu_s"] for k, v in parts.items() if k in ("dlo grade", "course build (generate_assignment)"))
    return {"day": day, "kind": kind, "students": students, "options": extra, "cpu_s_total": round(total, 1),
            "cpu_s_rusage_children": round(rusage, 1),
            "cpu_s_per_notebook": round(total / students, 1),
            "cpu_s_per_notebook_without_run_overhead": round((total - per_run) / students, 1),
            "by_process": parts, "load_1min_before": round(load, 2),
            "record_seconds": [json.loads(p.read_text())["seconds"] for p in sorted((out / "results").rglob("*.json"))],
            "scores_csv": scores}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--day", nargs="+", default=["day3_checkpointing", "day7_tensor_parallel"])
    ap.add_argument("--kind", default="solution", choices=["solution", "release"])
    ap.add_argument("--students", type=int, default=1)
    ap.add_argument("--label", default="", help="a word for the result's file name (before, after, ...)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("extra", nargs="*", help="more `dlo grade` options (after --)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dlo-bench-profile-"))
    results = []
    try:
        for day in args.day:
            res = profile_day(day, args.kind, args.students, args.extra, tmp)
            print(json.dumps({k: v for k, v in res.items() if k != "scores_csv"}, indent=1), flush=True)
            results.append(res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dest = Path(args.out) / f"grade-profile-{datetime.now():%Y%m%d-%H%M}{'-' + args.label if args.label else ''}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "cores": os.cpu_count(), "results": results}, indent=1))
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
