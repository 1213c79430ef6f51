"""`dlo bench [OP ...]`: run the GPU kernel benchmarks beside torch baselines and the device peak.

Every module of `dlo.kernels` that defines `bench() -> list[dict]` is an op, named after the module.
Rows carry at least "impl" and "ms", and "GB/s" or "TFLOP/s" with "% peak"; torch baselines have an
impl name starting with "torch". Each bench turns the minimum HBM traffic and math of a row at its
shape into "roofline ms" on this GPU's peaks and "% roofline" (the roofline time over the measured
one) with `dlo.hardware.add_roofline`, the same `dlo.hardware.roofline` the compile report uses.
Results go to `<out_dir>/<YYYY-MM-DD>T<HHMM>_<device-slug>.json` (UTC; runs of one day never overwrite).
`dlo bench --compile-report` needs no GPU: each kernel's compile cases (dlo.kernels.aot) with their
resources per target and their roofline times on the target's GPUs.
"""

from __future__ import annotations

import datetime
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import torch

from dlo import tables
from dlo.errors import BadInput
from dlo.hardware import roofline

NO_GPU_MESSAGE = "dlo bench needs a CUDA GPU; kernels are tested on CPU with TRITON_INTERPRET=1 via make test"
COLUMNS = ("op", "impl", "dtype", "size", "tensors", "ms", "roofline ms", "% roofline", "GB/s", "TFLOP/s", "% peak",
           "x best torch")


def registry() -> dict:
    """Op name -> bench function, for every `dlo.kernels` module exposing `bench`."""
    import dlo.kernels
    ops = {}
    for info in pkgutil.iter_modules(dlo.kernels.__path__):
        module = importlib.import_module(f"dlo.kernels.{info.name}")
        if callable(getattr(module, "bench", None)):
            ops[info.name] = module.bench
    return ops


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set "x best torch" = (fastest torch baseline's ms) / ms among rows of the same op, dtype and size."""
    def case(r):
        return r.get("op"), r.get("dtype"), r.get("size")
    best: dict[tuple, float] = {}
    for r in rows:
        if str(r["impl"]).startswith("torch"):
            best[case(r)] = min(best.get(case(r), float("inf")), r["ms"])
    for r in rows:
        r["x best torch"] = best[case(r)] / r["ms"] if case(r) in best else None
    return rows


def format_table(rows: list[dict]) -> str:
    """The known benchmark columns first, then any others, in first-seen order."""
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    for r in rows:
        cols += [c for c in r if c not in cols]
    return tables.format_table(rows, cols)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _write_json(rows: list[dict], out_dir: str | Path) -> Path:
    import triton

    from dlo.hardware import device_name, peak
    name = device_name()
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"date": now.date().isoformat(), "time": now.strftime("%H:%M:%S UTC"), "device": name, "peak": peak(),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "rows": rows}
    path = Path(out_dir) / f"{now:%Y-%m-%dT%H%M}_{_slug(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def main(ops: list[str], out_dir: str | Path = "bench/results") -> int:
    """Run the named benchmarks (all when `ops` is empty); 0 on success, 2 without CUDA; BadInput for an unknown op."""
    known = registry()
    unknown = [op for op in ops if op not in known]
    if unknown:
        raise BadInput(f"unknown op(s) {', '.join(unknown)}; available: {', '.join(sorted(known))}")
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    rows = []
    for op in ops or sorted(known):
        print(f"benchmarking {op} ...", flush=True)
        rows += [{"op": op, **row} for row in known[op]()]
    add_ratios(rows)
    print(format_table(rows))
    print(f"wrote {_write_json(rows, out_dir)}")
    return 0


# ----------------------------------------------------------------------------- compile report (no GPU)

REPORT_COLUMNS = ("kernel", "config", "target", "regs", "smem KiB", "spill B", "tensor core", "occupancy %",
                  "shape", "MB moved", "GFLOP", "device", "roofline us", "bound", "x torch")


def roofline_ms(case, device: str, work: tuple | None = None) -> tuple[float, str]:
    """`roofline` of a dlo.kernels.aot.CompileCase's work, or of `work` = (bytes, flops, peak)."""
    return roofline(*(work or (case.bytes, case.flops, case.peak)), device)


def compile_report_rows(results: dict, cases: list) -> list[dict]:
    """One row per case, target and device of that target (dlo.kernels.aot.TARGETS) from the
    results of aot.compile_all."""
    from dlo.kernels import aot
    rows = []
    for case in cases:
        for arch, target in aot.TARGETS.items():
            res = results.get((case.name, arch))
            if res is None:
                continue
            row = {"kernel": case.name.split("[")[0], "config": case.label, "target": f"sm_{arch}",
                   "shape": case.shape, "MB moved": case.bytes / 1e6, "GFLOP": case.flops / 1e9}
            if "error" in res:
                row["error"] = res["error"]
            else:
                row.update({"regs": res["regs"], "smem KiB": res["smem"] / 1024, "spill B": res["spill_stores"],
                            "tensor core": res["tensor_core"], "occupancy %": 100 * res["occupancy"]})
            for device in target["devices"] or (None,):
                ms, bound = roofline_ms(case, device) if device else (None, None)
                torch_ms = roofline_ms(case, device, case.torch)[0] if device and case.torch else None
                rows.append({**row, "device": device, "roofline us": ms and ms * 1e3, "bound": bound,
                             "x torch": torch_ms and torch_ms / ms})
    return rows


def compile_report(archs: tuple[int, ...] | None = None) -> int:
    """`dlo bench --compile-report`: compile every kernel case for each target on this machine (no GPU
    needed) and print its resources and its roofline time on the target's GPUs."""
    import tempfile

    from dlo.kernels import aot
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the figures are this checkout's
        results = aot.compile_all(archs or tuple(aot.TARGETS), cache_dir=cache)
    rows = compile_report_rows(results, aot.all_cases())
    print(tables.format_table(rows, [c for c in REPORT_COLUMNS + ("error",) if any(c in r for r in rows)]))
    return 1 if any("error" in r for r in rows) else 0
