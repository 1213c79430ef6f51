"""Activation memory of one transformer layer, term by term (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4.1, eq. 1 and Table 2).

Without parallelism, with 16-bit activations and 1-byte dropout masks, a layer keeps

    s b h (34 + 5 a s / h) bytes        (s sequence, b batch, h width, a heads)

for backward, 34 s b h without the attention's 5 a s^2 b terms under selective recomputation. The
34 and the 5 are sums of the terms in `TERMS` (the inputs of every matmul, the softmax and GELU inputs
or outputs, the dropout masks, the LayerNorm inputs); `layer_terms` applies the same accounting to a
block that differs from theirs: other element sizes (fp32 doubles every activation term), masks of
another size, no dropout (no masks, and the dropout after the softmax is no separate tensor), or no
dropout after the attention's output projection (our `dlo.models.transformer.Block`). The paper
ignores small buffers; `small_terms` counts those our block keeps (LayerNorm's mean and 1/std, the
causal mask built in each attention call), so that model and `dlo.measure.SavedTensorMeter` can be
compared byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Term:
    """One saved tensor of the paper's accounting: `coef` elements per s b h ("sbh") or per a s^2 b
    ("as2b"); `kind` "activation" or "mask"; `needs` "" (always), "dropout" or "output dropout"
    (the dropout after the attention's output projection); `selective`: recomputed by selective
    recomputation (not saved then)."""

    name: str
    coef: int
    per: str
    kind: str = "activation"
    needs: str = ""
    selective: bool = False


TERMS = (  # Korthikanti et al. 2022 §4.1: attention 11 sbh + 5 as^2b, MLP 19 sbh, LayerNorms 4 sbh (16-bit)
    Term("LayerNorm 1 input", 1, "sbh"),
    Term("QKV projection input", 1, "sbh"),
    Term("Q and K (Q K^T)", 2, "sbh"),
    Term("V (attention over values)", 1, "sbh"),
    Term("softmax output", 1, "as2b", selective=True),
    Term("softmax dropout mask", 1, "as2b", "mask", "dropout", selective=True),
    Term("softmax dropout output (attention over values)", 1, "as2b", needs="dropout", selective=True),
    Term("output projection input", 1, "sbh"),
    Term("attention output dropout mask", 1, "sbh", "mask", "output dropout"),
    Term("LayerNorm 2 input", 1, "sbh"),
    Term("MLP fc1 input", 1, "sbh"),
    Term("GELU input", 4, "sbh"),
    Term("MLP fc2 input (GELU output)", 4, "sbh"),
    Term("MLP dropout mask", 1, "sbh", "mask", "dropout"),
)


def _check(**sizes) -> None:
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"activation memory: sizes must be integers >= 1, got {bad}")


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, selective: bool = False) -> int:
    """The paper's closed form: s b h (34 + 5 a s / h) bytes per layer (eq. 1), 34 s b h with
    selective recomputation (16-bit activations, 1-byte dropout masks, no parallelism)."""
    _check(s=s, b=b, h=h, a=a)
    return 34 * s * b * h + (0 if selective else 5 * a * s * s * b)


def layer_terms(s: int, b: int, h: int, a: int, *, act_bytes: int = 2, mask_bytes: int = 1, dropout: bool = True,
                output_dropout: bool = True, selective: bool = False) -> dict[str, int]:
    """Bytes per saved tensor of one layer, the paper's terms for a block with activations of
    `act_bytes` bytes, dropout masks of `mask_bytes`, dropout or not (`output_dropout`: after the
    attention's output projection too), selective recomputation or not. The defaults are the paper's:
    their sum is `korthikanti_layer_bytes`."""
    _check(s=s, b=b, h=h, a=a, act_bytes=act_bytes, mask_bytes=mask_bytes)
    size = {"sbh": s * b * h, "as2b": a * s * s * b}
    have = {"": True, "dropout": dropout, "output dropout": dropout and output_dropout}
    return {t.name: t.coef * size[t.per] * (mask_bytes if t.kind == "mask" else act_bytes)
            for t in TERMS if have[t.needs] and not (selective and t.selective)}


def small_terms(s: int, b: int, *, stat_bytes: int = 4, causal_mask: bool = True) -> dict[str, int]:
    """What our block keeps besides the paper's terms: the mean and 1/std of its two LayerNorms
    (s b values each, `stat_bytes` each) and the (s, s) boolean causal mask of its attention
    (`causal_mask`: not under selective recomputation, which rebuilds it)."""
    _check(s=s, b=b, stat_bytes=stat_bytes)
    out = {"LayerNorm mean and 1/std (x2)": 2 * 2 * s * b * stat_bytes}
    if causal_mask:
        out["causal mask (bool, s x s)"] = s * s
    return out


def dropout_mask_bytes(device, dtype: torch.dtype) -> int:
    """Bytes per element of the mask dropout saves: 1 on CUDA (ATen's fused native_dropout keeps a
    bool mask), the activation's element size elsewhere (ATen's CPU path multiplies the input by a
    noise tensor of the input's dtype and saves that)."""
    return 1 if torch.device(device).type == "cuda" else torch.empty((), dtype=dtype).element_size()


def layernorm_stat_bytes(device, dtype: torch.dtype) -> int:
    """Bytes per saved LayerNorm mean or 1/std: the input's element size on a CPU (measured: bf16 inputs
    keep bf16 statistics); fp32 on CUDA, ATen's accumulate type for 16-bit inputs (read from its source,
    not yet checked on a GPU by the tests)."""
    return 4 if torch.device(device).type == "cuda" else torch.empty((), dtype=dtype).element_size()
