"""How fast `dlo grade` grades a class: CPU seconds per day, per notebook and per process; and a summary.

    .venv/bin/python bench/grade_class.py [--day day3_checkpointing ...] [--students 1]
        [--kind solution|release|mixed] [--jobs 1 [2 ...]] [--stock] [--label after] [-- dlo grade options]
    .venv/bin/python bench/grade_class.py --summary [--before PATTERN ...] [--after PATTERN ...]
        [--cores 16] [--efficiency 1 0.74]

Grading: for each day, a class of `--students` copies of the instructors' solution (`--kind solution`),
of the blank release (`release`), or of both with every 10th broken (`mixed`: not JSON, empty, a
first cell that kills its kernel) is graded by `dlo grade --profile tiny` once per `--jobs` count,
while this process samples /proc every 0.1 s and keeps, for every process of the grading tree, its
last CPU seconds (user + system) and what it is (`KINDS`): `dlo grade` itself, the course build, the
per-submission nbgrader process (autograde, feedback, the trusted checks; forked from the warm start,
counted once per run, unless DLO_GRADE_START=exec), the student's kernel
(the notebook's cells), the sandboxed checks runner, the ranks (of the experiments under the
kernel, of the checks under the runner), bubblewrap. The sampled sum is a lower bound (a process
loses its last 0.1 s; one shorter is not seen); getrusage(RUSAGE_CHILDREN) is printed beside it
but undercounts (the kernel and the runner run under bubblewrap as another user). Wall seconds are
printed too, with the load: on a shared machine the CPU seconds are the steadier figure. The CSVs
of every job count must be the same bytes (exit 1 otherwise). `--stock`: nbgrader's own autograde
of the day's solution in its own kernel, no sandbox (what grading cost before `dlo grade`), beside it.
Prints one JSON object per day and job count; writes bench/results/grade-class-<date>[-label].json.

Summary: the per-notebook CPU seconds of each day (per-run costs, `dlo grade` and the course build,
left out) from the results matching `--before` and `--after` (a later pattern's, then a newer
file's, wins; grade-profile-*.json of the former bench/grade_profile.py read the same), a table, and
what 100 students x 8 days take on `--cores` cores kept busy at each `--efficiency` (1: CPU-bound
work spreads perfectly; 2 cores at 2 jobs measured 0.74 on 2026-11-23). Writes
bench/results/grade-summary-<date>.json. Neither mode is a test: grading takes minutes. One file
(~300 lines) because both modes share the result format and the process categories.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from dlo.registry import names

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
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
WARM = "nbgrader warm start (imports)"  # `nbgrader_cli --warm`: its forks are the per-submission processes
PER_RUN = ("dlo grade", "course build (generate_assignment)", WARM)  # paid once per `dlo grade`, not per notebook


def children_cpu() -> float:
    """User + system seconds of this process's waited-for children (and theirs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- the class

def build_class(day: str, n: int, kind: str, dest: Path) -> dict:
    """n student folders of `kind`; for "mixed", every 10th broken and the rest alternately solution and release."""
    kinds = {}
    for i in range(n):
        student, this = f"s{i:03d}", kind
        nb = dest / student / day / f"{day}.ipynb"
        nb.parent.mkdir(parents=True)
        if kind == "mixed":
            this = ("not-json", "empty", "kills-kernel")[(i // 10) % 3] if i % 10 == 9 else \
                ("solution", "release")[i % 2]
        if this == "not-json":
            nb.write_text("{ this is not a notebook")
        elif this == "empty":
            nb.write_bytes(b"")
        elif this == "kills-kernel":
            data = json.loads((REPO / "course" / day / f"{day}.ipynb").read_text())
            first = next(c for c in data["cells"] if c["cell_type"] == "code")
            first["source"] = "import os\nos._exit(1)\n" + "".join(first["source"])
            nb.write_text(json.dumps(data))
        else:
            shutil.copyfile(REPO / ("solutions" if this == "solution" else "course") / day / f"{day}.ipynb", nb)
        kinds[student] = this
    return kinds


# ----------------------------------------------------------------------------- the profile

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
            info = read_proc(int(entry.name)) if entry.name.isdigit() else None
            if info is None:
                continue
            pid, (ppid, cpu, cmd) = int(entry.name), info
            if pid in seen:
                seen[pid]["cpu"] = max(seen[pid]["cpu"], cpu)
                seen[pid]["cmd"] = cmd or seen[pid]["cmd"]  # a fork takes its exec's command line later
            elif pid == proc.pid or ppid in seen:
                seen[pid] = {"ppid": ppid, "cpu": cpu, "cmd": cmd}
        time.sleep(every)
    return seen


def attribute(seen: dict) -> dict:
    """CPU seconds and process counts by category; ranks named by who started them."""
    by: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0})
    for p in seen.values():
        kind = kind_of(p["cmd"])
        if "--warm" in p["cmd"] and "--warm" not in seen.get(p["ppid"], {}).get("cmd", ""):
            kind = WARM  # the warm process itself, not one of its forks
        if kind == "ranks":
            parent, owner = p["ppid"], "?"
            while parent in seen and owner not in ("kernel", "checks runner"):
                owner, parent = kind_of(seen[parent]["cmd"]), seen[parent]["ppid"]
            kind = "ranks of the experiments (kernel)" if owner == "kernel" else f"ranks of the checks ({owner})"
        by[kind]["cpu_s"] += p["cpu"]
        by[kind]["processes"] += 1
    return {k: {"cpu_s": round(v["cpu_s"], 1), "processes": v["processes"]} for k, v in sorted(by.items())}


def grade(sub: Path, out: Path, jobs: int, graded: int, extra: list[str]) -> dict:
    """One `dlo grade` of the class in `sub`, profiled: CPU seconds by process, per notebook, wall seconds."""
    cmd = [sys.executable, "-m", "dlo.cli", "grade", str(sub), "--out", str(out), "--jobs", str(jobs),
           "--profile", "tiny", *extra]
    before, load, start = children_cpu(), os.getloadavg()[0], time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DLO_PROFILE": "tiny"})
    seen = sample_tree(proc)
    log = proc.stdout.read()
    proc.wait()
    wall, rusage = time.perf_counter() - start, children_cpu() - before
    if proc.returncode != 0:
        raise SystemExit(f"dlo grade failed\n{log[-3000:]}")
    parts = attribute(seen)
    total = sum(p["cpu"] for p in seen.values())
    per_run = sum(v["cpu_s"] for k, v in parts.items() if k in PER_RUN)
    return {"jobs": jobs, "cpu_s_total": round(total, 1), "cpu_s_rusage_children": round(rusage, 1),
            "cpu_s_per_notebook": round((total - per_run) / max(graded, 1), 1), "by_process": parts,
            "wall_s": round(wall, 1), "load_1min_before": round(load, 2),
            "summary": [ln for ln in log.splitlines() if ln.startswith(("graded ", "slowest"))],
            "scores_csv": (out / "scores.csv").read_text(), "cells_csv": (out / "cells.csv").read_text()}


def stock(day: str, tmp: Path) -> float:
    """CPU seconds of nbgrader's own autograde and feedback of the day's solution (its Execute, the test
    cells in the student's kernel, no sandbox), the course root built beforehand and not counted."""
    from dlo.harness.nbgrader_cli import autograde_and_feedback, generate_assignments

    course = tmp / "stock"
    course.mkdir()
    (course / "nbgrader_config.py").write_text("c = get_config()\nc.Execute.timeout = 600\n")
    generate_assignments(REPO / "solutions", [day], course)
    (course / "submitted" / "s" / day).mkdir(parents=True)
    shutil.copyfile(REPO / "solutions" / day / f"{day}.ipynb", course / "submitted" / "s" / day / f"{day}.ipynb")
    os.environ["DLO_GRADE_START"] = "exec"  # a fresh process, this one's child: RUSAGE_CHILDREN counts it
    before = children_cpu()
    proc = autograde_and_feedback(course, course / "gradebook.db", day, "s",
                                  env={"DLO_PROFILE": "tiny", "DLO_HEADLESS": "1"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return round(children_cpu() - before, 1)


def grade_days(args) -> list[dict]:
    results = []
    for day in args.day:
        tmp = Path(tempfile.mkdtemp(prefix="dlo-bench-grade-"))
        try:
            kinds = build_class(day, args.students, args.kind, tmp / "submitted")
            graded = sum(k in ("solution", "release", "kills-kernel") for k in kinds.values())
            runs = [grade(tmp / "submitted", tmp / f"jobs{j}", j, graded, args.extra) for j in args.jobs]
            res = {"day": day, "kind": args.kind, "students": args.students, "graded_notebooks": graded,
                   "options": args.extra, "runs": runs,
                   "identical_csvs": len({(r["scores_csv"], r["cells_csv"]) for r in runs}) == 1,
                   **({"stock_cpu_s": stock(day, tmp)} if args.stock else {})}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps({**res, "runs": [{k: v for k, v in r.items() if not k.endswith("_csv")} for r in runs]},
                         indent=1), flush=True)
        results.append(res)
    return results


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "platform": platform.platform()}


# ----------------------------------------------------------------------------- the summary

def per_day(patterns: list[str]) -> dict:
    """{day: per-notebook CPU seconds, ranks' CPU seconds, file} from the results matching `patterns`
    (this script's runs at one job, or the former grade_profile.py's results): a later one wins."""
    out = {}
    for path in [p for pattern in patterns for p in sorted(glob.glob(str(RESULTS / pattern)))]:
        for r in json.loads(Path(path).read_text())["results"]:
            run = r["runs"][0] if "runs" in r else r
            parts, notebooks = run["by_process"], r.get("graded_notebooks", r["students"])
            total = sum(v["cpu_s"] for k, v in parts.items() if not k.startswith("unseen"))
            per_run = sum(v["cpu_s"] for k, v in parts.items() if k in PER_RUN)
            ranks = sum(v["cpu_s"] for k, v in parts.items() if k.startswith("ranks"))
            out[r["day"]] = {"cpu_s_per_notebook": round((total - per_run) / notebooks, 1), "file": Path(path).name,
                             "ranks_cpu_s": round(ranks, 1), "full_marks": full_marks(run["scores_csv"])}
    return out


def full_marks(scores_csv: str) -> bool:
    """Every graded row of scores.csv at its maximum (the solution's class)."""
    rows = [ln.split(",") for ln in scores_csv.splitlines()[1:]]
    return all(float(r[2]) == float(r[3]) > 0 and r[4] == "graded" for r in rows)


def summary(args) -> dict:
    before, after = per_day(args.before), per_day(args.after)
    days = sorted(set(before) | set(after))
    rows = [{"day": d, **{f"{label}_{k}": side.get(d, {}).get(k) for label, side in (("before", before),
                                                                                    ("after", after))
                          for k in ("cpu_s_per_notebook", "ranks_cpu_s", "full_marks")}} for d in days]
    for r in rows:
        before_s, after_s = (("-" if r[k] is None else r[k]) for k in ("before_cpu_s_per_notebook",
                                                                       "after_cpu_s_per_notebook"))
        print(f"{r['day']:28s} before {before_s:>6} s   after {after_s:>6} s   "
              f"(ranks {r['before_ranks_cpu_s']} -> {r['after_ranks_cpu_s']})")
    extrapolation = []
    for label in ("before", "after"):
        vals = [r[f"{label}_cpu_s_per_notebook"] for r in rows if r[f"{label}_cpu_s_per_notebook"] is not None]
        if not vals or len(vals) < len(days):
            continue
        mean = sum(vals) / len(vals)
        for eff in args.efficiency:
            minutes = 800 * mean / (args.cores * eff) / 60
            extrapolation.append({"profile": label, "cpu_s_per_notebook_mean": round(mean, 1), "cores": args.cores,
                                  "efficiency": eff, "minutes": round(minutes, 1)})
            print(f"{label}: mean {mean:.1f} CPU s per notebook -> 100 x 8 on {args.cores} cores at efficiency "
                  f"{eff}: {minutes:.1f} min")
    return {"days": rows, "extrapolation": extrapolation}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--day", nargs="+", default=["day3_checkpointing", "day7_tensor_parallel"], choices=names())
    ap.add_argument("--students", type=int, default=1)
    ap.add_argument("--kind", default="solution", choices=["solution", "release", "mixed"])
    ap.add_argument("--jobs", type=int, nargs="+", default=[1])
    ap.add_argument("--stock", action="store_true", help="also nbgrader's own autograde of the solution, no sandbox")
    ap.add_argument("--label", default="", help="a word for the result's file name (before, after, ...)")
    ap.add_argument("--summary", action="store_true", help="summarise earlier results instead of grading")
    ap.add_argument("--before", nargs="+", default=["grade-profile-*-before.json", "grade-class-*-before.json"])
    ap.add_argument("--after", nargs="+", default=["grade-profile-*-after.json", "grade-profile-*-after-*.json",
                                                   "grade-class-*-after.json"])
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--efficiency", type=float, nargs="+", default=[1.0, 0.74])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("extra", nargs="*", help="more `dlo grade` options (after --)")
    args = ap.parse_args()
    stamp = datetime.now()
    if args.summary:
        result, name, ok = summary(args), f"grade-summary-{stamp:%Y%m%d-%H%M}.json", True
    else:
        results = grade_days(args)
        result = {"cores": os.cpu_count(), "machine": machine(), "results": results}
        name, ok = f"grade-class-{stamp:%Y%m%d-%H%M}{'-' + args.label if args.label else ''}.json", \
            all(r["identical_csvs"] for r in results)
    dest = Path(args.out) / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}, indent=1))
    print(dest)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
