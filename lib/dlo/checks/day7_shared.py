"""What every Day 7 check shares: the forbidden references, seeded float64 layers, one forward/backward
with its collectives counted and its FLOPs, and what a rank is given of a layer it splits (`only_blocks`:
its own block of each weight, the other ranks' NaN; issue 26).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dlo.checks.day7_comms import CommTap
from dlo.grading.compare import DTYPE, assert_close, fmt

TP = "dlo.distributed.tensor_parallel."
COMMS = "dlo.distributed.tp_comms."
LAYERS = tuple(TP + n for n in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                                "TensorParallelSwiGLU", "TensorParallelAttention", "apply_megatron_tp", "apply_tp",
                                "vocab_parallel_cross_entropy"))
# torch's own tensor-parallel layers: parallelize_module, and the styles it applies, each a whole column- or
# row-parallel linear (or the sequence-parallel norm) by itself: `ColwiseParallel()._apply(linear, mesh)` (with
# src_data_rank=None, the rank's own block) passed exercise 1's column and row layers (a red-team audit, 2026-12-02)
LAYERS += ("torch.distributed.tensor.parallel.parallelize_module", "torch.distributed.tensor.parallel.style.*")
F_G = tuple(COMMS + n for n in ("copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
                                "CopyToTensorParallel.apply", "ReduceFromTensorParallel.apply",
                                "GatherFromTensorParallel.apply", "ScatterToTensorParallel.apply"))
# torch's DTensor places exercises 1-5's collectives and writes their backward itself: `DTensor.from_local(x, mesh,
# [Replicate()]).to_local(grad_placements=[Partial()])` is f, a Partial redistributed to Replicate is g, F.linear on
# Shard(0)/Shard(1) weights a column or row layer, Shard(1) <-> Replicate/Partial sequence parallelism's all-gather and
# reduce-scatter, amax and sum on a Shard(1) DTensor the vocabulary-parallel loss (a red team, 2026-12-03: 20/20 on Day
# 7, on real collectives the counts and payloads took). Every DTensor and funcol collective is a `_c10d_functional`
# operator (the autograd-aware ones `_c10d_functional_autograd`): refused at dispatch, whatever reached them. The
# exercises' own collectives are torch.distributed's (dist.all_reduce, all_gather, reduce_scatter), `c10d::` operators,
# and the grader's code on the rank issues none. Exercise 6 (the DTensor plan) is DTensor's: not refused there.
DTENSOR = ("_c10d_functional::*", "_c10d_functional_autograd::*")



# ----------------------------------------------------------------------------- shared helpers

def seeded_gen(seed: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + salt)


def seeded_linear(n_in: int, n_out: int, gen, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=bias, dtype=DTYPE)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen, dtype=DTYPE) / n_in ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=gen, dtype=DTYPE))
    return lin


class SwiGLU(nn.Module):
    """The Llama's feed-forward block: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int, gen):
        super().__init__()
        self.w1, self.w2, self.w3 = seeded_linear(dim, hidden, gen, False), seeded_linear(hidden, dim, gen, False), \
            seeded_linear(dim, hidden, gen, False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


SWIGLU_SPLIT = {"w1": 0, "w3": 0, "w2": 1}  # w1, w3 by output features (columns), w2 by input features (rows)


def only_blocks(module: nn.Module, t: int, r: int, splits: dict[str, int]) -> nn.Module:
    """What rank r is given of a module whose linears it splits (`splits`: submodule name -> 0 for a
    split by output features, 1 by input features; "" for the module itself): a copy of the same
    shapes in which only its own r-th contiguous block of each weight (and of a bias split with the
    output features) is real and the other ranks' blocks are NaN. The exercise's constructor keeps
    its block; nothing on the rank holds the whole layer, so the whole output cannot be computed
    there. NaN rather than zeros: a layer that computes with another rank's block shows it."""
    out = copy.deepcopy(module)
    with torch.no_grad():
        for name, dim in splits.items():
            lin = out.get_submodule(name)
            for p, d in ((lin.weight, dim), (lin.bias if dim == 0 else None, 0)):
                if p is not None:
                    mine = p.chunk(t, d)[r].clone()
                    p.fill_(float("nan"))
                    p.chunk(t, d)[r].copy_(mine)
    return out


def assert_block_close(name: str, what: str, got, want, where) -> None:
    """`assert_close`, with the likely cause named when a rank's result is not finite and the
    reference is: it computed with the other ranks' blocks of a weight, NaN on its rank."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape \
            and not bool(got.isfinite().all()) and bool(want.isfinite().all()):
        raise AssertionError(f"{name}: {what} differs from the reference: it is not finite; each rank is given only "
                             f"its own block of the weights (the other ranks' blocks are NaN there): keep this "
                             f"rank's contiguous block, chunk(t, dim)[rank], and compute with it alone ({fmt(where)})")
    assert_close(name, what, got, want, where)


def fwd_bwd(fn, x, up, flops: bool = False):
    """fn(x) with x a fresh leaf, then backward of <fn(x), up>: output, x.grad, comm counts fwd/bwd and
    what this rank put into each collective (`CommTap`), and with `flops` the FLOPs of both
    (FlopCounterMode: the matmuls and attention this rank ran)."""
    x = x.detach().clone().requires_grad_(True)
    counter = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
    with counter:
        with CommTap() as fwd:
            y = fn(x)
        if not isinstance(y, torch.Tensor):
            raise AssertionError(f"the forward returned a {type(y).__name__}, expected a tensor")
        with CommTap() as bwd:
            (y * up).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "fwd": fwd.by_kind("calls"), "bwd": bwd.by_kind("calls"),
           "fwd_in": fwd.inputs, "bwd_in": bwd.inputs}
    if flops:
        out["flops"] = counter.get_total_flops()
    return out


def reference(fn, x, up):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (y * up).sum().backward()
    return y.detach(), x.grad


def reference_flops(fn, x, up) -> int:
    """The FLOPs of one process's forward and backward (on copies: the module's grads are kept)."""
    fn = copy.deepcopy(fn)
    with FlopCounterMode(display=False) as counter:
        reference(fn, x, up)
    return counter.get_total_flops()


def expect_split_work(name: str, got: int, whole: int, t: int, where) -> None:
    """A rank's FLOPs against one process's: a split layer does 1/t of them; the whole layer computed
    on a rank (with collectives for show) does them all. Allowed: halfway between the two."""
    if t > 1 and got > whole * (1 + 1 / t) / 2:
        raise AssertionError(f"{name}: a rank ran {got:,} FLOPs in forward and backward, one process on the whole "
                             f"layer runs {whole:,}; each rank should compute its 1/{t} of the heads or hidden "
                             f"units ({whole // t:,}), not the whole layer ({where})")


def expect_own_work(name: str, got: list[dict], whole: int, t: int, where) -> None:
    """Each rank's FLOPs (`res["flops"]`) at least half its share of one process's: `expect_split_work`'s bound is an
    upper one, which a count of 0 (the matmuls run where the counter does not see them, or the count emptied)
    satisfies. Checked after the collectives' contents, whose messages name the usual ways round it."""
    for r, res in enumerate(got):
        if res["flops"] < whole / t / 2:
            raise AssertionError(f"{name}: the grader counted {res['flops']:,} FLOPs in rank {r}'s forward and "
                                 f"backward, its 1/{t} share of the layer's is {whole // t:,}: compute this rank's "
                                 f"heads or hidden units with torch's matmuls (F.linear, @), where the count sees them "
                                 f"({where})")


def param_grad(module, name: str, what: str):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise AssertionError(f"{what}: the module has no attribute {name!r} (keep the names of the exercise)")
    return None if obj.grad is None else obj.grad.detach().clone()


def expect_comms(name: str, what: str, got: dict, want: dict, hint: str, where) -> None:
    if got != want:
        raise AssertionError(f"{name}: {what}: collectives {got or 'none'}, expected exactly {want or 'none'}; "
                             f"{hint} ({where})")
