"""Day 7's exercise 7 (compute against communication): no ranks needed, numbers only. (Exercise 8, the
layout search, moved to Day 10 with the context and expert degrees: `dlo.checks.day10_layout`.)

`fsdp_min_tokens` is held to its definition rather than to one rounding: the smallest whole T whose
forward matmuls (2 P T / F) cover the ring all-gather to a relative 1e-12 (T >= x (1 - 1e-12), x the real
bound: `dlo.comm_compute.WHOLE_RTOL`), so that a bound that is a whole number (the A100's NVLink at N = 8:
exactly 910) is that number whatever the order of the student's float operations: 911 fails. `tp_comm_ratio`
is compared with the reference (`dlo.comm_compute`, off limits while the student's code runs) to
1e-9. First, both are held to the bytes the days' engines send, counted by `dlo.measure.CommCounter`
on a fake process group (`dlo.plan.fake_world`; alpha = 0, so time = bytes / B): the forward
all-gather of one block of Day 5's FSDP (`dlo.distributed.fsdp.apply_fsdp`, bf16, a small Llama at
N = 2 and 4: two blocks' bytes minus one's) and the forward all-reduces of Day 7's GPT layer at
t = 2 and 3 (`dlo.checks.day7_volumes.tp_measured`). Then the cases: Llama 3.2 3B's layer on the
table's GPUs and links (`dlo.hardware`), then seeded random sizes, world sizes, latencies and
dtypes (`case_seed`: secret under the grader, so a table of the reference's answers made outside the
check fails there). A token count is any whole number (a numpy integer too), held as the plain int it is.
A mismatch names the usual slip when the ratio to the reference gives it away (an all-reduce's 2(N-1)/N
for an all-gather's (N-1)/N, one all-reduce per layer instead of two, FLOPs not split t ways, alpha left out).
"""

from __future__ import annotations

import functools
import random

import torch
import torch.distributed as dist

from dlo.checks.day7_volumes import LLAMA_3B_HIDDEN, tp_measured, whole_number
from dlo.comm_compute import WHOLE_RTOL, allgather_time, tp_comm_ratio
from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_close, assert_number, fmt, ok
from dlo.hardware import LINKS, link_bytes_per_s, peak_for_name

# and Day 4's alpha-beta model of a ring all-reduce, whose bound a binary search finds without a formula (a red
# team, 2026-12-03: both exercises passed so)
REFERENCE = ("dlo.comm_compute.*", "dlo.distributed.collectives.allreduce_time",
             "dlo.distributed.collectives.bus_factor")
LLAMA_3B_LAYER = 100_669_440

# got / want -> the slip it usually is
FSDP_SLIPS = {2.0: "an all-reduce's 2(N-1)/N in place of an all-gather's (N-1)/N, or 1 FLOP per parameter "
                   "and token in place of 2",
              0.5: "4 FLOPs per parameter and token (forward is 2: one multiply-add per weight)"}
TP_SLIPS = {0.5: "one all-reduce per layer: forward has two (after the attention and after the MLP)",
            2.0: "the all-reduce counted as 4(t-1)/t, or the matmuls' FLOPs per token as P in place of 2P"}


def _cases(rng: random.Random, trials: int) -> list[dict]:
    """Llama 3.2 3B's layer on every GPU and link of the table, then random ones."""
    out = []
    for gpu, links in LINKS.items():
        for link in links:
            out.append(dict(P=LLAMA_3B_LAYER, h=LLAMA_3B_HIDDEN, N=8, t=8, T=4096, alpha=0.0, b=2,
                            F=peak_for_name(gpu)["bf16_tflops"] * 1e12, B=link_bytes_per_s(gpu, link),
                            case=f"{gpu}, {link}"))
    for _ in range(trials):
        h = rng.choice([512, 1024, 2048, 3000, 5120])
        out.append(dict(P=rng.choice([10, 12, 13]) * h * h + rng.randrange(h), h=h,
                        N=rng.choice([1, 2, 3, 8, 64, 100]), t=rng.choice([1, 2, 3, 4, 8]),
                        T=rng.choice([1, 7, 512, 4096, 30_000]), alpha=rng.choice([0.0, 2e-6, 1e-5]),
                        b=rng.choice([1, 2, 4]), F=rng.uniform(50e12, 2000e12), B=rng.uniform(10e9, 900e9),
                        case="random"))
    return out


def _slip(ratio: float, slips: dict) -> str:
    for k, text in slips.items():
        if abs(ratio / k - 1) < 1e-6:
            return f" (x{k:g} the reference: {text}?)"
    return ""


def _hold_tokens(got, P: int, F: float, gather: float, where: dict, of: str = "the ring all-gather") -> None:
    """`got` tokens of a layer of P parameters at F FLOP/s hide an all-gather of `gather` seconds, and
    one token less does not (`of`: where those seconds come from)."""
    got = whole_number(got, "fsdp_min_tokens", "tokens", where)
    per_token = 2 * P / F  # seconds of the layer's forward matmuls per token, at peak
    need = gather * (1 - WHOLE_RTOL)  # float noise is not a token
    if got * per_token < need or (got > 0 and (got - 1) * per_token >= need):
        detail = ("too few: the all-gather still takes longer than the layer's forward"
                  if got * per_token < need else "not the fewest: one token less still hides the all-gather "
                  "(to a relative 1e-12: a bound that is a whole number is that number)")
        raise AssertionError(f"fsdp_min_tokens: {got} tokens is {detail}: {of} takes {gather:.4g} s, "
                             f"{got} tokens compute in {got * per_token:.4g} s"
                             f"{_slip(got * per_token / max(gather, 1e-30), FSDP_SLIPS)} ({fmt(where)})")


def _check_fsdp(fn, c: dict, seed: int) -> None:
    where = {k: c[k] for k in ("P", "N", "F", "B", "alpha", "b", "case")} | {"seed": seed}
    got = fn(c["P"], c["N"], c["F"], c["B"], alpha=c["alpha"], param_bytes=c["b"])
    _hold_tokens(got, c["P"], c["F"], allgather_time(c["P"] * c["b"], c["N"], c["alpha"], 1.0 / c["B"]), where)


def _check_tp(fn, c: dict, seed: int) -> None:
    where = {k: c[k] for k in ("P", "h", "t", "T", "F", "B", "alpha", "b", "case")} | {"seed": seed}
    args = (c["P"], c["h"], c["t"], c["T"], c["F"], c["B"])
    got = assert_number("tp_comm_ratio", "the ratio", fn(*args, alpha=c["alpha"], act_bytes=c["b"]), where)
    want = tp_comm_ratio(*args, alpha=c["alpha"], act_bytes=c["b"])
    if want > 0 and abs(got / want - 1) > 1e-9:
        raise AssertionError(f"tp_comm_ratio: got {got:.6g}, expected {want:.6g}{_slip(got / want, TP_SLIPS)} "
                             f"({fmt(where)})")
    assert_close("tp_comm_ratio", "the ratio", got, want, where)  # t = 1: exactly 0


# ----------------------------------------------------------------------------- held to the days' engines

@functools.lru_cache(maxsize=None)
def fsdp_layer_sent(world_size: int) -> tuple[float, int]:
    """(bytes, P): what a rank of Day 5's FSDP (`apply_fsdp`: bf16 all-gathers) sends in one forward for one
    block of a small Llama on a fake group of `world_size` (two blocks' all-gathers minus one's: the root's
    cancel), and that block's parameters. Cached: the counts depend on the world size only."""
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.distributed.fsdp import apply_fsdp
    from dlo.measure import CommCounter
    from dlo.models.llama import Llama, LlamaConfig
    from dlo.plan import fake_world

    sent, x = [], torch.arange(8).view(1, 8)
    for layers in (1, 2):
        cfg = LlamaConfig(vocab_size=64, dim=48, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=96,
                          max_seq_len=16)
        with fake_world(world_size):
            torch.manual_seed(0)
            model = Llama(cfg)
            P = sum(p.numel() for p in model.layers["0"].parameters())
            apply_fsdp(model, init_device_mesh("cpu", (world_size,)))
            model(x).float().mean().backward()  # FSDP2 learns the root and the order on its first step
            with CommCounter() as comm:
                model(x)
        sent.append(comm.sent("all_gather"))
    return sent[1] - sent[0], P


@functools.lru_cache(maxsize=None)
def _tp_forward_sent(t: int, b: int, s: int) -> tuple[float, int]:
    """(bytes, h): Day 7's GPT layer's forward all-reduces per rank (`day7_volumes.tp_measured`), cached."""
    m = tp_measured(t, b, s, 6, 5)
    return m["fwd"], m["h"]


def _against_the_engines(fsdp_fn, tp_fn, seed: int) -> int:
    """The student's functions on the bytes the engines send (alpha = 0: time = bytes / B, on the first
    GPU and link of the table); the number of measurements (0 under torchrun: no fake group there)."""
    if dist.is_initialized():
        return 0
    gpu, link = next((g, next(iter(links))) for g, links in LINKS.items())
    F, B = peak_for_name(gpu)["bf16_tflops"] * 1e12, link_bytes_per_s(gpu, link)
    for N in (2, 4):
        sent, P = fsdp_layer_sent(N)
        where = dict(P=P, N=N, F=F, B=B, alpha=0.0, b=2, case=f"{gpu}, {link}", seed=seed)
        _hold_tokens(fsdp_fn(P, N, F, B, alpha=0.0, param_bytes=2), P, F, sent / B, where,
                     f"the all-gather of the {sent:,.0f} bytes Day 5's FSDP sends per layer (CommCounter, "
                     f"fake group of {N})")
    rng = random.Random(case_seed(seed))
    b, s = rng.choice([1, 3]), rng.choice([5, 7])
    for t in (2, 3):
        fwd, h = _tp_forward_sent(t, b, s)
        T, P = b * s, 12 * h * h  # P: the compute side, the layer's matmuls (not measured here)
        want = (fwd / B) / (2 * P * T / t / F)
        where = dict(P=P, h=h, t=t, T=T, F=F, B=B, alpha=0.0, b=2, seed=seed)
        got = assert_number("tp_comm_ratio", "the ratio", tp_fn(P, h, t, T, F, B, alpha=0.0, act_bytes=2), where)
        if abs(got / want - 1) > 1e-9:
            raise AssertionError(f"tp_comm_ratio: Day 7's GPT layer sends {fwd:,.0f} bytes per rank in its "
                                 f"forward all-reduces (CommCounter, fake group of {t}): a ratio of {want:.6g}, "
                                 f"you say {got:.6g}{_slip(got / want, TP_SLIPS)} ({fmt(where)})")
    return 4


@check(forbid=REFERENCE)
def check_comm_compute(fsdp_min_tokens_fn, tp_comm_ratio_fn, seed: int = 0, trials: int = 12) -> None:
    """`fsdp_min_tokens_fn(layer_params, world_size, peak_flops, link_bytes_per_s, alpha=0.0, param_bytes=2)`
    and `tp_comm_ratio_fn(layer_params, hidden, t, tokens, peak_flops, link_bytes_per_s, alpha=0.0,
    act_bytes=2)` as in `dlo.comm_compute` (module docstring)."""
    measured = _against_the_engines(fsdp_min_tokens_fn, tp_comm_ratio_fn, seed)
    cases = _cases(random.Random(case_seed(seed)), trials)  # secret under the grader: no table of answers
    for c in cases:
        _check_fsdp(fsdp_min_tokens_fn, c, seed)
        _check_tp(tp_comm_ratio_fn, c, seed)
    ok("comm_compute", f"{measured} byte counts of Day 5's FSDP and Day 7's TP layer, {len(cases)} cases: "
                       f"Llama 3.2 3B's layer on {len(LINKS)} GPUs' links and random ones, seed={seed}")


__all__ = ["check_comm_compute"]
