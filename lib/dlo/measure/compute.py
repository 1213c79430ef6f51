"""FLOPs, MFU against the device's peak, and the one byte formatter (part of `dlo.measure`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# ----------------------------------------------------------------------------- compute

def count_flops(fn: Callable[[], object]) -> int:
    """Floating-point operations of one call of `fn` (forward and, if fn runs it, backward), as
    torch's FlopCounterMode counts them (matmuls, convolutions, attention; 2 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int, *,
                                training: bool = True) -> float:
    """Model FLOPs per token: 6 N + 12 l h s for training (2 N + 4 l h s forward only).

    N counts the parameters a token multiplies through: every matmul weight, the LM head included;
    leave out embeddings that are only looked up (a tied embedding is counted once, as the head).
    6 N is Kaplan et al. 2020, Sec. 2.1; the attention term, QK^T and AV over a context of s with no
    causal halving, is PaLM's (Chowdhery et al. 2022, appendix B). Kaplan et al. count half of it
    (2 l s d per forward token, eq. 2.2: 6 l h s in training).
    """
    per = 6 if training else 2
    return per * n_params + per * 2 * n_layers * d_model * seq_len


def mfu(flops: float, seconds: float, device=None, dtype: str = "bf16") -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's dense peak for `dtype`
    ("bf16", "fp16", "tf32", "fp32"); None where the peak is unknown (CPU, unlisted GPU)."""
    from dlo.hardware import peak

    p = peak(device) if (device is None or torch.device(device).type == "cuda") else None
    if p is None or seconds <= 0:
        return None
    tflops = p.get(f"{dtype}_tflops")
    return None if not tflops else flops / seconds / (tflops * 1e12)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is sized)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 999.5 else f"{n:.3g} {unit}"  # not "1e+03 MiB"
        n /= 1024
    return f"{n} B"
