"""The `dlo` command: run, release, check, grade and bench the course.

    dlo run [DAY ...|--all] [--profile tiny|full|auto] [-p NAME VALUE ...] [--notebooks solutions|course] [--out DIR]
            [--smoke] [--jobs N] [--grade DIR [--require-full]]
    dlo plan DAY [--gpus N] [--gpu-mem GB]
    dlo release [--force]
    dlo check
    dlo grade SUBMITTED_DIR [--out DIR] [--jobs N] [--shard K/N] [--regrade] [--cell-timeout S] [--require-full]
              [--full-notebook] [--mem-per-job SIZE] [--procs-per-job N] [--max-file-size SIZE] [--tmpfs-size SIZE]
    dlo grade --merge DIR
    dlo setup student|instructor [--user|--config-dir DIR] [--exchange DIR] [--course-id ID] [--cell-timeout S]
    dlo doctor [DAY ...] [--data-dir DIR] [--weights-dir DIR]
    dlo data check DIR [DAY ...] [--profile full|tiny] [--weights-dir DIR]
    dlo data tokens CORPUS [CORPUS ...] --tokenizer PATH --out DIR [--profile full|tiny] [--force]
    dlo bench [OP ...] [--compile-report]

Every command follows `dlo.errors`: errors and warnings on stderr as `dlo <command>: ...`, exit status 2
for bad usage or values (before any work), 1 for a failed run; SIGTERM, SIGHUP and Ctrl-C end every
process the command started (`dlo.reaper`), exit status 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from dlo import reaper
from dlo.errors import FAILED, USAGE, BadInput
from dlo.harness import GRADE_CELL_TIMEOUT, GRADE_NOTEBOOK_TIMEOUT
from dlo.harness.days import repo_root


class Parser(argparse.ArgumentParser):
    """argparse, its errors in one line (`dlo run: argument --profile: invalid choice ...`), exit 2."""

    def error(self, message: str):
        self.exit(USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive(cast):
    """An argparse type: a number > 0 of type `cast`."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not a positive number")
        return value
    parse.__name__ = f"positive {cast.__name__}"
    return parse


def limit(name: str):
    """An argparse type: the value of the grading limit `name` (`dlo.grading.limits`), sizes as 3G or 512M."""
    from dlo.grading.limits import check_value, parse_size

    def parse(text: str):
        try:
            value = int(text) if name == "procs" else parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if name != "procs" else f"{text!r} is not a number") from None
        why = check_value(name, value)
        if why:
            raise argparse.ArgumentTypeError(why)
        return value
    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dlo", description="DLO course harness (papermill + nbgrader).")
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
    run.add_argument("--timeout", type=positive(float), default=3600.0, help="seconds per notebook (default 3600)")
    run.add_argument("--cell-timeout", type=positive(float), default=1800.0, help="seconds per cell (default 1800)")
    run.add_argument("--smoke", action="store_true",
                     help="the profile's model sizes, step counts, data and sweeps cut to the minimum (DLO_SMOKE=1)")
    run.add_argument("--grade", default=None, metavar="DIR",
                     help="grade each notebook as soon as it has run, in the same slots, into DIR (as `dlo grade "
                          "<--out's parent> --out DIR` would after the run; --out's parent must hold nothing else)")
    run.add_argument("--require-full", action="store_true",
                     help="with --grade: exit 1 unless every score is full marks")
    run.add_argument("--jobs", type=positive(int), default=None,
                     help="notebooks run at once, each with its share of the cores, which its timing verdicts "
                          "count on (default: 2 with 2 cores or more, else 1)")

    plan = sub.add_parser("plan", help="memory per rank of a day's full profile, worked out on the meta device")
    plan.add_argument("day", metavar="DAY")
    plan.add_argument("--gpus", type=positive(int), default=None,
                      help="GPUs (ranks) to plan for (default: the day's own)")
    plan.add_argument("--gpu-mem", type=positive(float), default=80.0, metavar="GB",
                      help="memory per GPU in GiB (default 80)")

    release = sub.add_parser("release", help="generate course/ from solutions/ (nbgrader generate_assignment)")
    release.add_argument("--force", action="store_true",
                         help="release even with uncommitted solutions/ or hand edits in course/ "
                              "(they are overwritten)")
    sub.add_parser("check", help="course/ up to date, no outputs committed, solutions well formed")

    grade = sub.add_parser("grade", help="autograde SUBMITTED_DIR/<student>/<day>/<day>.ipynb")
    grade.add_argument("submitted", metavar="SUBMITTED_DIR", nargs="?")
    grade.add_argument("--jobs", type=positive(int), default=None,
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
    grade.add_argument("--cell-timeout", type=positive(float), default=GRADE_CELL_TIMEOUT,
                       help=f"seconds per cell (default {GRADE_CELL_TIMEOUT:.0f})")
    grade.add_argument("--notebook-timeout", type=positive(float), default=GRADE_NOTEBOOK_TIMEOUT,
                       help=f"seconds for one student's notebook (default {GRADE_NOTEBOOK_TIMEOUT:.0f})")
    grade.add_argument("--require-full", action="store_true", help="exit 1 unless every score is full marks")
    grade.add_argument("--full-notebook", action="store_true",
                       help="run every cell, the experiments after the last graded cell too (default: they are left "
                            "out, with a note in the feedback: they cannot change a score)")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="grade even where bubblewrap cannot run, unconfined (the `sandbox` column says so)")
    grade.add_argument("--mem-per-job", type=limit("memory"), default=None, metavar="SIZE",
                       help="memory of one submission's sandboxed processes together, e.g. 4G (default: its share "
                            "of the memory available, at least 2 GiB)")
    grade.add_argument("--procs-per-job", type=limit("procs"), default=None, metavar="N",
                       help="processes and threads of one submission's sandboxes (default: 64 per core of its "
                            "share + 192, at least 256)")
    grade.add_argument("--max-file-size", type=limit("file_size"), default=None, metavar="SIZE",
                       help="largest file a submission may write (default: its memory limit)")
    grade.add_argument("--tmpfs-size", type=limit("tmpfs"), default=None, metavar="SIZE",
                       help="size of each of the sandbox's /tmp and /dev/shm, memory too (default: 1/8 of the "
                            "job's share, at least 256 MiB)")

    setup = sub.add_parser("setup", help="JupyterLab for a role: students get Validate and the assignment list, "
                                          "instructors the formgrader too (settings in this environment)")
    setup.add_argument("role", choices=["student", "instructor"])
    where = setup.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="write to your home's Jupyter config, not the environment's")
    where.add_argument("--config-dir", default=None, metavar="DIR", help="write to this Jupyter config folder instead")
    setup.add_argument("--exchange", default=None, metavar="DIR",
                       help="nbgrader exchange folder (default <sys.prefix>/share/nbgrader/exchange)")
    setup.add_argument("--course-id", default=None, metavar="ID",
                       help="the course's name in the exchange (nbgrader's release, fetch, submit, collect need one)")
    setup.add_argument("--cell-timeout", type=positive(int), default=1800,
                       help="seconds per cell for Validate (default 1800)")

    doctor = sub.add_parser("doctor", help="what this machine offers the course: torch/CUDA/NCCL, GPUs, Triton, "
                                           "bwrap, the data folder, whether each day's plan fits; ok or the fix")
    doctor.add_argument("days", nargs="*", metavar="DAY", help="days whose plan to check (default: every planned day)")
    doctor.add_argument("--data-dir", type=Path, default=None, help="the folder you will pass as data_dir")
    doctor.add_argument("--weights-dir", type=Path, default=None, help="Day 5's weights_dir, checked")

    data = sub.add_parser("data", help="check what each day reads from a data folder (and a weights folder); "
                                       "make Day 5's tokens.npy from a local corpus. Nothing is downloaded")
    data_sub = data.add_subparsers(dest="action", required=True)
    check = data_sub.add_parser("check", help="one line per day: ok, or FIX and the fix")
    check.add_argument("data_dir", type=Path, metavar="DIR", help="the folder you will pass as data_dir")
    check.add_argument("days", nargs="*", metavar="DAY", help="days to check (default: every day)")
    check.add_argument("--weights-dir", type=Path, default=None, help="Day 5's checkpoint folder (weights_dir)")
    tokens = data_sub.add_parser("tokens", help="Day 5's tokens.npy: a local text corpus encoded with a local "
                                                "tokenizer.json, ids checked against the model's vocabulary")
    tokens.add_argument("corpus", nargs="+", type=Path, metavar="CORPUS", help="text files, or folders of *.txt")
    tokens.add_argument("--tokenizer", type=Path, required=True,
                        help="the model's tokenizer.json, or the folder holding it (its weights folder)")
    tokens.add_argument("--out", type=Path, required=True, metavar="DIR", help="the data folder: DIR/tokens.npy")
    tokens.add_argument("--force", action="store_true", help="replace an existing DIR/tokens.npy")
    for action in (check, tokens):
        action.add_argument("--profile", default="full", choices=["full", "tiny"],
                            help="the profile whose models the data must fit (default full: the GPU runs)")

    export = sub.add_parser("export", help="a `dlo grade` output's scores as a file Canvas's or Moodle's "
                                           "gradebook imports, students matched through a roster CSV")
    export.add_argument("grading", type=Path, metavar="GRADING_DIR", help="the folder `dlo grade --out` wrote")
    export.add_argument("--to", required=True, choices=["canvas", "moodle"], dest="lms")
    export.add_argument("--roster", required=True, type=Path,
                        help="CSV of the class in the LMS (Canvas: its gradebook export; Moodle: its grade export "
                             "or any CSV with Username, ID number or Email address)")
    export.add_argument("--key", default=None, help="the roster column holding nbgrader's student ids "
                                                    "(default: 'SIS Login ID' for Canvas, 'Username' for Moodle)")
    export.add_argument("--out", required=True, type=Path, help="the CSV to write (a new file)")
    bench = sub.add_parser("bench", help="GPU kernel benchmarks vs torch baselines and the device peak")
    bench.add_argument("ops", nargs="*", metavar="OP")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON results")
    bench.add_argument("--compile-report", action="store_true",
                       help="no GPU needed: compile every kernel for sm_80/90/100, print resources and roofline")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `dlo` command: its exit status (see the module's docstring for the conventions)."""
    args = build_parser().parse_args(argv)
    with reaper.stopping() as received:
        try:
            rc = dispatch(args)
        except BadInput as exc:
            return _say(args.command, exc.code, USAGE)
        except KeyboardInterrupt:
            rc = 130
        except SystemExit as exc:
            if not isinstance(exc.code, str):
                raise
            return _say(args.command, exc.code, FAILED)
        if received or rc == 130:  # a command's own clean-up ran; now whatever it left
            reaper.kill_tree(os.getpid(), include_root=False)
            if received:
                rc = 128 + received[0]
                _say(args.command, f"stopped by {signal.Signals(received[0]).name}; every process it started "
                                   f"was ended", rc)
        return rc


def _say(command: str, message: str, rc: int) -> int:
    print(f"dlo {command}: {message}", file=sys.stderr, flush=True)
    return rc


def dispatch(args: argparse.Namespace) -> int:
    root = (args.root or repo_root()).resolve()
    if args.command == "run":
        from dlo.harness import run
        return run.main(root, args.days, args.all, args.profile, [tuple(p) for p in args.parameter],
                        args.notebooks, args.out, args.timeout, args.cell_timeout, smoke=args.smoke,
                        jobs=args.jobs, grade_out=args.grade, require_full=args.require_full)
    if args.command == "plan":
        from dlo import registry
        return registry.plan_main(args.day, args.gpus, args.gpu_mem)
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
                raise BadInput("--merge DIR takes no SUBMITTED_DIR and no --shard")
            return grade.merge(args.merge)
        if args.submitted is None:
            raise BadInput("SUBMITTED_DIR is required (or --merge DIR)")
        limits = {"memory": args.mem_per_job, "procs": args.procs_per_job, "file_size": args.max_file_size,
                  "tmpfs": args.tmpfs_size}
        if args.no_sandbox and any(v is not None for v in limits.values()):
            raise BadInput("the limits per job are set in the sandbox: --no-sandbox grades without them")
        return grade.main(root, args.submitted, args.out, args.profile, args.cell_timeout,
                          args.notebook_timeout, args.require_full, jobs=args.jobs, shard=args.shard,
                          regrade=args.regrade, no_sandbox=args.no_sandbox,
                          full_notebook=args.full_notebook, limits=limits)
    if args.command == "setup":
        from dlo.harness.setup import setup
        return setup(args.role, user=args.user, cfg_dir=args.config_dir, exchange=args.exchange,
                     cell_timeout=args.cell_timeout, root=root, course_id=args.course_id)
    if args.command == "doctor":
        from dlo import doctor
        return doctor.main(args.days, args.data_dir, args.weights_dir)
    if args.command == "data":
        from dlo.data import check
        if args.action == "check":
            return check.check_main(args.data_dir, args.days, args.profile, args.weights_dir)
        return check.tokens_main(args.corpus, args.tokenizer, args.out, args.profile, args.force)
    if args.command == "export":
        from dlo.harness.export import export
        return export(args.grading, args.lms, args.roster, args.out, args.key)
    if args.command == "bench":
        from dlo import bench
        from dlo.kernels.runtime import JITUnavailable
        try:
            return bench.compile_report() if args.compile_report else bench.main(args.ops, args.out)
        except JITUnavailable as exc:  # the node's set-up, not a kernel's bug: its one line; nothing is written
            raise SystemExit(str(exc)) from None
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
