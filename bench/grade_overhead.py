"""What the grader's sandbox costs per notebook: nbgrader's own autograde vs `dlo grade`.

    .venv/bin/python bench/grade_overhead.py [--day day1_optimizers] [--repeats 2]

"stock": nbgrader's autograde and feedback of the day's solution notebook with its own Execute (the
test cells run in the student's kernel, no sandbox): grading as it was before the sandbox. "dlo":
`dlo grade --jobs 1` of the same notebook (test cells outside the kernel, kernel and runner under
bubblewrap). Both time the per-submission grading process only (not building the course root); runs
alternate to share the machine's load, and the CPU seconds of the whole process tree are recorded
beside the wall time (on a shared machine the CPU time is the steadier figure). The result goes to
bench/results/grade-overhead-<date>.json.
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
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STOCK = "c = get_config()\nc.Execute.timeout = 600\n"


def stock(day: str, nb: Path, tmp: Path) -> float:
    from dlo.harness.nbgrader_cli import autograde_and_feedback, generate_assignments

    course = tmp / "stock"
    shutil.rmtree(course, ignore_errors=True)
    course.mkdir()
    (course / "nbgrader_config.py").write_text(STOCK)
    generate_assignments(REPO / "solutions", [day], course)
    (course / "submitted" / "s" / day).mkdir(parents=True)
    shutil.copyfile(nb, course / "submitted" / "s" / day / f"{day}.ipynb")
    start = time.perf_counter()
    proc = autograde_and_feedback(course, course / "gradebook.db", day, "s",
                                  env={"DLO_PROFILE": "tiny", "DLO_HEADLESS": "1"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - start


def sandboxed(day: str, nb: Path, tmp: Path) -> float:
    sub, out = tmp / "sub", tmp / "dlo"
    shutil.rmtree(out, ignore_errors=True)
    (sub / "s" / day).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(nb, sub / "s" / day / f"{day}.ipynb")
    proc = subprocess.run([sys.executable, "-m", "dlo.cli", "grade", str(sub), "--out", str(out), "--jobs", "1",
                           "--profile", "tiny"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    return json.loads((out / "results" / "s" / f"{day}.json").read_text())["seconds"]


def cpu_seconds() -> float:
    """User + system seconds of this process's finished children (and theirs, as they were waited for)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--day", default="day1_optimizers")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    nb = REPO / "solutions" / args.day / f"{args.day}.ipynb"
    tmp = Path(tempfile.mkdtemp(prefix="dlo-bench-overhead-"))
    times = {"stock": [], "dlo": []}
    cpu = {"stock": [], "dlo": []}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, fn in (("stock", stock), ("dlo", sandboxed)):
            before = cpu_seconds()
            times[name].append(round(fn(args.day, nb, tmp), 1))
            cpu[name].append(round(cpu_seconds() - before, 1))  # includes building the course root
        loads.append(os.getloadavg()[0])
        print(times, cpu, flush=True)
    best = {k: min(v) for k, v in times.items()}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "day": args.day,
              "notebook": "solution", "seconds": times, "best": best,
              "cpu_seconds_including_setup": cpu,
              "overhead": round(best["dlo"] / best["stock"] - 1, 3), "load_1min": [round(x, 2) for x in loads],
              "cores": os.cpu_count()}
    dest = Path(args.out) / f"grade-overhead-{datetime.now():%Y%m%d-%H%M}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
