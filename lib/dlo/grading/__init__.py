"""The grading runtime: how a check runs the student's code, on which side of the trust boundary.

`dlo.checks` says what each day checks; this package runs those checks, in a notebook's own test cell
(the direct backend: `api`) and under `dlo grade` (the sandboxed backend: `trusted`, the runner in the
jail: `jail_runner`). README.md beside this file draws the path of one graded cell and says which side
each module runs on; `seal.OPEN` lists the student's side, every other module is the trusted side's.
"""
