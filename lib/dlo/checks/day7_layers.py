"""Day 7's exercises 1 and 2: f and g, the column- and row-parallel linears, and the tensor-parallel
SwiGLU. What every Day 7 check shares is in `dlo.checks.day7_shared`. Re-exported by `dlo.checks.day7`.
"""

from __future__ import annotations

import random

import torch

from dlo.checks.day7_comms import SUMS_GRAD, expect_block_sums, expect_blocks, expect_sum, recorded, verified
from dlo.checks.day7_shared import (
    DTENSOR,
    F_G,
    LAYERS,
    SWIGLU_SPLIT,
    SwiGLU,
    assert_block_close,
    expect_comms,
    expect_own_work,
    expect_split_work,
    fwd_bwd,
    only_blocks,
    param_grad,
    reference,
    reference_flops,
    seeded_gen,
    seeded_linear,
)
from dlo.grading.api import case_seed, check, on_ranks
from dlo.grading.compare import DTYPE, assert_close, ok

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


@check(forbid=LAYERS + F_G + DTENSOR)
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


@check(forbid=LAYERS + F_G + DTENSOR)  # F_G: the library's f and g (a red team, 2026-12-03)
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
    expect_own_work(name, got, whole, t, {**c["where"], "seed": seed})
    ok(name, f"one all-reduce each way on {world_size} ranks, seed={seed}")
