"""`dlo bench` on a machine without CUDA, the table helpers, and the device-peak table."""

import json

import pytest
import torch

from dlo import bench, hardware
from dlo.errors import BadInput


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_main_without_gpu_returns_2(capsys, tmp_path):
    assert bench.main(["fused_adamw"], out_dir=tmp_path) == 2
    assert "dlo bench needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_unknown_op_lists_the_known_ones(capsys):
    assert "fused_adamw" in bench.registry()
    with pytest.raises(BadInput) as exc:  # `dlo bench`: exit status 2, the message on stderr
        bench.main(["fused_adamw", "flash_attention_v9"])
    err = str(exc.value)
    assert "flash_attention_v9" in err and "available: " in err and "fused_adamw" in err.split("available: ")[1]


def test_ratios_and_table():
    rows = [{"op": "x", "impl": "torch a", "size": 10, "ms": 2.0, "GB/s": 50.0, "% peak": None},
            {"op": "x", "impl": "torch b", "size": 10, "ms": 4.0, "GB/s": 25.0, "% peak": None},
            {"op": "x", "impl": "dlo triton", "size": 10, "ms": 0.5, "GB/s": 1234.5, "% peak": 25.7, "note": "hi"}]
    bench.add_ratios(rows)
    assert [r["x best torch"] for r in rows] == [1.0, 0.5, 4.0]  # against the faster baseline, 2 ms
    lines = bench.format_table(rows).splitlines()
    assert lines[0].split() == ["op", "impl", "size", "ms", "GB/s", "%", "peak", "x", "best", "torch", "note"]
    assert set(lines[1]) == {"-", " "} and len(lines) == 5
    assert lines[4].split()[1:3] == ["dlo", "triton"] and "1234" in lines[4] and "-" in lines[2].split()
    # numbers are right-aligned: the ms column ends at the same offset on every line
    ends = {line.index(cell) + len(cell) for line, cell in zip(lines[2:], ["2", "4", "0.5"])}
    assert len(ends) == 1


def test_write_json(tmp_path):
    path = bench._write_json([{"impl": "torch a", "ms": 1.0}], tmp_path / "results")
    record = json.loads(path.read_text())
    hhmm = record["time"][:5].replace(":", "")  # runs of one day get their own files
    assert path.name == f"{record['date']}T{hhmm}_{bench._slug(record['device'])}.json"
    assert record["rows"] == [{"impl": "torch a", "ms": 1.0}] and record["torch"] == torch.__version__
    assert bench._slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.parametrize("name, label, gbs", [
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1555), ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1555),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 2039), ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1935),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3350), ("NVIDIA H100 PCIe", "H100 PCIe", 2000),
    ("NVIDIA H200", "H200 SXM", 4800), ("Tesla V100-SXM2-16GB", "V100", 900), ("NVIDIA L40S", "L40S", 864),
    ("NVIDIA B200", "B200", 7700), ("NVIDIA GB200", "GB200", 8000)])
def test_peak_lookup(name, label, gbs):
    peak = hardware.peak_for_name(name)
    assert (peak["name"], peak["hbm_gbs"]) == (label, gbs)


def test_peak_figures_and_unknowns():
    h100, h200 = hardware.peak_for_name("NVIDIA H100 80GB HBM3"), hardware.peak_for_name("NVIDIA H200")
    assert (h100["fp32_tflops"], h100["tf32_tflops"], h100["bf16_tflops"], h100["int8_tops"]) == (67, 494, 989, 1979)
    assert {k: v for k, v in h200.items() if k.endswith(("tflops", "tops"))} == \
        {k: v for k, v in h100.items() if k.endswith(("tflops", "tops"))}
    assert hardware.peak_for_name("Tesla V100-PCIE-32GB")["bf16_tflops"] is None
    assert hardware.peak_for_name("NVIDIA GeForce GTX 1080") is None
    assert hardware.peak("cpu") is None and hardware.device_name("cpu") == "cpu"


def test_main_on_a_pretend_gpu(monkeypatch, tmp_path, capsys):
    """The GPU path of main with a stub op: table printed, JSON written, ratios added."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(bench, "registry", lambda: {"stub": lambda: [{"impl": "torch x", "ms": 3.0},
                                                                     {"impl": "dlo y", "ms": 1.0}]})
    assert bench.main([], out_dir=tmp_path) == 0
    (path,) = tmp_path.iterdir()
    record = json.loads(path.read_text())
    assert path.name.endswith("_nvidia-h200.json") and record["peak"]["hbm_gbs"] == 4800
    assert [(r["op"], r["impl"], r["x best torch"]) for r in record["rows"]] == [("stub", "torch x", 1.0),
                                                                                ("stub", "dlo y", 3.0)]
    assert "dlo y" in capsys.readouterr().out


def test_matmul_rows_are_grouped_by_size(monkeypatch):
    """Rows of two shapes: speed-up against each shape's own bf16 row, never across shapes."""
    import triton.testing

    from dlo.kernels.runtime import bench_matmuls

    times = {"small bf16": 1.0, "small int8": 0.5, "big bf16": 8.0, "big int8": 2.0}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: times[fn()])
    rows = []
    for tag, (M, K, N) in (("small", (2, 3, 5)), ("big", (20, 30, 50))):
        rows += bench_matmuls("mm", M, K, N, {"torch bf16": (lambda t=tag: f"{t} bf16", "bf16_tflops", 2 * M * K),
                                              "dlo int8": (lambda t=tag: f"{t} int8", "int8_tops", None)},
                              peaks={"name": "H100 SXM", "bf16_tflops": 100.0})
    bench.add_ratios(rows)
    assert [r["size"] for r in rows] == ["2x3x5", "2x3x5", "20x30x50", "20x30x50"]
    assert [r["speed-up"] for r in rows] == [1.0, 2.0, 1.0, 4.0]
    assert [r["x best torch"] for r in rows] == [1.0, 2.0, 1.0, 4.0]
    assert rows[0]["TFLOP/s"] == pytest.approx(2 * 2 * 3 * 5 / 1e-3 / 1e12)
    assert rows[0]["% peak"] == pytest.approx(100 * rows[0]["TFLOP/s"] / 100.0) and rows[1]["% peak"] is None
    # the roofline of the bytes given (2 M K) and the dense flops, on the H100 SXM's datasheet figures
    assert rows[0]["roofline ms"] == hardware.roofline(2 * 2 * 3, 2 * 2 * 3 * 5, "bf16_tflops", "H100 SXM")[0]
    assert rows[0]["% roofline"] == pytest.approx(100 * rows[0]["roofline ms"] / 1.0)
    assert "roofline ms" not in rows[1] and not any("work" in r for r in rows)  # no bytes given: none


def _case(name):
    from dlo.kernels import aot
    return next(c for c in aot.all_cases() if c.name == name)


def test_roofline_of_the_int8_gemm_by_hand():
    # Llama 3.2 3B up-projection, M=4096 K=3072 N=8192, bf16 out: a, b int8, fp32 scales, c bf16.
    case = _case("_int8_gemm_kernel[bfloat16 128x128x64]")
    moved = 4096 * 3072 + 8192 * 3072 + 4 * (4096 + 8192) + 2 * 4096 * 8192
    flops = 2 * 4096 * 8192 * 3072
    assert (case.bytes, case.flops) == (moved, flops)
    # H100 SXM: 3350 GB/s, 1979 int8 TOP/s -> 31.3 us of traffic, 104.2 us of math: compute-bound.
    ms, bound = bench.roofline_ms(case, "H100 SXM")
    assert bound == "compute" and ms == pytest.approx(flops / 1979e12 * 1e3)
    assert bench.roofline_ms(case, "A100 80GB SXM")[0] == pytest.approx(flops / 624e12 * 1e3)


def test_roofline_of_fused_adamw_by_hand():
    # fp32 params: read p, g, m, v and write p, m, v = 28 bytes per parameter, ~10 flops: memory-bound.
    case = _case("_fused_adamw_kernel[float32 aligned]")
    ms, bound = bench.roofline_ms(case, "H200 SXM")
    assert bound == "memory" and ms == pytest.approx(28 * 3_212_749_824 / 4800e9 * 1e3)
    with pytest.raises(ValueError, match="not a dlo.hardware.PEAKS label"):
        bench.roofline_ms(case, "H100")


def test_compile_report_rows():
    case = _case("_int8_gemm_kernel[bfloat16 128x128x64]")
    res = dict(regs=186, spill_stores=0, smem=49152, tensor_core="wgmma", occupancy=0.125)
    rows = bench.compile_report_rows({(case.name, 90): res, (case.name, 80): {"error": "boom"}}, [case])
    assert [(r["target"], r["device"]) for r in rows] == [("sm_80", "A100 80GB SXM"), ("sm_90", "H100 SXM"),
                                                          ("sm_90", "H200 SXM")]
    assert rows[0]["error"] == "boom" and rows[1]["smem KiB"] == 48 and rows[1]["occupancy %"] == 12.5
    assert rows[2]["roofline us"] == pytest.approx(bench.roofline_ms(case, "H200 SXM")[0] * 1e3)


def test_expected_ratio_against_torch_by_hand():
    # W4A16 decode, M=16 K=3072 N=8192 G=128 on H100: 4-bit codes + fp32 scales vs torch's bf16 weight.
    case = _case("_weight_only_matmul_kernel[W4A16 bfloat16 16x32x128 M=16]")
    ours = 2 * 16 * 3072 + 8192 * 3072 // 2 + 4 * 8192 * 3072 // 128 + 2 * 16 * 8192
    theirs = 2 * (16 * 3072 + 8192 * 3072 + 16 * 8192)
    assert case.bytes == ours
    res = dict(regs=161, spill_stores=0, smem=45056, tensor_core="mma", occupancy=0.125)
    row = bench.compile_report_rows({(case.name, 90): res}, [case])[0]
    assert row["bound"] == "memory" and row["x torch"] == pytest.approx(theirs / ours)  # ~3.5x


def test_roofline_column_of_a_decode_w8a16_by_hand():
    """`dlo bench`'s roofline column: W8A16 at M=1, K=4096, N=11008, G=128 on an H100 SXM (3350 GB/s)."""
    from dlo.kernels.weight_only_matmul import moved_bytes
    # x: 4096 bf16 = 8192 B; codes: 11008 * 4096 int8 = 45,088,768 B; scales: 11008 * 32 fp32 = 1,409,024 B;
    # y: 11008 bf16 = 22,016 B. Total 46,528,000 B -> 46.528e6 / 3350e9 s = 13.889 us of traffic; the
    # 90.2 MFLOP take 0.09 us at 989 bf16 TFLOP/s: memory-bound.
    moved = moved_bytes(1, 4096, 11008, 8, 128)
    assert moved == 8192 + 45_088_768 + 1_409_024 + 22_016 == 46_528_000
    rows = [{"impl": "dlo W8A16", "ms": 0.02, "work": (moved, 2 * 4096 * 11008, "bf16_tflops")},
            {"impl": "torch bf16", "ms": 0.05}]
    hardware.add_roofline(rows, "H100 SXM")
    assert rows[0]["roofline ms"] == pytest.approx(46.528e6 / 3350e9 * 1e3) == pytest.approx(0.013889, rel=1e-4)
    assert rows[0]["% roofline"] == pytest.approx(100 * 0.013889 / 0.02, rel=1e-4) and "work" not in rows[0]
    assert "roofline ms" not in rows[1]  # no work given: no roofline
    assert "work" not in hardware.add_roofline([{"ms": 1.0, "work": (1, 1, "bf16_tflops")}], None)[0]
