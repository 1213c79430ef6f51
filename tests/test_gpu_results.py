"""dlo.gpu_results: every GPU measurement committed under bench/results, per day, agreeing or not."""

import json
import re
from pathlib import Path

import pytest

from dlo import claims as C
from dlo import estimates as E
from dlo.claims_audit import parse_tables
from dlo.gpu_results import (
    KERNEL_DAYS,
    MODULE_DAYS,
    NO_DAY_YET,
    bench_records,
    gpu_rows,
    gpu_table,
    kernel_day,
    results_dir,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
H200_DAYS_2_3 = RESULTS / "2026-11-26T0600_nvidia-h200_days-2-3-full.txt"


def _claims_text() -> str:
    rows = [C.Claim("fused attention ~3x faster (T=8192)", "Lippe 2024", "3x", C.approx(3.0, rel=0.5),
                    C.timed(E.median_interval([2.9, 2.95, 2.93]), device="cuda", gpu_claim=True, cores=16)),
            C.Claim("30% memory reduction", "Lippe 2024", "30% less", C.approx(0.3, abs_tol=0.1), E.exact(0.186))]
    return C.claims_table(rows)


def _write(folder: Path) -> Path:
    folder.mkdir()
    bench = {"date": "2026-12-01", "device": "NVIDIA H200", "rows": [
        {"op": "fused_adamw", "impl": "dlo triton", "dtype": "float32", "size": 1000, "tensors": 3, "ms": 0.125,
         "GB/s": 4000.0, "% peak": 83.3, "x best torch": 1.1},
        {"op": "sparse24_matmul", "impl": "2:4 semi-structured", "size": "8x8x8", "ms": 1.19, "TFLOP/s": 925.0},
        {"op": "unknown_op", "impl": "x", "ms": 9.99}]}
    (folder / "2026-12-01T1000_nvidia-h200.json").write_text(json.dumps(bench))
    session = {"session": {"device": "NVIDIA H200", "commit": "0123456789abcdef"}, "steps": [
        {"name": "smoke_day4", "status": "ok", "numbers": {"day": "day4_ddp", "claims": [
            {"claim": "gloo puts 2(N-1)/N on the wire", "claimed": "1.5 n", "measured [95% interval]": "1.5",
             "verdict": "agrees", "evidence": "exact"}]}},
        {"name": "day5_3b", "status": "ok", "numbers": {"model": "llama3.2-3b", "world": 1, "mfu": 0.412,
                                                         "step_s": 2.5, "peak_step_bytes": 7.1e10}},
        {"name": "smoke_day6", "status": "timeout", "reason": "over its 120 s budget",
         "numbers": {"day": "day6_pipeline"}},
        {"name": "env", "status": "ok", "numbers": {"torch": "2.11"}},
        {"name": "bench", "status": "ok", "numbers": {"file": "x.json", "rows": {"device": "NVIDIA H200", "rows": [
            {"op": "int8_gemm", "impl": "dlo int8 + rescale", "size": "8x8x8", "ms": 0.399}]}}}]}
    (folder / "2026-12-01T1100_nvidia-h200_gpu-session.json").write_text(json.dumps(session))
    cpu = {"session": {"device": "cpu"}, "steps": [{"name": "smoke_day4", "status": "ok", "numbers": {
        "day": "day4_ddp", "claims": [{"claim": "from the CPU dry run", "verdict": "agrees"}]}}]}
    (folder / "2026-12-01T1200_cpu_gpu-session.json").write_text(json.dumps(cpu))
    (folder / "grade-class-20261201-1300.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": []}))
    log = f"# Days 2 at the full profile\n## Day 2\n### cell 50\n{_claims_text()}\n\n### cell 51\ndone\n"
    (folder / "2026-12-01T1300_nvidia-h200_days-2-full.txt").write_text(log)
    tests = "....F.\nFAILED tests/kernels/test_quantize.py::test_round - assert 1 == 2\n1 failed, 5 passed in 3.2s\n"
    (folder / "2026-12-01T1400_nvidia-h200_gpu-tests.txt").write_text(tests)
    return folder


def test_each_kind_of_results_file_gives_its_rows_to_the_days_it_concerns(tmp_path):
    folder = _write(tmp_path / "results")
    rows = gpu_rows(folder=folder)
    by_day = {d: [r for r in rows if r.day == d] for d in {r.day for r in rows}}
    # kernel timings on their kernels' days; an op no day teaches is left out
    (adamw,) = [r for r in by_day["day1_optimizers"] if "fused_adamw" in r.what]
    assert adamw.value == "0.125 ms, 4,000 GB/s, 83.3% of peak, 1.1x best torch" and adamw.verdict == "benchmark"
    assert adamw.device == "NVIDIA H200" and adamw.date == "2026-12-01 10:00" and adamw.commit == "-"
    assert any("sparse24_matmul 2:4" in r.what for r in by_day["day8_quantization_pruning"])
    assert not any("unknown_op" in r.what for r in rows)
    # a session: its claims rows with their step's day and the session's commit; a timed-out step is a row
    (gloo,) = by_day["day4_ddp"]
    assert (gloo.what, gloo.value, gloo.verdict, gloo.commit) == ("gloo puts 2(N-1)/N on the wire", "1.5", "agrees",
                                                                  "0123456")
    assert "MFU 0.412" in by_day["day5_fsdp"][0].value
    assert any(r.what == "int8_gemm dlo int8 + rescale 8x8x8" and r.value == "0.399 ms" and r.commit == "0123456"
               for r in by_day["day8_quantization_pruning"])  # the session's bench step
    (late,) = by_day["day6_pipeline"]
    assert late.verdict == "timeout" and late.value == "over its 120 s budget"
    # the CPU dry run and files of other names are no GPU run
    assert not any("dry run" in r.what for r in rows)
    # a days log: every claims row of the day's section, agreeing or not
    day2 = [r for r in by_day["day2_mixed_precision"] if r.file.endswith("days-2-full.txt")]
    assert [(r.value, r.verdict) for r in day2] == [("2.93 [2.9, 2.95]", "agrees"), ("0.186", "disagrees"),
                                                    ("done", "printed")]  # and the log's other output
    assert day2[-1].what == "Day 2, cell 51"
    # GPU tests: the summary on every kernel day, a failure on its kernel's day
    assert [r.value for r in by_day["day1_optimizers"] if "GPU tests" in r.what] == ["1 failed, 5 passed"]
    assert any(r.what.startswith("FAILED tests/kernels/test_quantize.py") and r.verdict == "disagrees"
               for r in by_day["day8_quantization_pruning"])


def test_the_table_shows_every_row_of_the_day_file_by_file(tmp_path):
    folder = _write(tmp_path / "results")
    table = gpu_table("day2_mixed_precision", folder)
    assert table.splitlines()[0].startswith("day2_mixed_precision: every GPU measurement")
    assert "2026-12-01T1300_nvidia-h200_days-2-full.txt: nvidia-h200, 2026-12-01 13:00 UTC, commit -" in table
    line = next(x for x in table.splitlines() if x.startswith("30% memory reduction"))
    assert "0.186" in line and line.rstrip().endswith("disagrees")
    assert "\nDay 2, cell 51, printed by the same run:\ndone" in table
    assert gpu_table("day2_mixed_precision", folder) == table  # deterministic
    assert gpu_table("day7_tensor_parallel", folder) == "no GPU measurement of day7_tensor_parallel in " \
                                                        f"{tmp_path.name}/results/ yet"


def test_without_a_results_folder_it_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_BENCH_RESULTS", str(tmp_path / "absent"))
    assert results_dir() == tmp_path / "absent"
    out = gpu_table("day2_mixed_precision")
    assert len(out.splitlines()) == 1 and out.startswith("no bench/results folder here")
    assert gpu_rows("day2_mixed_precision") == []


def test_the_checkout_finds_its_own_results_folder(monkeypatch):
    monkeypatch.delenv("DLO_BENCH_RESULTS", raising=False)
    assert results_dir() == RESULTS


def _imports(day: str) -> str:
    """The source a day runs: its solutions notebook's code cells and its experiments modules."""
    nb = json.loads((ROOT / "solutions" / day / f"{day}.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    number = day.split("_")[0]
    return code + "".join(p.read_text() for p in (ROOT / "lib" / "dlo" / "experiments").glob(f"{number}*.py"))


def _uses(source: str, module: str) -> bool:
    return bool(re.search(rf"dlo\.(kernels\.)?{module}\b|from dlo(\.kernels)? import [\w, ()]*\b{module}\b", source))


def test_each_kernel_and_module_belongs_to_the_day_whose_notebook_uses_it():
    from dlo.bench import registry
    from dlo.registry import DAYS

    sources = {day: _imports(day) for day in DAYS}
    for module, day in {**KERNEL_DAYS, **MODULE_DAYS}.items():
        assert [d for d, src in sources.items() if _uses(src, module)] == [day], module
    assert set(registry()) <= set(KERNEL_DAYS) | set(NO_DAY_YET)  # every op dlo bench times has its day
    assert not set(NO_DAY_YET) & set(KERNEL_DAYS) and not any(d.split()[0] in DAYS for d in NO_DAY_YET.values())
    assert kernel_day("sparse24_compress") == "day8_quantization_pruning" and kernel_day("sparse") is None


def test_every_claims_row_of_the_h200_days_2_3_log_is_in_the_day_2_or_day_3_table():
    rows = [r for t in parse_tables(H200_DAYS_2_3.read_text()) for r in t]
    assert len(rows) == 28
    lines = (gpu_table("day2_mixed_precision") + "\n" + gpu_table("day3_checkpointing")).splitlines()
    for r in rows:
        assert any(x.startswith(r["claim"]) and r["measured [95% interval]"] in x and r["verdict"] in x
                   for x in lines), r["claim"]


# ----------------------------------------------------------------------------- the quality bar (issue 34)

def _claim_day(claim: str, sources: dict[str, str]) -> str | None:
    """The day whose own source builds a claim, found without dlo.gpu_results: the one day whose notebook or
    experiments modules hold the claim's opening words (None when no day, or more than one, does)."""
    stem = re.split(r"[({:]|\d+(?:\.\d+)?x\b", claim)[0].strip(" .")[:40]
    hits = [d for d, src in sources.items() if stem and stem in src]
    return hits[0] if len(hits) == 1 else None


def missing_numbers(folder: Path, table) -> list[str]:
    """Every number of the folder's *nvidia* files that a day's claim or kernel concerns, absent from that day's
    table (`table(day) -> str`): claims rows by the day the file says ran them (a `## Day N` section, a
    session step's day), checked against the day whose source builds the claim; kernel timings by the days
    whose notebooks use the kernel."""
    from dlo.registry import DAYS

    sources = {day: _imports(day) for day in DAYS}
    kernel_days = {k: [d for d, src in sources.items() if _uses(src, k)] for k in KERNEL_DAYS}
    names = {d.number: d.name for d in DAYS.values()}
    wanted = []  # (day, words that must share one line of the day's table, a claim's row?)
    for path in sorted(folder.glob("*nvidia*")):
        text = path.read_text()
        if path.suffix == ".txt":
            for head, body in zip(*[iter(re.split(r"^## Day (\d+).*$", text, flags=re.M)[1:])] * 2):
                wanted += [(names[int(head)], r, True) for t in parse_tables(body) for r in t]
            continue
        d = json.loads(text)
        for step in d.get("steps", []):
            nums = step.get("numbers") or {}
            wanted += [(nums.get("day"), r, True) for r in nums.get("claims", [])]
            d.setdefault("rows", []).extend(bench_records(nums) if step["name"] == "bench" else [])
        for r in d.get("rows", []):
            op = str(r.get("op") or r.get("kernel"))
            days = {d for k, ds in kernel_days.items() if op == k or op.startswith(k + "_") for d in ds}
            wanted += [(day, {"claim": op, "verdict": str(r.get("impl", "")),
                              "measured [95% interval]": f"{E.format_number(r['ms'])} ms"}, False)
                       for day in sorted(days)]
    problems = []
    tables = {day: table(day).splitlines() for day in DAYS}
    for day, r, is_claim in wanted:
        own = is_claim and _claim_day(r["claim"], sources)
        if own and day and own != day:
            problems.append(f"{r['claim']!r}: run as {day}, built by {own}")
        words = (r["claim"], r["measured [95% interval]"], r["verdict"])
        if not any(all(w in line for w in words) for line in tables.get(day, [])):
            problems.append(f"{day}: {' | '.join(words)} missing")
    return problems


def test_every_gpu_number_a_day_concerns_is_in_its_table():
    assert missing_numbers(RESULTS, gpu_table) == []


def test_the_quality_bar_reads_sessions_and_bench_files_too(tmp_path):
    folder = _write(tmp_path / "results")
    assert missing_numbers(folder, lambda day: gpu_table(day, folder)) == []
    problems = missing_numbers(folder, lambda day: gpu_table(day, folder).replace("1.5 ", "1.6 "))
    assert problems == ["day4_ddp: gloo puts 2(N-1)/N on the wire | 1.5 | agrees missing"]
    assert "day8_quantization_pruning: int8_gemm | 0.399 ms | dlo int8 + rescale missing" in missing_numbers(
        folder, lambda day: gpu_table(day, folder).replace("0.399 ms", "0.4 ms"))


def test_the_quality_bar_fails_on_a_table_that_quotes_a_subset(tmp_path):
    """Day 2's text quoted compile 3.3x and SDPA 2.93x from the H200 log and left out the 30%-memory claim at
    0.186 (disagrees): a table that keeps only the agreeing rows, or drops a kernel's timings, is caught."""
    def agreeing_only(day):
        return "\n".join(x for x in gpu_table(day).splitlines() if "disagrees" not in x)

    problems = missing_numbers(RESULTS, agreeing_only)
    assert "day2_mixed_precision: 30% memory reduction (20.6 -> 14.6 GB) | 0.186 | disagrees missing" in problems

    def no_kernels(day):
        return "\n".join(x for x in gpu_table(day).splitlines() if "fused_adamw" not in x)

    assert any(p.startswith("day1_optimizers: fused_adamw |") for p in missing_numbers(RESULTS, no_kernels))


@pytest.mark.parametrize("day", ["day2_mixed_precision", "day3_checkpointing"])
def test_the_selectively_reported_h200_rows_are_in_the_table(day):
    """Issue 34: the rows Day 2's and Day 3's text left out of the same log."""
    table = gpu_table(day)
    left_out = {"day2_mixed_precision": ["0.186", "3.94 [3.84, 3.95]", "0.57", "0.174 [0.174, 0.175]",
                                         "MFU = 17.4%", "136 [135, 136]",  # the TF32 baseline of the 2x row
                                         "fp16               3     0.115         nan"],  # fp16 without a scaler
                "day3_checkpointing": ["0.414 [0.41, 0.419]", "20517", "5743"]}[day]  # the 72% fall
    for value in left_out:
        assert value in table, value


def test_an_unknown_day_is_refused_in_one_line(capsys):
    from dlo.gpu_results import main

    with pytest.raises(ValueError, match="no day 'day2': one of day1_optimizers, "):
        gpu_table("day2")
    assert main(["day9_nothing"]) == 2 and capsys.readouterr().err.startswith("dlo.gpu_results: no day 'day9_nothing'")
    assert main(["day3_checkpointing"]) == 0 and "0.414 [0.41, 0.419]" in capsys.readouterr().out


def test_day10_session_step_gives_its_rows_to_day10(tmp_path):
    """bench/gpu_steps.py day10_cp: every rank's ring check (passing or not), torch's context_parallel as it
    ran, and the MoE step against the dense one, in Day 10's table."""
    folder = tmp_path / "results"
    folder.mkdir()
    ring = [{"world": 1, "backend": "nccl", "T": 8192, "ring_max_err": 2e-6, "ring_step_ms": 3.5,
             "torch_cp_max_err": {"zig-zag": 0.004}},
            {"world": 1, "backend": "nccl", "T": 8192, "ring_max_err": 0.5, "ring_step_ms": 3.6,
             "torch_cp_error": "NotImplementedError: x"}]
    moe = {"moe": {"median_ms": 6.0}, "dense, same active": {"median_ms": 2.0}, "ratio": 3.0}
    session = {"session": {"device": "NVIDIA H200", "commit": "0123456789abcdef"}, "steps": [
        {"name": "day10_cp", "status": "failed", "numbers": {"day": "day10_context_experts", "ring": ring,
                                                             "moe_vs_dense": moe}}]}
    (folder / "2026-12-02T1100_nvidia-h200_gpu-session.json").write_text(json.dumps(session))
    rows = [r for r in gpu_rows(folder=folder) if r.day == "day10_context_experts"]
    assert [r.verdict for r in rows if "vs SDPA" in r.what and "torch" not in r.what] == ["passes", "fails"]
    assert any("NotImplementedError" in r.value for r in rows) and any("zig-zag" in r.value for r in rows)
    assert any(r.what.startswith("MoE step") and r.value.startswith("3 (6 / 2 ms)") for r in rows)
