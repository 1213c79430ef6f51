"""A minimal local experiment tracker beside TensorBoard: one JSON-lines file per run, a table of runs.

TensorBoard draws curves; comparing runs needs what produced them too. Each run's file holds, line by line:
its start (name, parameters, the code version: git commit and whether the tree had uncommitted changes, and
the environment: Python, torch, host, devices), its metrics as logged, and its end (status and summary).
Nothing leaves the machine. A line is appended with one write, so a run killed mid-way leaves at most a
partial last line, which the reader skips (and says so); such a run reads as "running" with every metric up
to the kill. `runs_table` lines the runs of a folder up, one row each, for the parameters and the best of a
metric.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

from dlo.errors import BadInput


def code_version(folder=".") -> dict:
    """{"commit": HEAD or None outside git, "dirty": uncommitted changes to tracked files}."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None

    head = git("rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head.stdout.strip(), "dirty": bool(status and status.stdout.strip())}


def environment() -> dict:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "platform": platform.platform(), "cpus": os.cpu_count(), "argv": sys.argv[:3]}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


class Run:
    """`with Run(root, "lr3e-4", params={...}) as run: run.log(step, loss=...)` -> root/lr3e-4.jsonl."""

    def __init__(self, root, name: str, params: dict | None = None, code_dir="."):
        if not name or "/" in name or name.startswith("."):
            raise BadInput(f"run name {name!r} must be a plain file name (no '/', not hidden)")
        self.path = Path(root) / f"{name}.jsonl"
        if self.path.exists():
            raise BadInput(f"{self.path} exists: a run is never overwritten; pick another name")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._write({"event": "start", "name": name, "params": params or {}, "code": code_version(code_dir),
                     "env": environment(), "time": time.time()})

    def _write(self, record: dict) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)   # one write of one line: never interleaved with another line
        finally:
            os.close(fd)

    def log(self, step: int, **metrics: float) -> None:
        self._write({"event": "metrics", "step": step, "time": time.time(),
                     "metrics": {k: float(v) for k, v in metrics.items()}})

    def finish(self, status: str = "finished", **summary) -> None:
        self._write({"event": "end", "status": status, "summary": summary, "time": time.time()})

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.finish("finished" if kind is None else f"failed: {kind.__name__}")


def read_run(path) -> dict:
    """{"name", "params", "code", "env", "status", "summary", "metrics": {name: [(step, value), ...]}}."""
    path = Path(path)
    run = {"metrics": {}, "status": "running", "summary": {}}
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:   # the line a kill cut short
                warnings.warn(f"{path}: partial last line skipped (the run was killed while writing)", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON; the file was edited or is not a run") from None
        if record["event"] == "start":
            run.update({k: record[k] for k in ("name", "params", "code", "env")}, started=record["time"])
        elif record["event"] == "metrics":
            for name, value in record["metrics"].items():
                run["metrics"].setdefault(name, []).append((record["step"], value))
        else:
            run.update(status=record["status"], summary=record["summary"])
    return run


def runs_table(root, metric: str, mode: str = "min") -> list[dict]:
    """One row per run under `root`, best first: name, status, commit, its parameters, and the best and last
    value of `metric` (runs that never logged it last)."""
    if mode not in ("min", "max"):
        raise BadInput(f"mode must be 'min' or 'max', got {mode!r}")
    rows = []
    for path in sorted(Path(root).glob("*.jsonl")):
        run = read_run(path)
        values = [v for _, v in run["metrics"].get(metric, [])]
        best = (min if mode == "min" else max)(values) if values else None
        rows.append({"name": run.get("name", path.stem), "status": run["status"],
                     "commit": (run.get("code", {}).get("commit") or "-")[:10], **run.get("params", {}),
                     f"best {metric}": best, f"last {metric}": values[-1] if values else None})
    sign = 1 if mode == "min" else -1
    rows.sort(key=lambda r: (r[f"best {metric}"] is None, sign * (r[f"best {metric}"] or 0)))
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text columns (every key of any row)."""
    if not rows:
        return "(no runs)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[k for k in keys]] + [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
