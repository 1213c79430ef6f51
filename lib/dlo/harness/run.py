"""`dlo run`: execute day notebooks headlessly with papermill and report a status table.

Each notebook runs in its own papermill child process (`python -m dlo.harness.kernels`: papermill with its
kernel on Unix sockets; its own session), so a
per-notebook timeout can stop it together with its kernel, and a crash in one day never stops
the others. Executed notebooks land in OUT/<day>/<day>.ipynb, and run with OUT/<day> as working
directory so their logs (runs/, TensorBoard) stay out of the checkout.

Before any kernel starts, the days must be named (or `--all` given), every `-p NAME VALUE` is checked
against the parameters cell (its name, and its annotated type as papermill infers it) and the day's
preset is built and validated with the resulting values, and the day's own preflight run
(`dlo.config.resolve`, as `dlo.setup` will in the notebook), so a bad value or an impossible combination
(more ranks than GPUs, weights that are not the model's, a plan that does not fit) fails in one line,
not minutes into a run. The kernels get
DLO_HEADLESS=1 (`dlo.progress` then draws text bars that end in their finished state in the saved
notebook). `--smoke` sets DLO_SMOKE=1: the presets' `smoke()` versions (real model sizes, minimal
step counts). After a run, a failed notebook is named with its failing cell, also when the kernel
died (papermill then marks no cell failed). papermill's own progress bar is drawn only where
`dlo.progress.bars_wanted()` (stderr a terminal, or DLO_PROGRESS=1). A timeout or a stop kills
papermill with its kernel and everything they started (`reaper.kill_tree`: the kernel runs in a
session of its own).

`--jobs N` runs N notebooks at once, the longest expected first (`schedule.RUN_SECONDS`), each with its
share of the cores (OMP_NUM_THREADS, unless set, and DLO_CORES: a timing verdict then counts on the
share, so on 2 cores a row timed beside the other notebook says "not measurable here"); the default is
two where there are 2 cores or more (one notebook alone keeps about one core busy), else one. A single
day runs alone, with every core. The table keeps the days' order. Notebooks on GPUs never share one: each
of the notebooks at once gets a disjoint share of this process's GPUs (CUDA_VISIBLE_DEVICES, taken from
the entries the parent was given) holding what its day wants, else they run one at a time with every GPU;
a --jobs that would leave a day fewer GPUs than it wants is refused before any notebook starts.
`--grade DIR` grades each notebook as soon as it has run, in the same slots (`dlo.harness.arrivals`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import nbformat
import papermill

from dlo.cpus import SHARE_ENV
from dlo.errors import BadInput
from dlo.harness import arrivals
from dlo.harness.days import notebook_path, select_days
from dlo.harness.schedule import RUN_SECONDS, cores, order
from dlo.progress import bars_wanted
from dlo.reaper import kill_tree
from dlo.tables import format_table

# Parameters naming paths: resolved against the caller's working directory, not the notebook's.
PATH_PARAMETERS = ("data_dir", "log_dir", "weights_dir")
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class BadParameter(BadInput):
    """A -p value that does not fit its parameter (exit status 2, before any work)."""


def parse_value(text: str):
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string (untyped parameters)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def typed_value(name: str, text: str, type_name: str | None):
    """`text` as the parameters cell's annotated type ("int", "float", "bool", "str"); BadParameter
    (one line: "max_steps is an int: 'x' is not") when it is not one."""
    if type_name == "int":
        try:
            return int(text)
        except ValueError:
            raise BadParameter(f"{name} is an int: {text!r} is not") from None
    if type_name == "float":
        try:
            return float(text)
        except ValueError:
            raise BadParameter(f"{name} is a float: {text!r} is not") from None
    if type_name == "bool":
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise BadParameter(f"{name} is a bool: {text!r} is not (true or false)")
    if type_name == "str":
        return text
    return parse_value(text)


def build_parameters(nb: Path, profile: str, pairs: list[tuple[str, str]]) -> dict:
    declared = papermill.inspect_notebook(str(nb))
    if not declared:
        raise SystemExit(f"{nb}: no cell tagged 'parameters'")
    params = {"profile": profile}
    for name, text in pairs:
        if name not in declared:
            raise BadParameter(f"no parameter {name!r}; its parameters are: {', '.join(declared)}")
        value = typed_value(name, text, declared[name].get("inferred_type_name"))
        if name in PATH_PARAMETERS and value:
            value = str(Path(value).resolve())
        params[name] = value
    return params


def check_day(day: str, nb: Path, params: dict, smoke: bool = False):
    """The parameters the kernel will see (defaults of the parameters cell, then the overrides)
    resolved as `dlo.setup` will resolve them (`dlo.config.resolve`: the preset, the ranks, the data
    folder, the day's preflight): the resolved `dlo.config.Run` (None for a day without presets),
    BadParameter (one line) when that fails."""
    from dlo.config import resolve
    from dlo.registry import DAYS, PARAMETERS

    if day not in DAYS:
        return None  # a course day without presets (the harness tests' toy day)
    declared = papermill.inspect_notebook(str(nb))
    values = {}
    for name, info in declared.items():
        try:
            values[name] = json.loads(info["default"]) if info["default"] is not None else None
        except (TypeError, ValueError):
            continue  # a default that is not a plain literal: leave it to the notebook
    values.update(params)
    try:
        return resolve(day, smoke=smoke, **{k: values[k] for k in PARAMETERS + DAYS[day].parameters if k in values})
    except ValueError as exc:
        raise BadParameter(str(exc)) from None


def failure(dest: Path) -> str:
    """Which cell of the notebook failed (numbered from 0 as in the source, papermill's injected
    parameters left out), and how: "cell 18 raised ValueError: ..." or,
    when the kernel died (papermill marks no cell failed then), "kernel died in cell 18"; the
    cell's first line is quoted. The dead kernel's cell also gets an error output in `dest`."""
    try:
        nb = nbformat.read(dest, as_version=4)
    except (OSError, ValueError):
        return "no executed notebook"
    started, i = None, -1
    for cell in nb.cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue  # papermill's cell: the numbers are those of the source notebook
        i += 1
        meta = cell.get("metadata", {}).get("papermill", {})
        line = next((ln for ln in cell.get("source", "").splitlines() if ln.strip()), "")[:60]
        if meta.get("exception"):
            err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), {})
            return f"cell {i} `{line}` raised {err.get('ename', 'an error')}: {str(err.get('evalue', ''))[:120]}"
        if cell.cell_type == "code" and meta.get("start_time"):
            started = (i, line, cell)
    if started is None:
        return "failed before the first cell"
    i, line, cell = started
    cell.metadata.papermill.update(status="failed", exception=True)
    cell.outputs.append(nbformat.v4.new_output("error", ename="DeadKernelError",
                                               evalue="the kernel died while running this cell (out of memory? "
                                                      "a crash in native code?)", traceback=[]))
    nbformat.write(nb, dest)
    return f"kernel died in cell {i} `{line}` (out of memory? a crash in native code?)"


def run_notebook(src: Path, dest: Path, params: dict, timeout: float, cell_timeout: float,
                 smoke: bool = False, env: dict | None = None) -> tuple[str, float]:
    """Execute one notebook; returns (status, seconds). Status: ok, failed (rc, cell) or timeout."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # papermill's command line, its kernel on Unix sockets rather than localhost TCP (dlo.harness.kernels)
    cmd = [sys.executable, "-m", "dlo.harness.kernels", str(src), str(dest), "-y", json.dumps(params),
           "--cwd", str(dest.parent), "--execution-timeout", str(int(cell_timeout)),
           "--progress-bar" if bars_wanted() else "--no-progress-bar", "--log-level", "WARNING"]
    # DLO_HEADLESS: dlo.progress draws text bars, whose last state is what the saved notebook shows
    env = {**os.environ, "DLO_HEADLESS": "1", **({"DLO_SMOKE": "1"} if smoke else {}), **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        rc = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        kill_tree(proc.pid)  # papermill, its kernel (a session of its own) and what the kernel started
        proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            raise
        return "timeout", time.perf_counter() - start
    secs = time.perf_counter() - start
    return ("ok" if rc == 0 else f"failed (rc={rc}): {failure(dest)}"), secs


def default_jobs() -> int:
    """Two notebooks at once where there are 2 cores or more, else one: one notebook alone keeps about one
    core busy (its ranks wait on each other and on gloo; `make run` on 2 cores: 0.8 of them)."""
    return 2 if cores() >= 2 else 1


def share_env(n: int) -> dict:
    """Each of n notebooks' share of the cores: its threads (OMP_NUM_THREADS, unless set) and the cores
    its timing verdicts may count on (`dlo.cpus.SHARE_ENV`)."""
    if n == 1:
        return {}
    share = str(max(1, cores() // n))
    return {SHARE_ENV: share, **({} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": share})}


def gpus_wanted(resolved) -> int:
    """The GPUs a day's notebook computes on when it runs alone here: one per rank on a CUDA device (as
    many as there are at most; 1 on single-process days), none on the CPU (or for a day without presets)."""
    if resolved is None or resolved.device.type != "cuda":
        return 0
    from dlo.distributed.placement import cuda_count

    return min(max(1, resolved.world_size), cuda_count())


def gpu_slots(wanted: dict[str, int], gpus: list[str], n: int, asked: int | None) -> tuple[int, list[dict]]:
    """(notebooks at once, each slot's environment) such that notebooks on GPUs never share one: one at a
    time with every GPU, or disjoint shares of this process's GPUs (`gpus`, as CUDA_VISIBLE_DEVICES names
    them: `dlo.distributed.placement.gpu_share`) that hold what each day wants. `n`: the notebooks at once
    the cores allow; `asked` (--jobs) more than the GPUs allow is refused (BadInput, one line)."""
    most = max(wanted.values(), default=0)
    if not most:
        return n, [{}] * n
    fit = max(1, len(gpus) // most)
    if asked is not None and n > fit:
        day = max(wanted, key=wanted.get)
        raise BadInput(f"--jobs {asked}: {len(gpus)} GPU(s) split {n} ways leave {len(gpus) // n} per notebook, but "
                       f"{day} wants {most}; use --jobs {fit} (notebooks on GPUs never share one)")
    n = min(n, fit)
    if n == 1:
        return 1, [{}]  # alone: every GPU, as this process sees them
    from dlo.distributed.placement import gpu_share

    return n, [{"CUDA_VISIBLE_DEVICES": ",".join(gpu_share(gpus, s, n))} for s in range(n)]


def main(root: Path, days: list[str], all_days: bool, profile: str, pairs: list[tuple[str, str]],
         notebooks: str, out: str | None, timeout: float, cell_timeout: float, smoke: bool = False,
         jobs: int | None = None, grade_out: str | None = None, require_full: bool = False) -> int:
    """`grade_out`: grade each notebook once it has run, into that folder (`dlo.harness.arrivals`)."""
    if bool(days) == all_days:
        raise BadInput("name the days to run (dlo run DAY ...) or pass --all for every day, not both"
                       if days else "name the days to run (dlo run DAY ...) or pass --all for every day")
    if require_full and grade_out is None:
        raise BadInput("--require-full is about the grading: give --grade DIR too")
    days = select_days(root, days, all_days, notebooks)
    if jobs is not None and jobs < 1:
        raise BadInput(f"--jobs {jobs}: expected a positive number")
    out_dir = Path(out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    # the grading's checks (its --out, the sandbox) run beside the ones below; it writes nothing before `begin`
    grading = None if grade_out is None else arrivals.start(root, out_dir, days, Path(grade_out).resolve(), profile,
                                                             require_full)
    def one(day: str) -> dict:
        src, params = todo[day]
        dest = out_dir / day / f"{day}.ipynb"
        print(f"== {day} ({notebooks}, profile={profile}{', smoke' if smoke else ''}) -> {dest}", flush=True)
        taken = slots.get()
        try:
            status, secs = run_notebook(src, dest, params, timeout, cell_timeout, smoke, taken[1])
        finally:
            slots.put(taken)
            if grading is not None:
                grading.arrivals.made(day)
        if n > 1:
            print(f"== {day}: {status} in {secs:.1f} s", flush=True)
        return {"day": day, "status": status, "wall time (s)": round(secs, 1), "output": str(dest)}

    try:
        n, slots, todo = _prepare(root, days, profile, pairs, notebooks, smoke, jobs)
        if grading is not None:
            grading.begin(slots)
        rows = run_all(days, one, n)
    except BaseException:
        if grading is not None:  # refused or stopped: no grading job waits for a notebook that will not come
            grading.arrivals.stop()
        raise
    print()
    print(format_table(rows))
    rc = 0 if all(r["status"] == "ok" for r in rows) else 1
    return rc if grading is None else max(rc, grading.finish())


def _prepare(root: Path, days: list[str], profile: str, pairs, notebooks: str, smoke: bool, jobs: int | None):
    """(n, the slots, {day: (notebook, parameters)}): every day's parameters checked (BadParameter) before the
    first notebook starts, n notebooks at once, each slot an (index, env) pair with its share of the cores
    and GPUs."""
    todo, wanted = {}, {}
    for day in days:
        src = notebook_path(root, day, notebooks)
        try:
            params = build_parameters(src, profile, pairs)
            wanted[day] = gpus_wanted(check_day(day, src, params, smoke))
        except BadParameter as exc:
            raise BadParameter(f"{day}: {exc}") from None
        todo[day] = (src, params)
    n = min(jobs or default_jobs(), len(todo))
    if any(wanted.values()):
        from dlo.distributed.placement import cuda_count, visible_gpus

        n, gpu_envs = gpu_slots(wanted, visible_gpus(os.environ, cuda_count()), n, jobs)
    else:
        gpu_envs = [{}] * n
    slots: queue.Queue[tuple[int, dict]] = queue.Queue()
    for i, gpu_env in enumerate(gpu_envs):  # a running notebook holds its slot's GPUs until it ends
        slots.put((i, {**share_env(n), **gpu_env}))
    return n, slots, todo


def run_all(days: list[str], one, n: int) -> list[dict]:
    """`one(day)` for every day, n at a time, the longest expected first; the rows in the days' order."""
    if n == 1:
        return [one(day) for day in days]
    # not `with`: on Ctrl-C its exit would wait for the notebooks (`dlo.cli` kills them instead)
    pool = ThreadPoolExecutor(max_workers=n)
    try:
        first = order(days, {d: RUN_SECONDS.get(d, 0.0) for d in days})
        done = dict(zip(first, pool.map(one, first)))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [done[day] for day in days]
