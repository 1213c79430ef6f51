"""Progress bars that survive a saved notebook.

In JupyterLab `tqdm` draws a widget. A notebook executed headlessly (papermill, nbgrader) saves only
the widget's text fallback as it was when the cell started ("0%| | 0/50" forever), so the harness
sets DLO_HEADLESS=1 for the kernels it starts, and there the bars are plain text on stdout, whose
last state is what the saved notebook shows.
"""

from __future__ import annotations

import functools
import os
import sys


def headless() -> bool:
    return os.environ.get("DLO_HEADLESS", "") == "1"


def _pick():
    if headless():
        from tqdm.std import tqdm as text_tqdm
        return functools.partial(text_tqdm, file=sys.stdout, mininterval=1.0, ascii=True)
    from tqdm.auto import tqdm as auto_tqdm
    return auto_tqdm


def tqdm(*args, **kwargs):
    """tqdm.auto's bar in an interactive session, a text bar on stdout in headless runs."""
    return _pick()(*args, **kwargs)

