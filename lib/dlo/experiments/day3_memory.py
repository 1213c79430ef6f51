"""Day 3: Korthikanti et al. 2022's activation memory per layer against the saved-tensor meter.

`memory_model_rows` counts what one `Block` of the notebook's stack (its width, heads, dropout and
parameter dtype) saves for backward at a few (s, b) points, without and with selective recomputation,
and puts beside it the paper's closed form (16-bit) and the paper's accounting applied to this block
(`dlo.activation_memory.layer_terms`: its element size, its dropout masks' size on this device, no
dropout after the attention's output projection), with and without the small buffers the paper
leaves out. `memory_model_claims` turns them into rows: counted bytes are exact, so the only
tolerance is the one the paper's simplification needs.
"""

from __future__ import annotations

import torch

from dlo import claims as C
from dlo import estimates as E
from dlo.activation_ckpt import checkpoint
from dlo.activation_memory import (
    dropout_mask_bytes,
    korthikanti_layer_bytes,
    layer_terms,
    layernorm_stat_bytes,
    small_terms,
)
from dlo.measure import saved_bytes
from dlo.models.transformer import Block

KORTHIKANTI = "Korthikanti et al. 2022"
TOL = 0.02  # the paper drops LayerNorm statistics and the causal mask: 16 s b + s^2 bytes, ~0.5% at h = 64


def memory_points(P) -> list[tuple[int, int, bool]]:
    """(s, b, selective) measured: the notebook's (seq_len, batch), half the sequence, half the batch,
    and the notebook's point with selective recomputation."""
    s, b = P.seq_len, P.batch_size
    return [(s, b, False), (max(1, s // 2), b, False), (s, max(1, b // 2), False), (s, b, True)]


def memory_model_rows(P, device, dtype: torch.dtype = torch.float32) -> list[dict]:
    """One row per point of `memory_points`: "counted" (the meter, one block's forward, parameters
    excluded), "ours" (the paper's terms for this block), "ours_small" (+ the small buffers),
    "paper_16bit" (s b h (34 + 5 a s / h), or 34 s b h selective) and the terms themselves."""
    h, a = P.d_model, P.n_heads
    torch.manual_seed(0)
    block = Block(h, a, P.dropout).to(device=device, dtype=dtype).train()
    e = torch.empty((), dtype=dtype).element_size()
    rows = []
    for s, b, selective in memory_points(P):
        x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
        counted = saved_bytes(lambda x=x, sel=selective: block(x, checkpoint if sel else None),
                              exclude=list(block.parameters()), backward=False)["saved_bytes"]
        terms = layer_terms(s, b, h, a, act_bytes=e, mask_bytes=dropout_mask_bytes(device, dtype),
                            dropout=P.dropout > 0, output_dropout=False, selective=selective)
        small = small_terms(s, b, stat_bytes=layernorm_stat_bytes(device, dtype), causal_mask=not selective)
        rows.append({"s": s, "b": b, "policy": "selective" if selective else "none", "counted": counted,
                     "ours": sum(terms.values()), "ours_small": sum(terms.values()) + sum(small.values()),
                     "paper_16bit": korthikanti_layer_bytes(s, b, h, a, selective=selective),
                     "terms": terms, "small": small})
    return rows


def memory_model_claims(rows: list[dict]) -> list[C.Claim]:
    """Per point: the paper's accounting for our block within TOL of the counted bytes; and one row:
    with the small buffers counted too, the model equals the meter to the byte at every point."""
    out = [C.Claim(f"activation bytes of one block, s={r['s']} b={r['b']}, recompute {r['policy']}", KORTHIKANTI,
                   "s b h (34 + 5 a s / h) (16-bit; 34 s b h selective), terms applied to our block",
                   C.approx(r["ours"], rel=TOL, text=f"{r['ours']:,} B +- {TOL:.0%}"),
                   E.exact(r["counted"], "saved-tensor meter, exact")) for r in rows]
    worst = max(abs(r["counted"] - r["ours_small"]) for r in rows)
    out.append(C.Claim("with LayerNorm statistics and the causal mask, the accounting is exact", KORTHIKANTI,
                       "the small buffers are all that the paper leaves out", C.at_most(0.0, "0 bytes off"),
                       E.exact(worst, f"largest |counted - model| over {len(rows)} points, bytes")))
    return out
