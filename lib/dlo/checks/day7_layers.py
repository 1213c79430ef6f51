"""Day 7's exercises 1 and 2 (f and g, the column- and row-parallel linears, the tensor-parallel
SwiGLU) and what every Day 7 check shares: the forbidden references, seeded float64 layers, one
forward/backward with its collectives counted. Re-exported by `dlo.checks.day7`.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.grading.api import check, on_ranks
from dlo.grading.compare import DTYPE, assert_close, ok
from dlo.measure import CommCounter

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


def fwd_bwd(fn, x, up):
    """fn(x) with x a fresh leaf, then backward of <fn(x), up>: output, x.grad, comm counts fwd/bwd."""
    x = x.detach().clone().requires_grad_(True)
    with CommCounter() as fwd:
        y = fn(x)
    if not isinstance(y, torch.Tensor):
        raise AssertionError(f"the forward returned a {type(y).__name__}, expected a tensor")
    with CommCounter() as bwd:
        (y * up).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "fwd": fwd.by_kind("calls"), "bwd": bwd.by_kind("calls")}


def reference(fn, x, up):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (y * up).sum().backward()
    return y.detach(), x.grad


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
            "where": dict(B=B, T=T, in_features=n_in, out_features=n_out, world_size=t, seed=seed)}


def _linears_worker(f, g, col_cls, row_cls, seed):
    t, r = dist.get_world_size(), dist.get_rank()
    c = _linears_case(seed, t)
    out = {"f": fwd_bwd(lambda x: f(x), c["per_rank"][r], c["per_rank_up"][r]),
           "g": fwd_bwd(lambda x: g(x), c["per_rank"][r], c["per_rank_up"][r])}
    for gather in (False, True):
        layer = col_cls(c["col"], None, gather_output=gather)
        up = c["up_out"] if gather else c["up_out"].chunk(t, -1)[r]
        res = fwd_bwd(layer, c["x"], up)
        res["dw"], res["db"] = param_grad(layer, "weight", "ColumnParallelLinear"), \
            param_grad(layer, "bias", "ColumnParallelLinear")
        out[f"col_gather={gather}"] = res
    layer = row_cls(c["row"], None, input_is_parallel=True)
    res = fwd_bwd(layer, c["h"].chunk(t, -1)[r], c["up_in"])
    res["dw"], res["db"] = (param_grad(layer, w, "RowParallelLinear") for w in ("weight", "bias"))
    out["row"] = res
    return out


@check(forbid=LAYERS + F_G)
def check_tp_linears(f, g, column_cls, row_cls, seed: int = 0, world_size: int = 2) -> None:
    """`f(x, group=None)` (identity forward, all-reduce backward), `g(x, group=None)` (all-reduce
    forward, identity backward), `ColumnParallelLinear(linear, group=None, gather_output=False)` and
    `RowParallelLinear(linear, group=None, input_is_parallel=True)`: rank r keeps the r-th contiguous
    block of the output (column) or input (row) features. Outputs, input and weight gradients and
    the collectives of forward and backward, against nn.Linear on one process."""
    name = "tp_linears"
    got = on_ranks(_linears_worker, world_size, f, g, column_cls, row_cls, seed)
    c, t = _linears_case(seed, world_size), world_size
    where = c["where"]
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
        lin = c["col"]
        for gather in (False, True):
            lin.zero_grad()
            y, dx = reference(lin, c["x"], c["up_out"])
            res, here = got[r][f"col_gather={gather}"], {**where, "rank": r, "gather_output": gather}
            assert_close("ColumnParallelLinear", "output" + ("" if gather else " (this rank's block of features)"),
                         res["y"], y if gather else y.chunk(t, -1)[r], here)
            assert_close("ColumnParallelLinear", "input gradient (the input is replicated: f must sum the ranks' "
                         "partial gradients)", res["dx"], dx, here)
            assert_close("ColumnParallelLinear", "weight gradient (rows of this rank's block)", res["dw"],
                         lin.weight.grad.chunk(t, 0)[r], here)
            assert_close("ColumnParallelLinear", "bias gradient", res["db"], lin.bias.grad.chunk(t, 0)[r], here)
            expect_comms("ColumnParallelLinear", "backward", res["bwd"], {"all_reduce": 1},
                         "f before the matmul all-reduces the input gradient once", here)
            expect_comms("ColumnParallelLinear", "forward", res["fwd"], {"all_gather": 1} if gather else {},
                         "no communication, or one all-gather with gather_output=True", here)
        lin = c["row"]
        lin.zero_grad()
        y, dx = reference(lin, c["h"], c["up_in"])
        res, here = got[r]["row"], {**where, "rank": r}
        assert_close("RowParallelLinear", "output (g sums the partial products, the bias is added once)", res["y"],
                     y, here)
        assert_close("RowParallelLinear", "input gradient (this rank's block of input features)", res["dx"],
                     dx.chunk(t, -1)[r], here)
        assert_close("RowParallelLinear", "weight gradient (columns of this rank's block)", res["dw"],
                     lin.weight.grad.chunk(t, 1)[r], here)
        assert_close("RowParallelLinear", "bias gradient (replicated bias: the whole gradient)", res["db"],
                     lin.bias.grad, here)
        expect_comms("RowParallelLinear", "forward", res["fwd"], {"all_reduce": 1}, "g after the matmul", here)
        expect_comms("RowParallelLinear", "backward", res["bwd"], {}, "g is the identity backward", here)
    ok(name, f"f, g, column (both gather_output) and row layers on {world_size} ranks, seed={seed}")


# ----------------------------------------------------------------------------- 2. the tensor-parallel SwiGLU

def _mlp_case(seed: int, t: int) -> dict:
    rng, gen = random.Random(seed), seeded_gen(seed, 2)
    B, T, dim, hidden = rng.choice([1, 3]), rng.choice([3, 5]), rng.choice([5, 7, 9]), t * rng.choice([3, 5])
    return {"ffn": SwiGLU(dim, hidden, gen), "x": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
            "up": torch.randn(B, T, dim, generator=gen, dtype=DTYPE),
            "where": dict(B=B, T=T, dim=dim, hidden=hidden, world_size=t, seed=seed)}


def _mlp_worker(cls, seed):
    c = _mlp_case(seed, dist.get_world_size())
    mlp = cls(c["ffn"], None)
    res = fwd_bwd(mlp, c["x"], c["up"])
    res.update({w: param_grad(mlp, f"{w}.weight", "the tensor-parallel MLP") for w in ("w1", "w2", "w3")})
    return res


@check(forbid=LAYERS)
def check_tp_swiglu(cls, seed: int = 0, world_size: int = 2) -> None:
    """`cls(ffn, group=None)` splits a SwiGLU feed-forward (w1, w3 by output features, w2 by input
    features) and computes w2(silu(w1 x) * w3 x) with exactly one all-reduce in forward and one in
    backward; outputs, input gradient and w1/w2/w3 gradients against one process."""
    name = "tp_swiglu"
    got = on_ranks(_mlp_worker, world_size, cls, seed)
    c, t = _mlp_case(seed, world_size), world_size
    y, dx = reference(c["ffn"], c["x"], c["up"])
    for r, res in enumerate(got):
        here = {**c["where"], "rank": r}
        expect_comms(name, "forward", res["fwd"], {"all_reduce": 1},
                     "w1 and w3 keep their outputs split, only w2's partial sums are all-reduced (g)", here)
        expect_comms(name, "backward", res["bwd"], {"all_reduce": 1},
                     "two all-reduces mean w1 and w3 each applied f to the same input: apply f once to x and "
                     "feed both local matmuls", here)
        assert_close(name, "output", res["y"], y, here)
        assert_close(name, "input gradient", res["dx"], dx, here)
        assert_close(name, "w1 gradient (this rank's rows)", res["w1"], c["ffn"].w1.weight.grad.chunk(t, 0)[r], here)
        assert_close(name, "w3 gradient (this rank's rows)", res["w3"], c["ffn"].w3.weight.grad.chunk(t, 0)[r], here)
        assert_close(name, "w2 gradient (this rank's columns)", res["w2"], c["ffn"].w2.weight.grad.chunk(t, 1)[r],
                     here)
    ok(name, f"one all-reduce each way on {world_size} ranks, seed={seed}")
