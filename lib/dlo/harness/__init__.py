"""The course harness behind the `dlo` command: papermill runs, nbgrader release/check/grade."""

import sys

# jsonschema (under nbformat, papermill and nbgrader) imports rfc3987_syntax when it is installed,
# which compiles some 35 Earley parsers at import: about 1 s in every `dlo` command and grading child
# (python-jsonschema/jsonschema#1428). It only checks the "iri" formats, which no notebook or nbgrader
# schema uses; marking it absent makes jsonschema skip that checker, nothing else.
sys.modules.setdefault("rfc3987_syntax", None)

# `dlo grade`'s defaults (--cell-timeout, --notebook-timeout), seconds; `dlo run --grade` grades with them too
GRADE_CELL_TIMEOUT, GRADE_NOTEBOOK_TIMEOUT = 600.0, 7200.0
