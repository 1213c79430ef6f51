"""Day 7's exercises 1 and 2 (f and g, the column- and row-parallel linears, the tensor-parallel
SwiGLU) and what every Day 7 check shares: the forbidden references, seeded float64 layers, one
forward/backward with its collectives counted, and what a rank is given of a layer it splits
(`only_blocks`: its own block of each weight, the other ranks' NaN; issue 26). Re-exported by
`dlo.checks.day7`.
"""

from __future__ import annotations

import contextlib
import copy
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dlo.checks.day7_comms import (
    SUMS_GRAD,
    CommTap,
    expect_block_sums,
    expect_blocks,
    expect_sum,
    recorded,
    verified,
)
from dlo.grading.api import case_seed, check, on_ranks
from dlo.grading.compare import DTYPE, assert_close, fmt, ok

TP = "dlo.distributed.tensor_parallel."
COMMS = "dlo.distributed.tp_comms."
LAYERS = tuple(TP + n for n in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                                "TensorParallelSwiGLU", "TensorParallelAttention", "apply_megatron_tp", "apply_tp",
                                "vocab_parallel_cross_entropy"))
LAYERS += ("torch.distributed.tensor.parallel.parallelize_module",)
F_G = tuple(COMMS + n for n in ("copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
                                "CopyToTensorParallel.apply", "ReduceFromTensorParallel.apply",
                                "GatherFromTensorParallel.apply", "ScatterToTensorParallel.apply"))

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


# ----------------------------------------------------------------------------- 1. f, g and the linear layers

def _linears_case(seed: int, t: int) -> dict:
    rng, gen = random.Random(seed), seeded_gen(seed, 1)
    B, T, n_in = rng.choice([1, 3]), rng.choice([3, 5]), rng.choice([5, 7])
    n_out = t * rng.choice([3, 5])
    return {"col": seeded_linear(n_in, n_out, gen), "row": seeded_linear(n_out, n_in, gen),
            "x": torch.randn(B, T, n_in, generator=gen, dtype=DTYPE),
            "h": torch.randn(B, T, n_out, generator=gen, dtype=DTYPE),
            "up_out": torch.randn(B, T, n_out, generator=gen, dtype=DTYPE),
            "up_in": torch.randn(B, T, n_in, generator=gen, dtype=DTYPE),
            "per_rank": [torch.randn(B, T, n_in, generator=gen, dtype=DTYPE) for _ in range(t)],
            "per_rank_up": [torch.randn(B, T, n_in, generator=gen, dtype=DTYPE) for _ in range(t)],
            # the output gradient of the split column layer: each rank gets its block only
            "up_split": torch.randn(B, T, n_out, generator=gen, dtype=DTYPE),
            "where": dict(B=B, T=T, in_features=n_in, out_features=n_out, world_size=t, seed=seed)}


def _linears_parts(c: dict, t: int) -> list[dict]:
    """Rank r's part, drawn here: its own input and output gradient for f and g, its own rows of the
    column layer and columns of the row layer (`only_blocks`), the column layer's replicated input
    and output gradient, its own block of the split output's gradient and of the row layer's input;
    what the other ranks hold has to come through a collective."""
    return [{"x_r": c["per_rank"][r], "up_r": c["per_rank_up"][r], "col": only_blocks(c["col"], t, r, {"": 0}),
             "row": only_blocks(c["row"], t, r, {"": 1}), "x": c["x"],
             "up_out": c["up_out"], "up_split": c["up_split"].chunk(t, -1)[r].clone(),
             "h": c["h"].chunk(t, -1)[r].clone(), "up_in": c["up_in"]} for r in range(t)]


@recorded
def _linears_worker(mine, f, g, col_cls, row_cls):
    out = {"f": fwd_bwd(lambda x: f(x), mine["x_r"], mine["up_r"]),
           "g": fwd_bwd(lambda x: g(x), mine["x_r"], mine["up_r"])}
    for gather in (False, True):
        layer = col_cls(mine["col"], None, gather_output=gather)
        res = fwd_bwd(layer, mine["x"], mine["up_out"] if gather else mine["up_split"])
        res["dw"], res["db"] = param_grad(layer, "weight", "ColumnParallelLinear"), \
            param_grad(layer, "bias", "ColumnParallelLinear")
        out[f"col_gather={gather}"] = res
    layer = row_cls(mine["row"], None)  # its input: this rank's block of the features
    res = fwd_bwd(layer, mine["h"], mine["up_in"])
    res["dw"], res["db"] = (param_grad(layer, w, "RowParallelLinear") for w in ("weight", "bias"))
    out["row"] = res
    return out


@check(forbid=LAYERS + F_G)
def check_tp_linears(f, g, column_cls, row_cls, seed: int = 0, world_size: int = 2) -> None:
    """`f(x, group=None)` (identity forward, all-reduce backward), `g(x, group=None)` (all-reduce
    forward, identity backward), `ColumnParallelLinear(linear, group=None, gather_output=False)` and
    `RowParallelLinear(linear, group=None)` (its input is always this rank's block of the input features,
    as a column layer leaves it: no `input_is_parallel` to guess): rank r keeps the r-th contiguous
    block of the output (column) or input (row) features (the only block it is given: the others are
    NaN on its rank). Outputs, input and weight gradients and the collectives of forward and
    backward, against nn.Linear on one process."""
    name, t = "tp_linears", world_size
    c = _linears_case(case_seed(seed), t)  # a secret seed when graded
    where = {**c["where"], "seed": seed}
    got = verified(name, on_ranks(_linears_worker, world_size, f, g, column_cls, row_cls,
                                  per_rank=_linears_parts(c, t)), t, where)
    sum_x, sum_up = sum(c["per_rank"]), sum(c["per_rank_up"])
    for r, res in enumerate(got):
        fr, gr = res["f"], res["g"]
        assert_close("f", f"forward output on rank {r} (f is the identity forward)", fr["y"], c["per_rank"][r], where)
        assert_close("f", f"input gradient on rank {r} (f all-reduces the gradient: the sum over ranks)", fr["dx"],
                     sum_up, where)
        expect_comms("f", "forward", fr["fwd"], {}, "f does not communicate in forward", where)
        expect_comms("f", "backward", fr["bwd"], {"all_reduce": 1}, "one all-reduce of the gradient", where)
        assert_close("g", f"forward output on rank {r} (g all-reduces: the sum over ranks)", gr["y"], sum_x, where)
        assert_close("g", f"input gradient on rank {r} (g is the identity backward)", gr["dx"], c["per_rank_up"][r],
                     where)
        expect_comms("g", "forward", gr["fwd"], {"all_reduce": 1}, "one all-reduce of the output", where)
        expect_comms("g", "backward", gr["bwd"], {}, "g does not communicate in backward", where)
        lin, col = c["col"], "ColumnParallelLinear"
        for gather in (False, True):
            lin.zero_grad()
            y, dx = reference(lin, c["x"], c["up_out"] if gather else c["up_split"])
            res, here = got[r][f"col_gather={gather}"], {**where, "rank": r, "gather_output": gather}
            assert_block_close(col, "output" + ("" if gather else " (this rank's block of features)"),
                               res["y"], y if gather else y.chunk(t, -1)[r], here)
            assert_block_close(col, "input gradient (the input is replicated: f must sum the ranks' partial "
                               "gradients)", res["dx"], dx, here)
            assert_block_close(col, "weight gradient (rows of this rank's block)", res["dw"],
                               lin.weight.grad.chunk(t, 0)[r], here)
            assert_block_close(col, "bias gradient", res["db"], lin.bias.grad.chunk(t, 0)[r], here)
            expect_comms(col, "backward", res["bwd"], {"all_reduce": 1},
                         "f before the matmul all-reduces the input gradient once", here)
            expect_comms(col, "forward", res["fwd"], {"all_gather": 1} if gather else {},
                         "no communication, or one all-gather with gather_output=True", here)
        lin, row = c["row"], "RowParallelLinear"
        lin.zero_grad()
        y, dx = reference(lin, c["h"], c["up_in"])
        res, here = got[r]["row"], {**where, "rank": r}
        assert_block_close(row, "output (g sums the partial products, the bias is added once)", res["y"], y, here)
        assert_block_close(row, "input gradient (this rank's block of input features)", res["dx"],
                           dx.chunk(t, -1)[r], here)
        assert_block_close(row, "weight gradient (columns of this rank's block)", res["dw"],
                           lin.weight.grad.chunk(t, 1)[r], here)
        assert_block_close(row, "bias gradient (replicated bias: the whole gradient)", res["db"], lin.bias.grad, here)
        expect_comms(row, "forward", res["fwd"], {"all_reduce": 1}, "g after the matmul", here)
        expect_comms(row, "backward", res["bwd"], {}, "g is the identity backward", here)
    _linears_payloads(c, got, t, where)
    ok(name, f"f, g, column (both gather_output) and row layers on {world_size} ranks, seed={seed}")


def _linears_payloads(c: dict, got: list[dict], t: int, where) -> None:
    """What the layers' collectives carried: the column layer's all-gather (gather_output=True) each rank's
    block of the output and its backward all-reduce the input gradient's partial sums, the row layer's
    all-reduce the partial products (the bias added after it, or before)."""
    col, row = c["col"], c["row"]
    for gather in (False, True):
        col.zero_grad()
        y, dx = reference(col, c["x"], c["up_out"] if gather else c["up_split"])
        res = [out[f"col_gather={gather}"] for out in got]
        here = {**where, "gather_output": gather}
        if gather:
            expect_blocks("ColumnParallelLinear", "the forward all-gather", [r["fwd_in"][0] for r in res],
                          list(y.chunk(t, -1)), "its block of the output features",
                          "gather the output (B, T, out/t) of this rank's rows, not the weights", here)
        expect_sum("ColumnParallelLinear", "the backward all-reduce", [r["bwd_in"][0] for r in res], [dx],
                   "the input gradient", SUMS_GRAD, here)
    y = reference(row, c["h"], c["up_in"])[0]
    expect_sum("RowParallelLinear", "the forward all-reduce", [out["row"]["fwd_in"][0] for out in got],
               [y - row.bias.detach(), y], "the output (less its bias)", "all-reduce only this rank's partial product "
               "x_r W_r^T (its input block times its weight block): the sum over ranks is the output", where)


# ----------------------------------------------------------------------------- 2. the tensor-parallel SwiGLU

def _mlp_case(seed: int, t: int) -> dict:
    rng, gen = random.Random(seed), seeded_gen(seed, 2)
    B, T, dim, hidden = rng.choice([1, 3]), rng.choice([3, 5]), rng.choice([5, 7, 9]), t * rng.choice([3, 5])
    return {"ffn": SwiGLU(dim, hidden, gen), "x": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
            "up": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
            "where": dict(B=B, T=T, dim=dim, hidden=hidden, world_size=t, seed=seed)}


@recorded
def _mlp_worker(mine, cls):
    """`mine`: this rank's blocks of the layer (`only_blocks`) and its input and output gradient (the
    same on every rank), drawn on the grader's side."""
    mlp = cls(mine["ffn"], None)
    res = fwd_bwd(mlp, mine["x"], mine["up"], flops=True)
    res.update({w: param_grad(mlp, f"{w}.weight", "the tensor-parallel MLP") for w in ("w1", "w2", "w3")})
    return res


@check(forbid=LAYERS)
def check_tp_swiglu(cls, seed: int = 0, world_size: int = 2) -> None:
    """`cls(ffn, group=None)` splits a SwiGLU feed-forward (w1, w3 by output features, w2 by input
    features) and computes w2(silu(w1 x) * w3 x) with exactly one all-reduce in forward and one in
    backward (each rank is given only its blocks: the others are NaN on its rank); outputs, input
    gradient and w1/w2/w3 gradients against one process."""
    name, t = "tp_swiglu", world_size
    c = _mlp_case(case_seed(seed), t)  # a secret seed when graded
    parts = [{"ffn": only_blocks(c["ffn"], t, r, SWIGLU_SPLIT), "x": c["x"], "up": c["up"]} for r in range(t)]
    got = verified(name, on_ranks(_mlp_worker, world_size, cls, per_rank=parts), t, {**c["where"], "seed": seed})
    whole = reference_flops(c["ffn"], c["x"], c["up"])
    y, dx = reference(c["ffn"], c["x"], c["up"])
    for r, res in enumerate(got):
        here = {**c["where"], "seed": seed, "rank": r}
        expect_comms(name, "forward", res["fwd"], {"all_reduce": 1},
                     "w1 and w3 keep their outputs split, only w2's partial sums are all-reduced (g)", here)
        expect_comms(name, "backward", res["bwd"], {"all_reduce": 1},
                     "two all-reduces mean w1 and w3 each applied f to the same input: apply f once to x and "
                     "feed both local matmuls", here)
        assert_block_close(name, "output", res["y"], y, here)
        assert_block_close(name, "input gradient", res["dx"], dx, here)
        for w, dim, which in (("w1", 0, "rows"), ("w3", 0, "rows"), ("w2", 1, "columns")):
            assert_block_close(name, f"{w} gradient (this rank's {which})", res[w],
                               getattr(c["ffn"], w).weight.grad.chunk(t, dim)[r], here)
        expect_split_work(name, res["flops"], whole, t, here)
    expect_block_sums(name, got, y, dx, {**c["where"], "seed": seed})
    ok(name, f"one all-reduce each way on {world_size} ranks, seed={seed}")
