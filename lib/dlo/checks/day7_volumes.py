"""Day 7's exercise 7b: what a pipeline's stage boundary carries, and DDP's smallest bucket, both derived
by the student (the text gives the mechanisms, not the formulas). Numbers only for the student; the grader
also measures.

- `pp_p2p_bytes` is held first to what Day 6's 1F1B engine (`dlo.distributed.pipeline.one_f_one_b_step`)
  sends as the middle stage of three (float32), per micro-batch, counted by `dlo.measure.CommCounter` on a
  fake process group (`dlo.plan.fake_world`, every message returns at once, bytes exact). Then to the
  reference (`dlo.comm_compute`, off limits while the student's code runs) to 1e-9 on seeded odd sizes,
  degrees and dtypes (`case_seed`: secret under the grader). (TP's bytes per layer, section 4's equation 5,
  are the text's, not an exercise: `tp_measured` holds Day 7's GPT layer to them for exercise 7's check.)
  A mismatch names the usual slip when a wrong formula gives the student's number exactly (one
  direction only, the ring factor left out, the stage's 1/t forgotten, ...).
- `ddp_bucket_bytes` is held to its definition, like exercise 7's token count: the latency term of
  the ring all-reduce of the returned n (Day 4's alpha-beta model) is at most the share f of its time,
  that of n - 1 more, to a relative 1e-12 (`dlo.comm_compute.WHOLE_RTOL`: a bound that is a whole number
  of bytes is that number, whatever the float noise); a latency_share outside (0, 1] raises ValueError.
  `pp_p2p_bytes` is the exact quotient 2 b s h e / t, a float when t does not divide it (rounding is named).
"""

from __future__ import annotations

import math
import numbers
import operator
import random
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dlo.comm_compute import WHOLE_RTOL, pp_p2p_bytes
from dlo.distributed.collectives import allreduce_time
from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_number, expect_value_error, fmt, ok
from dlo.hardware import LINKS, link_bytes_per_s

# and Day 4's alpha-beta model of a ring all-reduce, whose bound a binary search finds without a formula (a red
# team, 2026-12-03: both exercises passed so)
REFERENCE = ("dlo.comm_compute.*", "dlo.distributed.collectives.allreduce_time",
             "dlo.distributed.collectives.bus_factor")
LLAMA_3B_HIDDEN = 3072  # Llama 3.2 3B's hidden size (dlo.models.llama's preset)


def _slip(got: float, wrongs: dict[str, float]) -> str:
    """' (text?)' for the first plausible wrong formula whose value is the student's number."""
    for text, value in wrongs.items():
        if value and abs(got / value - 1) < 1e-9:
            return f" ({text}?)"
    return ""


def whole_number(got, name: str, what: str, where: dict) -> int:
    """`got` as a plain int (a numpy integer too), else AssertionError. Converted through int's own slot: an int
    subclass whose arithmetic answers the check's comparisons (the direct backend hands over the object itself)
    is held as the number it stands for."""
    if not isinstance(got, numbers.Integral) or isinstance(got, bool):
        raise AssertionError(f"{name}: return a whole number of {what} (an int), got {got!r} ({fmt(where)})")
    return int.__index__(operator.index(got))


def _compare(name: str, got, want: float, wrongs: dict[str, float], where: dict) -> None:
    got = assert_number(name, "the bytes", got, where)
    if abs(got - want) > 1e-9 * max(abs(want), 1.0):
        raise AssertionError(f"{name}: got {got:.6g} bytes, expected {want:.6g}{_slip(got, wrongs)} ({fmt(where)})")


def _pp_wrongs(b, s, h, t, e) -> dict[str, float]:
    one_way = b * s * h * e / t
    rounded = "rounded to whole bytes: return the exact quotient, a float when t does not divide the bytes"
    return {"one direction only: backward sends the activation's gradient back across the boundary": one_way,
            "not divided by t: each of the stage's t ranks sends its 1/t (Megatron's scatter/gather)": 2 * one_way * t,
            "the b s h elements not multiplied by the bytes per element": 2 * b * s * h / t,
            rounded: math.floor(2 * one_way), rounded + " (rounded up)": math.ceil(2 * one_way)}


# ----------------------------------------------------------------------------- measured on the days' engines

def tp_measured(t: int, b: int, s: int, heads: int, head_dim: int) -> dict:
    """Bytes a rank of Day 7's GPT layer (bf16) sends per layer on a fake group of t: forward + backward
    ("bytes"), forward alone ("fwd"; exercise 7's all-reduces, `dlo.checks.day7_scale`), and its hidden size."""
    from dlo.experiments.day7 import measure_layers
    from dlo.plan import fake_world

    P = SimpleNamespace(gpt_dim=heads * head_dim, gpt_heads=heads, dropout=0.0, gpt_layers=2, gpt_batch=b, gpt_seq=s)
    with fake_world(t):
        r = measure_layers(P, None, "tp", "cpu")
    return {"bytes": r["sent fwd/layer"] + r["sent bwd/layer"], "fwd": r["sent fwd/layer"], "h": P.gpt_dim}


def _pp_measured(b: int, s: int, h: int, heads: int, m: int) -> float:
    """Bytes the middle stage of three sends per micro-batch in one 1F1B step of Day 6's engine (float32)."""
    from dlo.distributed.pipeline import build_stages, make_stage_modules, one_f_one_b_step
    from dlo.measure import CommCounter
    from dlo.models.transformer import Block
    from dlo.plan import fake_world

    torch.manual_seed(0)
    modules = make_stage_modules([Block(h, heads, 0.0) for _ in range(3)], [0, 1, 2, 3])
    with fake_world(3, rank=1):
        (stage,) = build_stages(modules, 3, [b] * m, (s, h), rank=1)
        with CommCounter() as comm:
            one_f_one_b_step(stage, None, None, None)
    return comm.sent() / m


def _against_the_engines(pp_fn, rng: random.Random, seed: int) -> int:
    """The student's bytes beside what Day 6's engine sends; the number of measurements (0 under torchrun)."""
    b, s, heads = rng.choice([1, 3]), rng.choice([5, 7]), 6  # drawn first: the same cases after, measured or not
    if dist.is_initialized():  # a process group exists: no fake one in this process
        return 0
    h = heads * 3
    want, where = _pp_measured(b, s, h, heads, 2), dict(b=b, s=s, h=h, t=1, act_bytes=4, seed=seed)
    got = assert_number("pp_p2p_bytes", "the bytes", pp_fn(b, s, h, t=1, act_bytes=4), where)
    if abs(got - want) > 1e-9 * want:
        raise AssertionError(f"pp_p2p_bytes: Day 6's 1F1B middle stage sends {want:.6g} bytes per micro-batch "
                             f"(CommCounter, float32), you say {got:.6g}{_slip(got, _pp_wrongs(b, s, h, 1, 4))} "
                             f"({fmt(where)})")
    return 1


# ----------------------------------------------------------------------------- seeded cases

def _cases(rng: random.Random, trials: int) -> list[dict]:
    """Llama 3.2 3B at t = 8, a t that does not divide the bytes, then random sizes, degrees and dtypes."""
    out = [dict(b=1, s=4096, h=LLAMA_3B_HIDDEN, t=8, e=2), dict(b=1, s=7, h=1000, t=3, e=1)]  # 14,000 / 3 bytes
    for _ in range(trials):
        out.append(dict(b=rng.choice([1, 3, 5]), s=rng.choice([7, 513, 4095]), h=rng.choice([96, 1000, 3072, 5120]),
                        t=rng.choice([1, 2, 3, 4, 8]), e=rng.choice([1, 2, 4])))
    return out


def _bucket_cases(rng: random.Random, trials: int) -> list[dict]:
    """Every GPU and link of the table at N = 8 and 64, alpha = 5 us, then random ones."""
    out = [dict(N=N, alpha=5e-6, B=link_bytes_per_s(gpu, link), f=0.1, case=f"{gpu}, {link}")
           for gpu, links in LINKS.items() for link in links for N in (8, 64)]
    for _ in range(trials):
        out.append(dict(N=rng.choice([1, 2, 3, 7, 64, 100]), alpha=rng.choice([0.0, 1e-6, 5e-6, 2.3e-5]),
                        B=rng.uniform(10e9, 900e9), f=rng.choice([0.05, 0.1, 0.25, 0.5, 1.0]), case="random"))
    return out


def _check_bucket(fn, c: dict, seed: int) -> None:
    where = {k: c[k] for k in ("N", "alpha", "B", "f", "case")} | {"seed": seed}
    got = whole_number(fn(c["N"], c["alpha"], c["B"], latency_share=c["f"]), "ddp_bucket_bytes", "bytes", where)
    if got < 0:
        raise AssertionError(f"ddp_bucket_bytes: return a whole number of bytes (an int >= 0), got {got!r} "
                             f"({fmt(where)})")
    latency = 2 * (c["N"] - 1) * c["alpha"]

    def share(n: int) -> float:
        return latency / allreduce_time(n, c["N"], c["alpha"], 1 / c["B"]) if latency else 0.0

    def within(n: int) -> bool:
        """latency <= f x (latency + bandwidth term), as (1 - f) latency <= f bandwidth, to WHOLE_RTOL."""
        bandwidth = allreduce_time(n, c["N"], 0.0, 1 / c["B"])  # alpha = 0: the bandwidth term alone
        return (1 - c["f"]) * latency * (1 - WHOLE_RTOL) <= c["f"] * bandwidth

    if not within(got):
        raise AssertionError(f"ddp_bucket_bytes: a bucket of {got:,} bytes spends {share(got):.9g} of its all-reduce "
                             f"on latency, more than {c['f']}{_bucket_slip(got, c)} ({fmt(where)})")
    if got > 0 and within(got - 1):
        raise AssertionError(f"ddp_bucket_bytes: {got:,} bytes is not the smallest: {got - 1:,} spends "
                             f"{share(got - 1):.9g} on latency, within {c['f']} (to a relative 1e-12: a bound that "
                             f"is a whole number is that number){_bucket_slip(got, c)} ({fmt(where)})")


def _check_bucket_refuses(fn, seed: int) -> None:
    """latency_share outside (0, 1] is refused: at f = 0 no bucket is large enough (the latency 2(N-1) alpha
    never becomes 0% of the time), and a share above 1 is no share."""
    for f in (0.0, 1.5):
        where = dict(N=8, alpha=5e-6, B=450e9, f=f, seed=seed)
        expect_value_error("ddp_bucket_bytes", lambda f=f: fn(8, 5e-6, 450e9, latency_share=f),
                           f"latency_share={f} is outside (0, 1]: no bucket spends that share on latency "
                           f"({fmt(where)})")


def _bucket_slip(got: int, c: dict) -> str:
    """The usual slip, when the student's bytes are a wrong closed form's (to the byte)."""
    N, x, f = c["N"], c["alpha"] * c["B"], c["f"]
    wrongs = {"N left out: the ring's latency 2(N-1) alpha grows with N, its bandwidth term 2(N-1)/N n beta does "
              "not": x * (1 - f) / f,
              "latency at most f of the bandwidth term, not of the whole time": N * x / f,
              "N - 1 in place of N: the bandwidth term is 2(N-1)/N n beta": (N - 1) * x * (1 - f) / f}
    return next((f" ({text}?)" for text, n in wrongs.items() if abs(got - n) <= 1), "")


@check(forbid=REFERENCE)
def check_pp_bucket(pp_p2p_bytes_fn, ddp_bucket_bytes_fn, seed: int = 0, trials: int = 12) -> None:
    """`pp_p2p_bytes_fn(batch, seq, hidden, t=1, act_bytes=2)` and `ddp_bucket_bytes_fn(world_size, alpha,
    link_bytes_per_s, latency_share=0.1)` as in `dlo.comm_compute` (module docstrings)."""
    rng = random.Random(case_seed(seed))  # secret under the grader: the cases cannot be looked up
    measured = _against_the_engines(pp_p2p_bytes_fn, rng, seed)
    cases = _cases(rng, trials)
    for c in cases:
        b, s, h, t, e = (c[k] for k in ("b", "s", "h", "t", "e"))
        _compare("pp_p2p_bytes", pp_p2p_bytes_fn(b, s, h, t=t, act_bytes=e), pp_p2p_bytes(b, s, h, t, e),
                 _pp_wrongs(b, s, h, t, e), c | {"seed": seed})
    buckets = _bucket_cases(rng, trials)
    for c in buckets:
        _check_bucket(ddp_bucket_bytes_fn, c, seed)
    _check_bucket_refuses(ddp_bucket_bytes_fn, seed)
    ok("pp_bucket", f"{measured} byte count of Day 6's engine, {len(cases)} boundary and {len(buckets)} bucket "
                    f"cases, seed={seed}")


__all__ = ["check_pp_bucket", "whole_number"]
