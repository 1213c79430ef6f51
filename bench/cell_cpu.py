"""CPU seconds of each code cell of a day's notebook, as its kernel spends them (itself and the ranks
or other children it waits for), at the tiny profile.

    .venv/bin/python bench/cell_cpu.py [--day day2_mixed_precision ...] [--notebooks solutions|course]

After every cell the kernel is asked, silently, for getrusage(SELF) + getrusage(CHILDREN); the
difference is the cell's. It is also asked for the machine's busy CPU seconds (/proc/stat), which
count all processes (wrong on a shared machine): `machine_cpu_s`. Cells are labelled as the grader
sees them (`dlo.harness.graded`): graded (solution or test), before the last graded cell, or after
it (what `dlo grade` skips unless --full-notebook). The result goes to
bench/results/cell-cpu-<date>.json and is printed; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from dlo.harness.graded import last_graded_index
from dlo.registry import names

REPO = Path(__file__).resolve().parents[1]
# the kernel's own CPU (with the children it waited for), then the machine's busy CPU seconds from /proc/stat
# (user+nice+system+irq+softirq+steal): on an otherwise idle machine the latter also counts the ranks a
# fork server started, whose CPU never reaches the kernel's getrusage
PROBE = ("import resource as _r, os as _o\n_a, _b = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)\n"
         "_s = [int(x) for x in open('/proc/stat').readline().split()[1:9]]\n"
         "print(_a.ru_utime + _a.ru_stime + _b.ru_utime + _b.ru_stime,"
         " (sum(_s) - _s[3] - _s[4]) / _o.sysconf('SC_CLK_TCK'))\ndel _r, _o, _a, _b, _s")


class Probing(NotebookClient):
    """Runs each cell, then the probe; keeps the kernel's CPU seconds after each cell."""

    def __init__(self, nb, **kw):
        super().__init__(nb, **kw)
        self.cpu, self.seen = [], {}

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        out = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        if cell.cell_type == "code":
            # read now: nbclient stores the probe at this cell's index, its source and metadata with it
            self.seen[cell_index] = (cell.source, dict(cell.metadata.get("nbgrader", {})))
            probe = nbformat.v4.new_code_cell(PROBE)
            await super().async_execute_cell(probe, cell_index, store_history=False)
            text = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
            self.cpu.append((cell_index, *map(float, text.split()[-2:])))
        return out


def profile(day: str, notebooks: str) -> dict:
    nb = nbformat.read(REPO / notebooks / day / f"{day}.ipynb", as_version=4)
    last = last_graded_index(nb)
    with tempfile.TemporaryDirectory(prefix="dlo-cell-cpu-") as tmp:
        os.environ.update(DLO_PROFILE="tiny", DLO_HEADLESS="1")
        client = Probing(nb, timeout=1800, kernel_name="python3", allow_errors=True,
                         resources={"metadata": {"path": tmp}})
        client.execute()
    cells, prev = [], 0.0
    machine0 = client.cpu[0][2] if client.cpu else 0.0
    prev_machine = machine0
    for index, cpu, machine in client.cpu:
        source, meta = client.seen[index]
        where = ("graded" if meta.get("solution") or meta.get("grade") else
                 "after the last graded cell" if index > last else "before the last graded cell")
        cells.append({"index": index, "where": where, "cpu_s": round(cpu - prev, 2),
                      "machine_cpu_s": round(machine - prev_machine, 2),
                      "first_line": source.strip().splitlines()[0][:60] if source.strip() else ""})
        prev, prev_machine = cpu, machine
    sums, machine_sums = {}, {}
    for c in cells:
        sums[c["where"]] = round(sums.get(c["where"], 0) + c["cpu_s"], 1)
        machine_sums[c["where"]] = round(machine_sums.get(c["where"], 0) + c["machine_cpu_s"], 1)
    # the machine's count starts at the first cell's end: the kernel's start is in neither
    return {"day": day, "notebooks": notebooks, "kernel_cpu_s": round(prev, 1), "by_place": sums,
            "machine_cpu_s": round(prev_machine - machine0, 1), "machine_by_place": machine_sums, "cells": cells}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--day", nargs="+", default=["day3_checkpointing"], choices=names())
    ap.add_argument("--notebooks", default="solutions", choices=["solutions", "course"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    results = []
    for day in args.day:
        res = profile(day, args.notebooks)
        print(json.dumps({k: v for k, v in res.items() if k != "cells"}), flush=True)
        results.append(res)
    dest = Path(args.out) / f"cell-cpu-{datetime.now():%Y%m%d-%H%M}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "results": results}, indent=1))
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
