"""Benchmark of `dlo grade --jobs`: a synthetic class of one day, graded at several job counts.

    .venv/bin/python bench/grade_class.py [--day day1_optimizers] [--students 40] [--jobs 1 2]

The class: mostly the instructors' solution and the blank release, plus a few broken submissions
(a notebook that is not JSON, an empty one, one whose first code cell kills its kernel). Each job
count grades the same class into its own folder; the CSVs must be the same bytes. The result (wall
times, speed-up, parallel efficiency, and the extrapolated time of 100 students x 8 days on a
16-core node at that efficiency) goes to bench/results/grade-class-<date>.json with a description
of the machine and its load, and is printed. Not a test: it takes minutes per job count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_class(day: str, n: int, dest: Path) -> dict:
    """n student folders: every 10th broken, the rest alternately solution and blank release."""
    kinds = {}
    for i in range(n):
        student = f"s{i:03d}"
        folder = dest / student / day
        folder.mkdir(parents=True)
        nb = folder / f"{day}.ipynb"
        if i % 10 == 9:
            kind = ("not-json", "empty", "kills-kernel")[(i // 10) % 3]
            if kind == "not-json":
                nb.write_text("{ this is not a notebook")
            elif kind == "empty":
                nb.write_bytes(b"")
            else:
                data = json.loads((REPO / "course" / day / f"{day}.ipynb").read_text())
                first = next(c for c in data["cells"] if c["cell_type"] == "code")
                first["source"] = "import os\nos._exit(1)\n" + "".join(first["source"])
                nb.write_text(json.dumps(data))
        else:
            kind = "solution" if i % 2 == 0 else "release"
            shutil.copyfile(REPO / ("solutions" if kind == "solution" else "course") / day / f"{day}.ipynb", nb)
        kinds[student] = kind
    return kinds


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(int(mem) / 2 ** 20, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--day", default="day1_optimizers")
    ap.add_argument("--students", type=int, default=40)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dlo-bench-grade-"))
    kinds = build_class(args.day, args.students, tmp / "submitted")
    runs, csvs = [], {}
    for jobs in args.jobs:
        out = tmp / f"jobs{jobs}"
        load = os.getloadavg()
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dlo.cli", "grade", str(tmp / "submitted"), "--out", str(out),
                               "--jobs", str(jobs), "--profile", "tiny"], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return 1
        csvs[jobs] = ((out / "scores.csv").read_bytes(), (out / "cells.csv").read_bytes())
        runs.append({"jobs": jobs, "wall_s": round(wall, 1), "load_before": [round(x, 2) for x in load],
                     "load_after": [round(x, 2) for x in os.getloadavg()],
                     "summary": [ln for ln in proc.stdout.splitlines() if ln.startswith(("graded ", "slowest"))]})
        print(f"--jobs {jobs}: {wall:.1f} s", flush=True)
    base = runs[0]
    graded = sum(k in ("solution", "release", "kills-kernel") for k in kinds.values())
    per_nb = base["wall_s"] / graded
    for r in runs:
        r["speedup"] = round(base["wall_s"] / r["wall_s"], 2)
        r["efficiency"] = round(r["speedup"] / (r["jobs"] / base["jobs"]), 2)
    best = runs[-1]
    notebooks, node_cores = 100 * 8, 16
    # the efficiency measured at the largest job count, assumed to hold at one job per core on the node
    hours = notebooks * per_nb / (node_cores * best["efficiency"]) / 3600
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "day": args.day,
              "students": args.students, "graded_notebooks": graded, "kinds": {k: list(kinds.values()).count(k)
                                                                                for k in sorted(set(kinds.values()))},
              "machine": machine(), "runs": runs, "identical_csvs": len(set(csvs.values())) == 1,
              "seconds_per_notebook_jobs1": round(per_nb, 1),
              "extrapolation": {"notebooks": notebooks, "node_cores": node_cores, "jobs": node_cores,
                                "efficiency_assumed": best["efficiency"], "hours": round(hours, 2),
                                "hours_sequential_here": round(notebooks * per_nb / 3600, 1)}}
    dest = Path(args.out) / f"grade-class-{datetime.now():%Y%m%d-%H%M}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if result["identical_csvs"] else 1


if __name__ == "__main__":
    sys.exit(main())
