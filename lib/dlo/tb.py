"""TensorBoard logs written, and read back to show in a notebook the curves TensorBoard would show.

`writer(log_dir, name)` is the one way a run folder is opened for writing (`Run.writer(name)` in a
notebook, the experiments on rank 0 of a launch). The course's convention: one run folder per
configuration under `log_dir`, one tag per metric ("loss", "lr", "grad_norm", "eval_acc"), so the
configurations overlay in TensorBoard. `log_dir` defaults to `runs` beside the notebook
(`<day>/runs/<configuration>`): the day is the folder already, so it is not repeated below it.
`read_scalars` reads one tag of every run below a folder with TensorBoard's own event reader,
exactly what `tensorboard --logdir` would plot; `plot_scalars` draws it inline, and `how_to_open`
says how to open TensorBoard itself, on a laptop or on a cluster node (port forwarding).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

SESSION_ENV = "DLO_SESSION_START"  # when the notebook's session began (`start_session`), inherited by its ranks

OPEN_ON_A_CLUSTER = """On a cluster node (no browser there), forward TensorBoard's port to your laptop:
  laptop$ ssh -L 6006:localhost:6006 you@login-node      (then ssh on to the compute node the same way if needed)
  node$   tensorboard --logdir {log_dir} --port 6006
and open http://localhost:6006 on the laptop."""

OPEN_HERE = """TensorBoard of these runs: `tensorboard --logdir {log_dir}` in a terminal, then http://localhost:6006
(or, in the notebook: `%load_ext tensorboard` then `%tensorboard --logdir {log_dir}`)."""


def writer(log_dir: str | Path | None, name: str, rank: int = 0):
    """A TensorBoard SummaryWriter for run folder `name` under `log_dir`; None without a log_dir, or
    for a `rank` other than 0 (launched experiments pass theirs: one writer per run, not per rank)."""
    if log_dir is None or rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    folder = Path(log_dir) / name
    # A re-run replaces its own curves: TensorBoard merges every event file of a folder, so a notebook run
    # twice (each Validate did) showed each step twice. The event files this folder got before the notebook's
    # session started (`dlo.setup` records when: SESSION_ENV, which its ranks inherit) go; those of this
    # session stay (two cells may write to one run), and so do subfolders (other runs) and any other file.
    since = os.environ.get(SESSION_ENV, "")
    if since:
        for old in folder.glob("events.out.tfevents.*"):
            if old.is_file() and old.stat().st_mtime < float(since):
                old.unlink()
    return SummaryWriter(log_dir=str(folder))


def start_session() -> None:
    """Mark now as the start of the notebook's session: its writers replace older curves (`writer`)."""
    os.environ[SESSION_ENV] = repr(time.time())


def how_to_open(log_dir: str | Path) -> str:
    """How to open TensorBoard on `log_dir`: here, and on a cluster node through an ssh tunnel."""
    log_dir = Path(log_dir).resolve()
    return OPEN_HERE.format(log_dir=log_dir) + "\n" + OPEN_ON_A_CLUSTER.format(log_dir=log_dir)


def read_scalars(log_dir: str | Path, tag: str) -> dict[str, tuple[list[int], list[float]]]:
    """{run: (steps, values)} of `tag` for every run (folder holding event files) below `log_dir`,
    the run named by its path relative to log_dir ("sgd_b32/seed0"); runs without the tag are left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(log_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no TensorBoard log folder {root}")
    runs = sorted({p.parent for p in root.rglob("events.out.tfevents.*")})
    out = {}
    for folder in runs:
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            events = acc.Scalars(tag)
            name = folder.relative_to(root).as_posix() or "."
            out[name] = ([e.step for e in events], [e.value for e in events])
    return out


def plot_scalars(log_dir: str | Path, tag: str = "loss", *, keep: Callable[[str], bool] | None = None, ax=None,
                 logy: bool = False, title: str | None = None):
    """Draw `tag` of every run below `log_dir` on one chart, one line per run, as TensorBoard overlays
    them; `keep(run_name)` chooses the runs ("sgd_b32/seed0"). Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    curves = read_scalars(log_dir, tag)
    if keep is not None:
        curves = {name: c for name, c in curves.items() if keep(name)}
    if not curves:
        raise ValueError(f"no run under {log_dir} has the tag {tag!r}")
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.6))[1]
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, label=name)
    ax.set(title=title or f"TensorBoard tag {tag!r}", xlabel="step", ylabel=tag, yscale="log" if logy else "linear")
    ax.legend(fontsize=8)
    return ax
