"""The grading runtime: how a check runs the student's code, on which side of the trust boundary.

`dlo.checks` says what each day checks; this package is what runs those checks, in a notebook's own
test cell (the direct backend) and under `dlo grade` (the sandboxed backend). `dlo.harness` drives
papermill and nbgrader around it.

The student's side (open where student code runs: `seal.OPEN`):
    api          `@check`, `run_student`, `on_ranks`, `case_seed`: what a check is written against;
                 the direct backend (student code in this process, ranks through `dlo.distributed.launch`)
    compare      `assert_close`, `assert_number`, `ok`: the comparisons and messages checks share
    forbid       the forbidden references and threads while student code runs
    frames       tracebacks with the student's frames first, the grader's folded
    wire         the channel's format: cloudpickle to the sandbox, JSON + raw tensor bytes back
    jail_runner  `python -I -m dlo.grading.jail_runner`: serves one check session per fork, in the jail
    seal         the grader's modules (`dlo.checks` and the trusted side here) sealed where student code runs

The trusted side (the grading process; sealed where student code runs):
    trusted      the sandboxed backend: checks run here against handles to the student's objects
    testcells    a graded test cell run in the grader, its names bound to those handles
    jail         bubblewrap: the jail the student's kernel and the runner run in
    files        reading what a student made without following it (links, fifos refused)
"""
