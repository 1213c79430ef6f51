"""How every `dlo` command reports a problem (the conventions `dlo.cli` applies).

- Errors and warnings go to stderr, one line each, as `dlo <command>: ...` (warnings: `dlo <command>:
  warning: ...`); `dlo.cli` adds the prefix to what a command raises, `warn` to what it merely says.
- Exit status 2: bad usage or a bad value (`BadInput`, argparse's own errors), said before any work
  starts; 1: a run that failed (any other `SystemExit` with a message, or a command returning 1);
  128 + N: stopped by signal N (Ctrl-C: 130, SIGTERM: 143), every child process killed first.

`BadInput` is a `SystemExit`, so a command called from Python without the CLI still stops with its
message and a non-zero status.
"""

from __future__ import annotations

import sys

USAGE, FAILED = 2, 1


class BadInput(SystemExit):
    """A bad command line or value, refused before any work (exit status 2); the message is one line
    without the `dlo <command>:` prefix."""


def warn(command: str, text: str) -> None:
    """`dlo <command>: warning: <text>` on stderr."""
    print(f"dlo {command}: warning: {text}", file=sys.stderr, flush=True)
