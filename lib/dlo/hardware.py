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
