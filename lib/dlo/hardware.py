"""Peak figures of common NVIDIA GPUs, to turn measured GB/s and TFLOP/s into "% of peak".

Vendor datasheet numbers: HBM bandwidth in GB/s, dense tensor-core (no 2:4 sparsity) throughput in
TFLOP/s (int8 in TOP/s); fp32 is the non-tensor-core rate. None means no such unit (V100 has no
tf32/bf16/int8 tensor cores). A row matches when all its substrings occur in the device name
(case-insensitive); the first match wins, so specific variants come before their family.
"""

from __future__ import annotations

import torch

_KEYS = ("hbm_gbs", "fp32_tflops", "tf32_tflops", "bf16_tflops", "fp16_tflops", "int8_tops")

PEAKS: list[tuple[tuple[str, ...], str, tuple]] = [
    # substrings,          label,            GB/s, fp32,  tf32,  bf16,  fp16,  int8
    # Blackwell: NVIDIA's HGX / GB200 NVL72 platform tables, per GPU; their tensor-core figures are
    # with 2:4 sparsity (HGX B200: 4.5 PFLOPS bf16, 2.2 tf32, 9 POPS int8), halved here to dense.
    (("gb200",), "GB200", (8000, 80.0, 1250.0, 2500.0, 2500.0, 5000.0)),
    (("b200",), "B200", (7700, 75.0, 1100.0, 2250.0, 2250.0, 4500.0)),
    (("h200", "nvl"), "H200 NVL", (4800, 60.0, 418.0, 836.0, 836.0, 1671.0)),
    (("h200",), "H200 SXM", (4800, 67.0, 494.0, 989.0, 989.0, 1979.0)),
    (("h100", "pcie"), "H100 PCIe", (2000, 51.0, 378.0, 756.0, 756.0, 1513.0)),
    (("h100", "nvl"), "H100 NVL", (3900, 60.0, 418.0, 836.0, 836.0, 1671.0)),
    (("h100",), "H100 SXM", (3350, 67.0, 494.0, 989.0, 989.0, 1979.0)),
    (("a100", "80gb", "pcie"), "A100 80GB PCIe", (1935, 19.5, 156.0, 312.0, 312.0, 624.0)),
    (("a100", "80gb"), "A100 80GB SXM", (2039, 19.5, 156.0, 312.0, 312.0, 624.0)),
    (("a100",), "A100 40GB", (1555, 19.5, 156.0, 312.0, 312.0, 624.0)),
    (("l40s",), "L40S", (864, 91.6, 183.0, 362.0, 362.0, 733.0)),
    (("v100",), "V100", (900, 15.7, None, None, 125.0, None)),
]


# Links of one GPU, in GB/s in each direction (what a GPU sends while it receives as much: the beta
# of Day 4's alpha-beta model is 1 / this). NVLink's datasheet figure is both directions summed,
# halved here: A100 SXM 600 GB/s (NVLink 3, 12 links), H100 and H200 SXM 900 GB/s (NVLink 4, 18
# links), through NVSwitch to any GPU of the node. InfiniBand: one adapter per GPU in NVIDIA's DGX
# systems, DGX A100 ConnectX-6 HDR 200 Gb/s (25 GB/s), DGX H100 and DGX H200 ConnectX-7 NDR 400 Gb/s
# (50 GB/s). Sources: the NVIDIA A100, H100 and H200 Tensor Core GPU datasheets; the DGX A100, DGX
# H100/H200 user guides (network ports). Keys are the labels of PEAKS.
LINKS: dict[str, dict[str, float]] = {
    "A100 80GB SXM": {"nvlink": 300.0, "infiniband": 25.0},
    "A100 40GB": {"nvlink": 300.0, "infiniband": 25.0},  # the SXM4 40GB: the same NVLink and DGX network
    "H100 SXM": {"nvlink": 450.0, "infiniband": 50.0},
    "H200 SXM": {"nvlink": 450.0, "infiniband": 50.0},
}


def link_bytes_per_s(gpu: str, link: str) -> float:
    """Bytes per second in each direction of `link` ("nvlink": inside a node, "infiniband": between
    nodes) of `gpu`, a label of LINKS or any name `peak_for_name` matches ("NVIDIA H100 80GB HBM3")."""
    label = gpu if gpu in LINKS else (peak_for_name(gpu) or {}).get("name")
    if label not in LINKS:
        raise ValueError(f"no link figures for {gpu!r}; known: {', '.join(LINKS)}")
    if link not in LINKS[label]:
        raise ValueError(f"{label} has no link {link!r}; one of {', '.join(LINKS[label])}")
    return LINKS[label][link] * 1e9


def device_name(device: torch.device | str | int | None = None) -> str:
    """The CUDA device's name (current device by default), or "cpu"."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_for_name(name: str) -> dict | None:
    """Peaks of the first table row whose substrings all occur in `name`; None if none does."""
    lowered = name.lower()
    for substrings, label, figures in PEAKS:
        if all(s in lowered for s in substrings):
            return {"name": label, **dict(zip(_KEYS, figures))}
    return None


def peak(device: torch.device | str | int | None = None) -> dict | None:
    """Peaks of `device` (default: the current CUDA device); None on CPU or on a GPU not in the table.

    Keys: name, hbm_gbs, fp32_tflops, tf32_tflops, bf16_tflops, fp16_tflops, int8_tops.
    """
    name = device_name(device)
    return None if name == "cpu" else peak_for_name(name)


# Roofline times (Williams et al. 2009) on these peaks: used by the kernels' benchmarks and by `dlo bench`.

def roofline(moved: int, flops: int, rate: str, device: str) -> tuple[float, str]:
    """(ms, "memory" or "compute"): `moved` bytes at the device's peak HBM bandwidth or `flops` at its
    peak rate `rate` ("bf16_tflops", "int8_tops", ...), whichever is longer (Williams et al. 2009);
    `device` is a dlo.hardware.PEAKS label (datasheet figures cited there)."""
    figures = peak_for_name(device)
    if figures is None or figures["name"] != device:
        raise ValueError(f"{device!r} is not a dlo.hardware.PEAKS label")
    memory_ms = moved / (figures["hbm_gbs"] * 1e9) * 1e3
    compute_ms = flops / (figures[rate] * 1e12) * 1e3
    return max(memory_ms, compute_ms), "memory" if memory_ms >= compute_ms else "compute"


def add_roofline(rows: list[dict], device: str | None) -> list[dict]:
    """Replace each row's "work" (bytes, flops, peak) by "roofline ms" on `device` (a PEAKS label; None:
    a GPU not in the table) and "% roofline" = 100 * roofline / measured ms."""
    for r in rows:
        work = r.pop("work", None)
        if work and device:
            r["roofline ms"] = roofline(*work, device)[0]
            r["% roofline"] = 100 * r["roofline ms"] / r["ms"]
    return rows
