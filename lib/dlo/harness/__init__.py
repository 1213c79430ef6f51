"""The course harness behind the `dlo` command: papermill runs, nbgrader release/check/grade."""
