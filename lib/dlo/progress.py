"""Progress bars that survive a saved notebook and stay out of logs.

In JupyterLab `tqdm` draws a widget. A notebook executed headlessly (papermill, nbgrader) saves only
the widget's text fallback as it was when the cell started ("0%| | 0/50" forever), so the harness
sets DLO_HEADLESS=1 for the kernels it starts, and there the bars are plain text on stdout, whose
last state is what the saved notebook shows.

Anywhere else (a `dlo` command, a script) a bar redraws itself with carriage returns on stderr, which
is noise in a log file: bars are drawn only when stderr is a terminal (`bars_wanted`). DLO_PROGRESS=1
forces them on, DLO_PROGRESS=0 off (in notebooks and headless kernels too).
"""

from __future__ import annotations

import functools
import os
import sys


def headless() -> bool:
    return os.environ.get("DLO_HEADLESS", "") == "1"


def bars_wanted() -> bool:
    """Whether a command-line bar is drawn: DLO_PROGRESS=1 or 0 decides, else whether stderr is a terminal."""
    forced = os.environ.get("DLO_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def drawn() -> bool:
    """Whether `tqdm` draws a bar here: in a headless kernel and in JupyterLab, else on a terminal
    (`bars_wanted`); never with DLO_PROGRESS=0."""
    if os.environ.get("DLO_PROGRESS") == "0":
        return False
    return headless() or _in_jupyter() or bars_wanted()


def _pick():
    if headless():
        from tqdm.std import tqdm as text_tqdm
        return functools.partial(text_tqdm, file=sys.stdout, mininterval=1.0, ascii=True)
    from tqdm.auto import tqdm as auto_tqdm
    return auto_tqdm


def tqdm(*args, **kwargs):
    """tqdm.auto's bar in JupyterLab, a text bar on stdout in headless runs, a terminal's bar on stderr;
    where no bar is drawn (`drawn`), an iterable passes through unchanged."""
    if not drawn():
        kwargs["disable"] = True
    return _pick()(*args, **kwargs)
