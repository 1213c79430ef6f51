"""The `dlo` command: run, release, check, grade and bench the course.

    dlo run [DAY ...|--all] [--profile tiny|full|auto] [-p NAME VALUE ...] [--notebooks solutions|course] [--out DIR]
            [--smoke]
    dlo plan DAY [--gpus N] [--gpu-mem GB]
    dlo release [--force]
    dlo check
    dlo grade SUBMITTED_DIR [--out DIR] [--jobs N] [--shard K/N] [--regrade] [--cell-timeout S] [--require-full]
    dlo grade --merge DIR
    dlo setup student|instructor [--user|--config-dir DIR] [--exchange DIR] [--cell-timeout S]
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
    run.add_argument("--smoke", action="store_true",
                     help="the profile's model sizes, step counts, data and sweeps cut to the minimum (DLO_SMOKE=1)")

    plan = sub.add_parser("plan", help="memory per rank of a day's full profile, worked out on the meta device")
    plan.add_argument("day", metavar="DAY")
    plan.add_argument("--gpus", type=int, default=0, help="GPUs (ranks) to plan for (default: the day's own)")
    plan.add_argument("--gpu-mem", type=float, default=80.0, metavar="GB", help="memory per GPU in GiB (default 80)")

    release = sub.add_parser("release", help="generate course/ from solutions/ (nbgrader generate_assignment)")
    release.add_argument("--force", action="store_true",
                         help="release even with uncommitted solutions/ or hand edits in course/ "
                              "(they are overwritten)")
    sub.add_parser("check", help="course/ up to date, no outputs committed, solutions well formed")

    grade = sub.add_parser("grade", help="autograde SUBMITTED_DIR/<student>/<day>/<day>.ipynb")
    grade.add_argument("submitted", metavar="SUBMITTED_DIR", nargs="?")
    grade.add_argument("--jobs", type=int, default=None,
                       help="submissions graded at once (default: what the cores and memory allow; one per GPU)")
    grade.add_argument("--shard", default=None, metavar="K/N",
                       help="grade every N-th student from the K-th into DIR/part-K-of-N (a SLURM array task)")
    grade.add_argument("--merge", default=None, metavar="DIR",
                       help="join DIR/part-*-of-N into DIR/scores.csv, cells.csv, feedback/, gradebook.db")
    grade.add_argument("--regrade", action="store_true",
                       help="grade everything again in an earlier --out (default: resume, skipping finished work)")
    grade.add_argument("--out", default=None,
                       help="folder for scores, feedback and nbgrader files: new, empty, or an earlier `dlo grade` "
                            "output (default runs/grade-<time>)")
    grade.add_argument("--profile", default="auto", choices=["tiny", "full", "auto"],
                       help="scale the notebooks run at while graded (DLO_PROFILE)")
    grade.add_argument("--cell-timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    grade.add_argument("--notebook-timeout", type=float, default=7200.0,
                       help="seconds for one student's notebook (default 7200)")
    grade.add_argument("--require-full", action="store_true", help="exit 1 unless every score is full marks")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="grade even where bubblewrap cannot run, unconfined (the `sandbox` column says so)")

    setup = sub.add_parser("setup", help="JupyterLab for a role: students get Validate and the assignment list, "
                                          "instructors the formgrader too (settings in this environment)")
    setup.add_argument("role", choices=["student", "instructor"])
    where = setup.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="write to your home's Jupyter config, not the environment's")
    where.add_argument("--config-dir", default=None, metavar="DIR", help="write to this Jupyter config folder instead")
    setup.add_argument("--exchange", default=None, metavar="DIR",
                       help="nbgrader exchange folder (default <sys.prefix>/share/nbgrader/exchange)")
    setup.add_argument("--cell-timeout", type=int, default=1800, help="seconds per cell for Validate (default 1800)")

    bench = sub.add_parser("bench", help="GPU kernel benchmarks vs torch baselines and the device peak")
    bench.add_argument("ops", nargs="*", metavar="OP")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON results")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    root = (args.root or repo_root()).resolve()
    if args.command == "run":
        from dlo.harness import run
        return run.main(root, args.days, args.all, args.profile, [tuple(p) for p in args.parameter],
                        args.notebooks, args.out, args.timeout, args.cell_timeout, smoke=args.smoke)
    if args.command == "plan":
        from dlo import plan
        return plan.main(args.day, args.gpus, args.gpu_mem)
    if args.command == "release":
        from dlo.harness.release import release
        return release(root, force=args.force)
    if args.command == "check":
        from dlo.harness.release import check
        return check(root)
    if args.command == "grade":
        from dlo.harness import grade
        if args.merge is not None:
            if args.submitted is not None or args.shard is not None:
                parser.error("grade --merge DIR takes no SUBMITTED_DIR and no --shard")
            return grade.merge(args.merge)
        if args.submitted is None:
            parser.error("grade: SUBMITTED_DIR is required (or --merge DIR)")
        return grade.main(root, args.submitted, args.out, args.profile, args.cell_timeout,
                          args.notebook_timeout, args.require_full, jobs=args.jobs, shard=args.shard,
                          regrade=args.regrade, no_sandbox=args.no_sandbox)
    if args.command == "setup":
        from dlo.harness.setup import setup
        return setup(args.role, user=args.user, cfg_dir=args.config_dir, exchange=args.exchange,
                     cell_timeout=args.cell_timeout, root=root)
    if args.command == "bench":
        from dlo import bench
        return bench.main(args.ops, args.out)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
