"""The `dlo` command: run, release, check, grade and bench the course.

    dlo run [DAY ...|--all] [--profile tiny|full|auto] [-p NAME VALUE ...] [--notebooks solutions|course] [--out DIR]
    dlo release
    dlo check
    dlo grade SUBMITTED_DIR [--out DIR] [--cell-timeout S] [--require-full]
    dlo bench [OP ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dlo.harness.days import repo_root


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlo", description="DLO course harness (papermill + nbgrader).")
    parser.add_argument("--root", type=Path, default=None, help="course checkout (default: this install's)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="execute day notebooks headlessly with papermill")
    run.add_argument("days", nargs="*", metavar="DAY")
    run.add_argument("--all", action="store_true", help="every day")
    run.add_argument("--profile", default="auto", choices=["tiny", "full", "auto"],
                     help="auto: full with a GPU, tiny without")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="override a parameters-cell value (repeatable)")
    run.add_argument("--notebooks", default="solutions", choices=["solutions", "course"])
    run.add_argument("--out", default=None, help="folder for executed notebooks (default runs/<timestamp>)")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds per notebook (default 3600)")
    run.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds per cell (default 1800)")

    sub.add_parser("release", help="generate course/ from solutions/ (nbgrader generate_assignment)")
    sub.add_parser("check", help="course/ up to date, no outputs committed, solutions well formed")

    grade = sub.add_parser("grade", help="autograde SUBMITTED_DIR/<student>/<day>/<day>.ipynb")
    grade.add_argument("submitted", metavar="SUBMITTED_DIR")
    grade.add_argument("--out", default=None, help="folder for scores, feedback and nbgrader files")
    grade.add_argument("--profile", default="auto", choices=["tiny", "full", "auto"],
                       help="scale the notebooks run at while graded (DLO_PROFILE)")
    grade.add_argument("--cell-timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    grade.add_argument("--notebook-timeout", type=float, default=7200.0,
                       help="seconds for one student's notebook (default 7200)")
    grade.add_argument("--require-full", action="store_true", help="exit 1 unless every score is full marks")

    bench = sub.add_parser("bench", help="GPU kernel benchmarks vs torch baselines and the device peak")
    bench.add_argument("ops", nargs="*", metavar="OP")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = (args.root or repo_root()).resolve()
    if args.command == "run":
        from dlo.harness import run
        return run.main(root, args.days, args.all, args.profile, [tuple(p) for p in args.parameter],
                        args.notebooks, args.out, args.timeout, args.cell_timeout)
    if args.command == "release":
        from dlo.harness.release import release
        return release(root)
    if args.command == "check":
        from dlo.harness.release import check
        return check(root)
    if args.command == "grade":
        from dlo.harness import grade
        return grade.main(root, args.submitted, args.out, args.profile, args.cell_timeout,
                          args.notebook_timeout, args.require_full)
    if args.command == "bench":
        from dlo import bench
        return bench.main(args.ops, args.out)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
