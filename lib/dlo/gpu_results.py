"""Every GPU measurement of the course, per day: the committed `bench/results/` files of GPU runs as one table.

A notebook's text may quote a GPU number; its "measured on a GPU" cell prints `gpu_table(day)`, every row of
every GPU results file that concerns the day, agreeing with its claim or not, so the text cannot quote a subset.
A GPU results file is named `<YYYY-MM-DD>T<HHMM>_<device>[_<what>].<json|txt>` with a device other than
"cpu" (the CPU dry run of `bench/gpu_check.sh` is no GPU measurement). What each kind gives:

- `dlo bench` JSON (`rows` of kernel timings) and `bench/block_sweep.py` JSON: one row per timing, on the
  days whose notebooks teach the kernel (`KERNEL_DAYS`);
- a `bench/gpu_check.sh` session JSON: each step's claims rows (with the step's day), Day 5's 3B recipe,
  Day 4's three data-parallel versions, the graded day, the kernel tests and `dlo bench`'s rows; a step
  that failed or timed out is a row too;
- a text log of days run at the full profile (`## Day N` sections, `### cell N` within): every claims row
  printed there, and each cell's other output verbatim (the tables the claims are read from);
- a text log of kernel timings or GPU tests: one row per line that names a shape, or the tests' summary and
  each failure, on the days of the kernels (or modules) they exercise.

Rows carry the device, date, file and commit (the session's own, else the commit that added the file, from
`git log`, else "-"). Nothing is fetched: the folder is found beside the checkout the `dlo` package was
imported from, or above the working directory (a notebook in a course folder); without one, one line says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dlo.claims_audit import HEADER, parse_tables
from dlo.estimates import format_number

RESULTS_ENV = "DLO_BENCH_RESULTS"  # a results folder of one's own (tests, a copy of the course)
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})T(\d{2})(\d{2})_([a-z0-9-]+?)(?:_([\w.-]+))?\.(json|txt)$")
# the kernels (modules of dlo.kernels) and the modules whose GPU tests `gpu_check.sh` runs, by the day that
# teaches them (tests/test_gpu_results.py holds this to the notebooks' imports)
KERNEL_DAYS = {"fused_adamw": "day1_optimizers", "amp_unscale": "day2_mixed_precision",
               "flash_attention": "day2_mixed_precision", "quantize": "day8_quantization_pruning",
               "weight_only_matmul": "day8_quantization_pruning", "int8_gemm": "day8_quantization_pruning",
               "sparse24": "day8_quantization_pruning", "paged_attention": "day9_inference",
               "weight_only_decode": "day9_inference"}
# kernels `dlo bench` times whose day has no notebook yet: their rows are in no day's table until it has one
NO_DAY_YET: dict[str, str] = {}
MODULE_DAYS = {"amp": "day2_mixed_precision", "attention": "day2_mixed_precision",
               "quant": "day8_quantization_pruning", "smoothquant": "day8_quantization_pruning",
               "inference": "day9_inference"}
PRINTED = "printed"  # the verdict of a log cell's other output, shown verbatim under the file's rows
_STEP_DAYS = {"day5_3b": "day5_fsdp", "day4_ddp": "day4_ddp",
              "day10_cp": "day10_context_experts"}  # session steps measured for one day


@dataclass(frozen=True)
class GpuRow:
    """One measurement of a GPU results file, for one day."""

    day: str
    file: str
    device: str
    date: str
    commit: str
    what: str  # the claim, or the benchmark's case
    claimed: str
    value: str
    verdict: str  # a claims verdict; "benchmark" for a timing no claim is attached to; a step's status


def results_dir() -> Path | None:
    """The committed results folder: $DLO_BENCH_RESULTS, else bench/results beside the checkout `dlo` comes from,
    else the first bench/results above the working directory; None when there is none."""
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    here = Path(__file__).resolve()
    for root in [here.parents[2], *Path.cwd().resolve().parents, Path.cwd().resolve()]:
        if (root / "bench" / "results").is_dir():
            return root / "bench" / "results"
    return None


def gpu_files(folder: Path) -> list[Path]:
    """The GPU runs' files of a results folder, by name (oldest first)."""
    return sorted(p for p in folder.iterdir() if (m := NAME.match(p.name)) and m.group(4) != "cpu")


def _commits(folder: Path) -> dict[str, str]:
    """File name -> the commit that added it, from git log ({} outside a git checkout)."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=@%h", "--name-only", "--", "."],
                             cwd=folder, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    added, commit = {}, "-"
    for line in out.splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.strip():
            added.setdefault(Path(line).name, commit)  # newest first: keep the commit of the latest add
    return added


def day_names() -> dict[int, str]:
    from dlo.registry import DAYS

    return {d.number: d.name for d in DAYS.values()}


def kernel_day(name: str) -> str | None:
    """The day of a benchmark op or kernel ("sparse24_matmul" is sparse24's)."""
    hits = [k for k in KERNEL_DAYS if name == k or name.startswith(k + "_")]
    return KERNEL_DAYS[max(hits, key=len)] if hits else None


def _n(x) -> str:
    return format_number(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _bench_row(r: dict) -> tuple[str, str]:
    """(what, value) of one kernel timing (`dlo bench` or block sweep)."""
    case = " ".join(str(r[k]) for k in ("impl", "dtype") if r.get(k))
    tiles = ", ".join(f"{k} {r[k]}" for k in ("BLOCK", "num_warps", "num_stages") if k in r)
    size = f"{r.get('size', '')}" + (f" ({r['tensors']} tensors)" if r.get("tensors") else "")
    what = " ".join(filter(None, [r.get("op") or r.get("kernel"), case, size, f"[{tiles}]" if tiles else ""]))
    parts = [f"{_n(r['ms'])} ms"] if "ms" in r else []
    parts += [f"{_n(r[k])} {k}" for k in ("GB/s", "TFLOP/s") if r.get(k) is not None]
    parts += [f"{_n(r['% peak'])}% of peak"] if r.get("% peak") is not None else []
    parts += [f"{_n(r['x best torch'])}x best torch"] if r.get("x best torch") is not None else []
    return what, ", ".join(parts)


def _claims(day: str, rows: list[dict]) -> list[tuple]:
    """Claims rows: the claimed value with the region its verdict was judged against ("55% less: 0.55 +- 0.1")."""
    def claimed(r):
        tested = r.get("tested as", "-")
        return r.get("claimed", "-") + (f": {tested}" if tested not in ("", "-") else "")
    return [(day, r.get("claim", "?"), claimed(r), r.get("measured [95% interval]", "-"), r.get("verdict", "-"))
            for r in rows]


def _from_bench(rows: list[dict]) -> list[tuple]:
    out = []
    for r in rows:
        day = kernel_day(str(r.get("op") or r.get("kernel") or ""))
        what, value = _bench_row(r)
        out += [(day, what, "-", value, "benchmark")] if day else []
    return out


def _tag_kernel(tag: str) -> str | None:
    """The kernel a file's tag names ("weight-only-old-vs-new": weight_only_matmul): its first two words, or
    its first word for a one-word kernel."""
    words = tag.replace("-", "_").split("_")
    for k in KERNEL_DAYS:
        w = k.split("_")
        if words[:len(w)] == w or (len(w) > 1 and words[:2] == w[:2]):
            return k
    return None


def _from_session(d: dict) -> list[tuple]:
    out = []
    for step in d.get("steps", []):
        name, status = step.get("name", "?"), step.get("status", "?")
        nums = step["numbers"] if isinstance(step.get("numbers"), dict) else {}
        day = nums.get("day") or _STEP_DAYS.get(name)
        if nums.get("claims"):
            out += _claims(day, nums["claims"])
        if name == "day5_3b" and nums:
            out.append((day, f"Llama recipe at world {nums.get('world')} ({nums.get('model')}): MFU, step, peak", "-",
                        f"MFU {_n(nums.get('mfu'))}, {_n(nums.get('step_s'))} s/step, peak "
                        f"{_n(nums.get('peak_step_bytes') or nums.get('peak_bytes'))} B", "measured"))
        if name == "day4_ddp" and nums.get("versions"):
            out += [(day, f"{v} step (median of {len(t.get('times_ms', []))})", "-", f"{_n(t.get('median_ms'))} ms",
                     "measured") for v, t in nums["versions"].items()]
        if name == "day10_cp":
            out += _day10_rows(day, nums)
        if name == "grade" and nums.get("scores"):
            out += [(day, "dlo grade on the GPU", s.get("max_score", "-"), s.get("score", "-"), s.get("status", "-"))
                    for s in nums["scores"]]
        if name in ("bench", "day9_decode"):  # dlo bench's record of every kernel, or of Day 9's decode kernel
            out += _from_bench(bench_records(nums))
        if name == "gpu_tests" and status != "skipped":
            counts = ", ".join(f"{nums[k]} {k}" for k in ("passed", "failed", "skipped") if k in nums)
            out += _tests(counts, nums.get("failures", []))
        if status not in ("ok", "skipped") and (day or name in ("gpu_tests", "bench")):
            out.append((day, f"step {name}", "-", step.get("reason") or nums.get("failure", "-"), status))
    return [r for r in out if r[0]]


def bench_records(numbers: dict) -> list[dict]:
    """The kernel timings a session's bench step kept: `dlo bench`'s record (or a list of them) under "rows"."""
    recs = numbers.get("rows") or []
    return [r for rec in (recs if isinstance(recs, list) else [recs]) if isinstance(rec, dict)
            for r in rec.get("rows", [])]


def _tests(summary: str, failures: list[str]) -> list[tuple]:
    """The GPU tests' summary on every day with a kernel, each failure on its module's day."""
    out = [(day, "GPU tests (tests/kernels and the kernels' modules)", "all pass", summary,
            "agrees" if " failed" not in summary and "error" not in summary else "disagrees")
           for day in sorted(set(KERNEL_DAYS.values()))]
    for line in failures:
        m = re.search(r"tests/(?:\w+/)*test_(\w+)\.py", line)
        day = m and (kernel_day(m.group(1)) or MODULE_DAYS.get(m.group(1)))
        out += [(day, line.strip(), "passes", "fails", "disagrees")] if day else []
    return out


def _day10_rows(day: str, nums: dict) -> list[tuple]:
    """Day 10's GPU step: ring attention against SDPA and torch's context_parallel per rank, the MoE step."""
    out = []
    for r in nums.get("ring", []):
        where = f"ring attention, rank of world {r.get('world')} ({r.get('backend')}), T={r.get('T')}"
        out.append((day, f"{where}: max |error| vs SDPA", "< 1e-3", _n(r.get("ring_max_err")),
                    "passes" if (r.get("ring_max_err") or 1.0) < 1e-3 else "fails"))
        out.append((day, f"{where}: step (median)", "-", f"{_n(r.get('ring_step_ms'))} ms", "measured"))
        torch_cp = r.get("torch_cp_max_err") or r.get("torch_cp_error", "-")
        out.append((day, f"{where}: torch context_parallel vs SDPA", "-", str(torch_cp)[:120], "measured"))
    moe = nums.get("moe_vs_dense") or {}
    if moe:
        out.append((day, "MoE step / dense step of the same active parameters", "-",
                    f"{_n(moe.get('ratio'))} ({_n(moe['moe'].get('median_ms'))} / "
                    f"{_n(moe['dense, same active'].get('median_ms'))} ms)", "measured"))
    return out


def _beside_claims(block: str, rows: list[int]) -> str:
    """A log cell's printed lines other than its claims tables (whose rows are listed one by one)."""
    lines, keep, i = block.strip("\n").splitlines(), [], 0
    while i < len(lines):
        if all(h in lines[i] for h in HEADER) and rows:
            i += 2 + rows.pop(0)  # header, rule, rows
            continue
        keep.append(lines[i])
        i += 1
    return "\n".join(keep).strip("\n")


def _from_text(text: str, name: str) -> list[tuple]:
    days, out = day_names(), []
    sections = re.split(r"^## (Day \d+.*)$", text, flags=re.M)
    for head, body in zip(sections[1::2], sections[2::2]):
        day = days.get(int(re.match(r"Day (\d+)", head).group(1)))
        cells = re.split(r"^### (.+)$", body, flags=re.M)
        for cell, block in [("", cells[0]), *zip(cells[1::2], cells[2::2])]:
            tables = parse_tables(block)
            out += _claims(day, [r for t in tables for r in t])
            printed = _beside_claims(block, [len(t) for t in tables])
            out += [(day, f"{head}, {cell}" if cell else head, "-", printed, PRINTED)] if printed else []
    if len(sections) > 1:
        return out
    summary = re.search(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?),? ?)+)in [\d.]+s", text, re.M)
    if summary:
        return _tests(summary.group(1).strip(" ,"), re.findall(r"^FAILED .*$", text, re.M))
    kernel = _tag_kernel(NAME.match(name).group(5) or "")
    shapes = [m for m in re.finditer(r"^((?:[A-Z]=\d+ )+)(.+)$", text, re.M)] if kernel else []
    return [(KERNEL_DAYS[kernel], f"{kernel} {m.group(1).strip()}", "-", m.group(2).strip(), "benchmark")
            for m in shapes]


def gpu_rows(day: str | None = None, folder: Path | None = None) -> list[GpuRow]:
    """Every row of every GPU results file (of `day` only, when given), file by file, in file order."""
    folder = folder or results_dir()
    if folder is None or not folder.is_dir():
        return []
    added, rows = _commits(folder), []
    for path in gpu_files(folder):
        date, hh, mm, device, _, ext = NAME.match(path.name).groups()
        commit = added.get(path.name, "-")
        if ext == "json":
            d = json.loads(path.read_text())
            session = d.get("session") or {}
            device = session.get("device") or d.get("device") or device
            commit = (session.get("commit") or "")[:7] or commit
            found = _from_session(d) if "steps" in d else _from_bench(d.get("rows", []))
        else:
            found = _from_text(path.read_text(), path.name)
        rows += [GpuRow(r[0], path.name, device, f"{date} {hh}:{mm}", commit, *map(str, r[1:])) for r in found]
    return [r for r in rows if day is None or r.day == day]


def _known(day: str) -> None:
    from dlo.registry import DAYS, names

    if day not in {*DAYS, *names()}:
        raise ValueError(f"no day {day!r}: one of {', '.join(names())}")


def gpu_table(day: str, folder: Path | None = None) -> str:
    """The day's "measured on a GPU" table: one block per results file (device, date, commit), every row
    that concerns the day, agreeing or not; one line when there is no results folder or no row."""
    from dlo.tables import format_table

    _known(day)
    folder = folder or results_dir()
    if folder is None or not folder.is_dir():
        return f"no bench/results folder here (a course checkout has one): no GPU measurement of {day} to show"
    rows, where = gpu_rows(day, folder), f"{folder.parent.name}/{folder.name}/"  # no machine's own path
    if not rows:
        return f"no GPU measurement of {day} in {where} yet"
    out = [f"{day}: every GPU measurement committed under {where} ({len(rows)} rows, agreeing or not)"]
    for file in dict.fromkeys(r.file for r in rows):
        block = [r for r in rows if r.file == file]
        out += ["", f"{file}: {block[0].device}, {block[0].date} UTC, commit {block[0].commit}"]
        listed = [{k: v for k, v in asdict(r).items() if k in ("what", "claimed", "value", "verdict")}
                  for r in block if r.verdict != PRINTED]
        out += [format_table(listed)] if listed else []
        for r in block:
            out += [f"\n{r.what}, printed by the same run:", r.value] if r.verdict == PRINTED else []
    return "\n".join(out)


def main(days: list[str]) -> int:
    """`python -m dlo.gpu_results [DAY ...]`: each day's table (every day's when none is named)."""
    from dlo.registry import names

    try:
        tables = [gpu_table(day) for day in days or names()]
    except ValueError as exc:
        print(f"dlo.gpu_results: {exc}", file=sys.stderr)
        return 2
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
