"""What an honest submission needs of the limits `dlo grade` puts on each job: the peaks per day.

    .venv/bin/python bench/grade_peaks.py [--day day4_ddp ...] [--every 0.2] [--label before] [-- dlo grade options]

For each day, the instructors' solution is graded alone (`dlo grade --profile tiny --jobs 1`, as root: the
sandboxes' processes are those of its tree that are not root's) while this process samples /proc every
`--every` seconds and keeps the peak of what each limit counts (`dlo.grading.limits`):

- memory: the sum over the sandboxes' processes of their own resident pages (RssAnon, what the job's
  watch adds up first; pages a fork shares with its parent count in both) and, beside it, of their
  proportional share (Pss_Anon of smaps_rollup: shared pages split, what the watch decides on), the largest
  process's RssAnon and the largest VmData (what RLIMIT_DATA bounds: private writable memory, mapped or not);
- tasks: the processes and threads of the job's uid at once (RLIMIT_NPROC counts threads), zombies apart,
  and what the processes were at that peak (their command's first words);
- the largest file in the job's scratch folders and in its sandboxes' /tmp and /dev/shm, and the bytes
  in each tmpfs (read through /proc/PID/root);
- the day's score (full marks expected: exit 1 otherwise).

A peak between two samples is missed: the numbers are lower bounds, and the defaults leave room above
them. Prints one JSON object per day; writes bench/results/grade-peaks-<date>[-label].json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MIB = 2 ** 20


def status(pid: int) -> dict:
    """/proc/PID/status as {key: first word}; {} once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: v.split()[0] for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v.split()}


def pss_anon(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(ln.split()[1]) * 1024 for ln in text.splitlines() if ln.startswith("Pss_Anon:"))


def tree_usage(top: Path) -> tuple[int, int]:
    """(bytes in files, largest file) below `top`, links not followed."""
    total = largest = 0
    for folder, _, names in os.walk(top):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            total += st.st_blocks * 512
            largest = max(largest, st.st_size)
    return total, largest


def descendants(root: int) -> list[int]:
    """`root`'s descendants, zombies included (other developers' sandboxes are uid 65534 too: never theirs)."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        below = kids.get(todo.pop(), [])
        out += below
        todo += below
    return out


def sample(root: int, scratch: Path, peak: dict) -> None:
    """One look at the sandboxes (the processes below `root` that are not root's) and the scratch; `peak`
    keeps the maxima."""
    rss = pss = tasks = procs = biggest = vmdata = zombies = 0
    roots, kinds = {}, {}
    for pid in descendants(root):
        st = status(pid)
        if not st or int(st.get("Uid", 0)) == 0:
            continue
        anon = int(st.get("RssAnon", 0)) * 1024
        if st.get("State") == "Z":  # holds no memory, but its pid counts against RLIMIT_NPROC until reaped
            zombies += 1
            tasks += 1
            continue
        rss, biggest, vmdata = rss + anon, max(biggest, anon), max(vmdata, int(st.get("VmData", 0)) * 1024)
        kind = _kind(pid)
        kinds[kind] = kinds.get(kind, 0) + 1
        pss += pss_anon(pid)
        tasks += int(st.get("Threads", 1))
        procs += 1
        try:
            roots.setdefault(os.stat(f"/proc/{pid}/root/tmp").st_dev, pid)  # one per sandbox (its own tmpfs)
        except OSError:
            pass
    tmpfs = {"tmp": 0, "dev/shm": 0}
    largest = tree_usage(scratch)[1] if scratch.is_dir() else 0
    for pid in roots.values():
        for name in tmpfs:
            used, big = tree_usage(Path(f"/proc/{pid}/root/{name}"))
            tmpfs[name] = max(tmpfs[name], used)
            largest = max(largest, big)
    now = {"rss_anon_sum_mib": rss / MIB, "pss_anon_sum_mib": pss / MIB, "largest_process_mib": biggest / MIB,
           "largest_vmdata_mib": vmdata / MIB, "tasks": tasks, "processes": procs, "zombies": zombies,
           "largest_file_mib": largest / MIB,
           "tmp_mib": tmpfs["tmp"] / MIB, "dev_shm_mib": tmpfs["dev/shm"] / MIB}
    if tasks > peak.get("tasks", 0):
        peak["at_peak_tasks"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    for k, v in now.items():
        peak[k] = max(peak.get(k, 0), v)


def _kind(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(Path(w.decode(errors="replace")).name for w in words[:3] if w)[:60]


def grade_day(day: str, every: float, extra: list[str]) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="dlo-bench-peaks-"))
    try:
        nb = tmp / "submitted" / "s000" / day / f"{day}.ipynb"
        nb.parent.mkdir(parents=True)
        shutil.copyfile(REPO / "solutions" / day / f"{day}.ipynb", nb)
        out = tmp / "out"
        cmd = [sys.executable, "-m", "dlo.cli", "grade", str(tmp / "submitted"), "--out", str(out), "--jobs", "1",
               "--profile", "tiny", *extra]
        start, peak = time.perf_counter(), {}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "DLO_PROFILE": "tiny"})
        while proc.poll() is None:
            sample(proc.pid, out / "work" / "s000" / day, peak)
            time.sleep(every)
        log = proc.stdout.read()
        rows = list(csv.DictReader((out / "scores.csv").open())) if (out / "scores.csv").exists() else []
        score = [(float(r["score"]), float(r["max_score"]), r["status"]) for r in rows]
        return {"day": day, "wall_s": round(time.perf_counter() - start, 1), "rc": proc.returncode, "score": score,
                **{k: round(v, 1) if isinstance(v, float) else v for k, v in peak.items()},
                **({"log": log[-2000:]} if proc.returncode else {})}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    from dlo.registry import names

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--day", nargs="*", default=names())
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--label", default="")
    ap.add_argument("extra", nargs="*", help="after --: options for dlo grade")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the sandboxes' processes are told apart by their uid (not root's)")
    results = []
    for day in args.day:
        res = grade_day(day, args.every, args.extra)
        print(json.dumps(res), flush=True)
        results.append(res)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
    path = RESULTS / f"grade-peaks-{stamp}{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps({"date": stamp, "every_s": args.every, "options": args.extra, "load_1min":
                                os.getloadavg()[0], "cores": os.cpu_count(), "days": results}, indent=1) + "\n")
    print(f"wrote {path.relative_to(REPO)}")
    ok = all(r["rc"] == 0 and r["score"] and all(s == m for s, m, _ in r["score"]) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
