"""Autograder check for Day 2's FlashAttention exercise: the forward pass block by block, in PyTorch
(`check_flash_attention`, re-exported by `dlo.checks.day2`, whose name the test cell calls).

The student's `fn(q, k, v, *, causal, block_k) -> (O, L)` runs in a worker (`dlo.grading.api.run_student`)
under a TorchDispatchMode that sees every tensor a torch operator makes: the largest one, and any fused
attention operator, come back with the result. The references are computed here, in float64, from the
same (rounded) inputs: O by torch's scaled_dot_product_attention, L by torch.logsumexp of the scores
written out (`dlo.attention.attention_scores`). What is checked, case by case:

- odd T (1 up to a few hundred), never a multiple of block_k, causal and not, D in {16, 64}, fp32 and
  bf16 inputs; with causal and T > block_k, a row's later key blocks are masked entirely (rowmax -inf):
  a nan there is its own message;
- the point of the algorithm: on cases where T x T outgrows every tensor a block-wise forward needs
  (T > 2 B H max(D, block_k)), no operator may produce a tensor of T * T elements or more (the scores,
  P, a full causal mask), and no fused attention operator may run at all: each is refused at dispatch
  whatever reached it (`FORBID`'s "aten::" patterns, `dlo.grading.ops`), and the watch reports one that
  ran anyway.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dlo.attention import attention_scores
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import assert_close, fmt, ok

# fp32: the student's fp32 sums over <= ~300 keys, in another order than float64's, differ by ~1e-6;
# 1e-5 leaves a margin of 10 while a missing rescale or a shifted mask errs by O(0.1-1).
FP32_TOL = 1e-5
# bf16: the inputs are rounded to bf16 before either side sees them (so that is not an error); O is
# rounded to bf16 once at the end (relative 2^-9) and P may be rounded to bf16 before P V as the
# kernel does (another 2^-9 per term): 1e-2 (atol and rtol; O is a convex mix of |v| <= ~4) is a few
# bf16 ulps. L is fp32 arithmetic on the bf16 values in both dtypes (the exercise computes in fp32):
# FP32_TOL.
BF16_O_TOL = 1e-2
FUSED = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
FORBID = ("torch.nn.functional.scaled_dot_product_attention", "dlo.attention.*",
          "dlo.kernels.flash_attention.flash_attention", "dlo.kernels.flash_attention.flash_attention_ref",
          "dlo.kernels.flash_attention.flash_attention_blocked_ref",
          *(f"aten::{op}*" for op in ("scaled_dot_product", "_scaled_dot_product", "_flash_attention",
                                      "_efficient_attention", "_cudnn_attention")))  # every fused kernel, at dispatch


class _Watch(TorchDispatchMode):
    """Every operator's outputs while active: the largest tensor (elements, and which op made it) and
    the fused attention operators called (SDPA reaches one on every device)."""

    def __init__(self):
        super().__init__()
        self.numel, self.what, self.fused = 0, "", set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if any(f in name for f in FUSED):
            self.fused.add(f"aten.{name}")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel = t.numel()
                self.what = f"aten.{name} made a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
        return out


def _flash_worker(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_k: int) -> dict:
    """The student's forward under `_Watch`: its (O, L) (or what it returned instead, described) and
    what the watch saw."""
    with _Watch() as watch:
        got = fn(q, k, v, causal=causal, block_k=block_k)
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got):
        out = [x.detach() for x in got]
    else:
        kinds = [type(x).__name__ for x in got] if isinstance(got, (tuple, list)) else type(got).__name__
        out = f"a {type(got).__name__} of {kinds}" if isinstance(got, (tuple, list)) else f"a {kinds}"
    return {"out": out, "numel": watch.numel, "what": watch.what, "fused": sorted(watch.fused)}


def _cases(rng: random.Random, trials: int) -> list[dict]:
    """`trials` random cases (T odd and not a multiple of block_k; every other one causal; the last one
    bf16), then the two materialisation cases (T well above block_k, causal and not)."""
    cases = []
    for t in range(trials):
        block_k = rng.choice([8, 16, 32])
        T = rng.choice([1, 17, 33, 67, 101, 129]) if t else rng.choice([1, 7])  # one below block_k
        dtype = torch.bfloat16 if t == trials - 1 else torch.float32
        cases.append(dict(B=rng.choice([1, 2]), H=rng.choice([1, 3]), T=T, D=rng.choice([16, 64]), block_k=block_k,
                          causal=t % 2 == 1, dtype=dtype))
    T = rng.choice([257, 263, 301])
    cases += [dict(B=1, H=2, T=T, D=16, block_k=32, causal=c, dtype=torch.float32) for c in (True, False)]
    return cases


@check(forbid=FORBID)
def check_flash_attention(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(q, k, v, *, causal, block_k) -> (O, L)` on (B, H, T, D) inputs: O = softmax(q k^T / sqrt(D)) v
    in q's dtype (causal: query i sees keys j <= i), L (B, H, T) the log-sum-exp of each score row,
    computed block by block of `block_k` keys, never holding a (T, T) matrix."""
    name, rng = "flash_attention", random.Random(case_seed(seed))
    for c in _cases(rng, trials):
        hp = {**c, "dtype": str(c["dtype"]).removeprefix("torch.")}
        gen = torch.Generator().manual_seed(rng.randrange(10 ** 6))
        shape = (c["B"], c["H"], c["T"], c["D"])
        # q scaled by 3: scores of spread ~3, so the maximum grows from block to block and every
        # rescale matters
        q, k, v = (torch.randn(shape, generator=gen) * s for s in (3.0, 1.0, 1.0))
        q, k, v = (x.to(c["dtype"]) for x in (q, k, v))
        q64, k64, v64 = (x.double() for x in (q, k, v))
        o_ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=c["causal"])
        l_ref = torch.logsumexp(attention_scores(q64, k64, c["causal"]), dim=-1)
        got = run_student(_flash_worker, fn, q, k, v, c["causal"], c["block_k"])
        _compare(name, got, c, o_ref, l_ref, hp)
    ok(name, f"{trials + 2} cases, seed={seed}")


def _compare(name: str, got: dict, c: dict, o_ref: torch.Tensor, l_ref: torch.Tensor, hp: dict) -> None:
    """One case's verdict: what was returned, fused operators, nan, then values, then the largest tensor."""
    B, H, T, D = o_ref.shape
    if isinstance(got["out"], str):
        raise AssertionError(f"{name}: return (O, L), two tensors; got {got['out']} ({fmt(hp)})")
    o, lse = got["out"]
    if o.shape != o_ref.shape or o.dtype != c["dtype"]:
        raise AssertionError(f"{name}: O must be q's shape {tuple(o_ref.shape)} and dtype {hp['dtype']}, got "
                             f"{tuple(o.shape)} {str(o.dtype).removeprefix('torch.')} ({fmt(hp)})")
    if lse.shape != l_ref.shape or not lse.is_floating_point():
        raise AssertionError(f"{name}: L must be a float tensor of shape (B, H, T) = {tuple(l_ref.shape)}, got "
                             f"{tuple(lse.shape)} {str(lse.dtype).removeprefix('torch.')} ({fmt(hp)})")
    if got["fused"]:
        raise AssertionError(f"{name}: the exercise asks for your own implementation; {', '.join(got['fused'])} "
                             f"is torch's fused attention ({fmt(hp)})")
    bad = o.isnan().any(dim=-1) | lse.isnan()
    if bad.any():
        rows = bad.flatten(0, 1).any(dim=0).nonzero().flatten().tolist()  # the query positions with a nan
        why = ("query 0 has no key left: causal keeps the keys j <= i, the diagonal included" if rows == [0]
               else "exp(-inf - (-inf)) is nan: a key block that causality masks entirely has rowmax -inf; take exp "
                    "against the running maximum m_new (finite once a row has seen key 0), not the block's own max")
        raise AssertionError(f"{name}: nan at {len(rows)} of {T} query positions, the first {rows[0]}: {why} "
                             f"({fmt(hp)})")
    fp32 = "" if c["dtype"] == torch.float32 else "; compute in fp32 (q.float()), a bf16 score is 3 digits"
    assert_close(name, f"L (m + log l per row; rescale l by exp(m_old - m_new) whenever the maximum grows{fp32})",
                 lse, l_ref, hp, rtol=FP32_TOL, atol=FP32_TOL)
    tol = FP32_TOL if c["dtype"] == torch.float32 else BF16_O_TOL
    assert_close(name, "O (rescale the unnormalised output by exp(m_old - m_new) whenever the maximum grows; "
                       "divide by l once, after the last block)", o, o_ref, hp, rtol=tol, atol=tol)
    if T > 2 * B * H * max(D, c["block_k"]) and got["numel"] >= T * T:
        raise AssertionError(f"{name}: materialised a (T x T) matrix: {got['what']}, T={T}; hold one block of "
                             f"block_k={c['block_k']} keys at a time (its causal mask too) ({fmt(hp)})")
