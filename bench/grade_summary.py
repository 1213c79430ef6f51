"""CPU seconds per graded notebook, every day before and after, and what 100 students x 8 days would take.

    .venv/bin/python bench/grade_summary.py [--before PATTERN ...] [--after PATTERN ...]

Reads the profiles `bench/grade_profile.py` wrote (the newest result of each day wins), prints a table
and writes bench/results/grade-summary-<date>.json. The extrapolation: 100 x 8 notebooks on one node of
`--cores` cores graded with as many jobs, at the per-notebook CPU seconds averaged over the 8 days (the
per-run costs, `dlo grade` itself and the course build, paid once, left out), with the cores kept busy at
`--efficiency` (1: CPU-bound work spreads perfectly; the 2-core measurement of 2026-11-23 found 0.74 in
wall time at 2 jobs).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PER_RUN = ("dlo grade", "course build (generate_assignment)")  # paid once per `dlo grade`, not per notebook


def per_day(patterns: list[str]) -> dict:
    """{day: result} from the profiles matching `patterns`: a later pattern's (then a newer file's) wins."""
    out = {}
    for path in [p for pattern in patterns for p in sorted(glob.glob(str(REPO / "bench" / "results" / pattern)))]:
        for r in json.loads(Path(path).read_text())["results"]:
            parts = r["by_process"]
            total = sum(v["cpu_s"] for k, v in parts.items() if not k.startswith("unseen"))
            per_run = sum(v["cpu_s"] for k, v in parts.items() if k in PER_RUN)
            ranks = sum(v["cpu_s"] for k, v in parts.items() if k.startswith("ranks"))
            out[r["day"]] = {"cpu_s": round(total, 1),
                             "cpu_s_per_notebook": round((total - per_run) / r["students"], 1),
                             "ranks_cpu_s": round(ranks, 1), "kernel_cpu_s": parts.get("kernel", {}).get("cpu_s", 0.0),
                             "file": Path(path).name, "full_marks": _full(r)}
    return out


def _full(result: dict) -> bool:
    rows = [ln.split(",") for ln in result["scores_csv"].splitlines()[1:]]
    return all(float(r[2]) == float(r[3]) > 0 and r[4] == "graded" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", nargs="+", default=["grade-profile-*-before.json"])
    ap.add_argument("--after", nargs="+", default=["grade-profile-*-after.json", "grade-profile-*-after-*.json"])
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--efficiency", type=float, nargs="+", default=[1.0, 0.74])
    args = ap.parse_args()
    before, after = per_day(args.before), per_day(args.after)
    days = sorted(set(before) | set(after))
    rows = []
    for d in days:
        b, a = before.get(d, {}), after.get(d, {})
        rows.append({"day": d, "before": b.get("cpu_s_per_notebook"), "after": a.get("cpu_s_per_notebook"),
                     "before_ranks": b.get("ranks_cpu_s"), "after_ranks": a.get("ranks_cpu_s"),
                     "before_full_marks": b.get("full_marks"), "after_full_marks": a.get("full_marks")})
        print(f"{d:28s} before {b.get('cpu_s_per_notebook', '-'):>6} s   after {a.get('cpu_s_per_notebook', '-'):>6} "
              f"s   (ranks {b.get('ranks_cpu_s', '-')} -> {a.get('ranks_cpu_s', '-')})")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "days": rows, "extrapolation": []}
    for label in ("before", "after"):
        vals = [r[label] for r in rows if r[label] is not None]
        if len(vals) < len(days):
            continue
        mean = sum(vals) / len(vals)
        for eff in args.efficiency:
            minutes = 800 * mean / (args.cores * eff) / 60
            result["extrapolation"].append({"profile": label, "cpu_s_per_notebook_mean": round(mean, 1),
                                            "cores": args.cores, "efficiency": eff, "minutes": round(minutes, 1)})
            print(f"{label}: mean {mean:.1f} CPU s per notebook -> 100 x 8 on {args.cores} cores at efficiency "
                  f"{eff}: {minutes:.1f} min")
    dest = REPO / "bench" / "results" / f"grade-summary-{datetime.now():%Y%m%d-%H%M}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
