"""`dlo run`: execute day notebooks headlessly with papermill and report a status table.

Each notebook runs in its own `python -m papermill` child process (its own session), so a
per-notebook timeout can stop it together with its kernel, and a crash in one day never stops
the others. Executed notebooks land in OUT/<day>/<day>.ipynb, and run with OUT/<day> as working
directory so their logs (runs/, TensorBoard) stay out of the checkout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import papermill

from dlo.harness.days import notebook_path, select_days
from dlo.tables import format_table

# Parameters naming paths: resolved against the caller's working directory, not the notebook's.
PATH_PARAMETERS = ("data_dir", "log_dir")


def parse_value(text: str):
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def build_parameters(nb: Path, profile: str, pairs: list[tuple[str, str]]) -> dict:
    declared = papermill.inspect_notebook(str(nb))
    if not declared:
        raise SystemExit(f"{nb}: no cell tagged 'parameters'")
    params = {"profile": profile}
    for name, value in pairs:
        if name not in declared:
            raise SystemExit(f"{nb.name} has no parameter {name!r}; its parameters are: {', '.join(declared)}")
        value = parse_value(value)
        if name in PATH_PARAMETERS and value:
            value = str(Path(value).resolve())
        params[name] = value
    return params


def run_notebook(src: Path, dest: Path, params: dict, timeout: float, cell_timeout: float) -> tuple[str, float]:
    """Execute one notebook; returns (status, seconds). Status: ok, failed (rc) or timeout."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "papermill", str(src), str(dest), "-y", json.dumps(params),
           "--cwd", str(dest.parent), "--execution-timeout", str(int(cell_timeout)),
           "--progress-bar", "--log-level", "WARNING"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        os.killpg(proc.pid, signal.SIGKILL)  # papermill and its kernel share the session
        proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            raise
        return "timeout", time.perf_counter() - start
    return ("ok" if rc == 0 else f"failed (rc={rc})"), time.perf_counter() - start


def main(root: Path, days: list[str], all_days: bool, profile: str, pairs: list[tuple[str, str]],
         notebooks: str, out: str | None, timeout: float, cell_timeout: float) -> int:
    days = select_days(root, days, all_days, notebooks)
    out_dir = Path(out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    rows = []
    for day in days:
        src = notebook_path(root, day, notebooks)
        dest = out_dir / day / f"{day}.ipynb"
        print(f"== {day} ({notebooks}, profile={profile}) -> {dest}", flush=True)
        status, secs = run_notebook(src, dest, build_parameters(src, profile, pairs), timeout, cell_timeout)
        rows.append({"day": day, "status": status, "wall time (s)": round(secs, 1), "output": str(dest)})
    print()
    print(format_table(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1
