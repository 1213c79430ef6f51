"""What a Day 7 rank put into its collectives, held to what the exercise's collectives carry.

A count of collectives (`CommCounter.by_kind("calls")`) does not say what they carried: one all-reduce
of a rank's zero-padded weight blocks gives every rank the whole weights, after which it can compute
the whole layer with the collective count of the exercise. So each rank also keeps a copy of what it
contributed to each collective (`CommTap`: the tensor it all-reduced, its block of an all-gather), and
the grader holds the contributions to the exercise's partial results, computed on its side: the sum
over ranks of an all-reduce's inputs is the layer's output (or input gradient), each rank's block of
an all-gather is its block of the output. Bytes sent beside the counter (the C++ process group called
directly) are what `dlo.grading.api.verify_wire` finds, from each rank's sockets.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dlo.checks.rank_count import every_rank
from dlo.grading.api import verify_wire
from dlo.grading.compare import fmt
from dlo.measure import CommCounter, collective_kind, tensors_in

RTOL = ATOL = 1e-9  # float64: a correct split differs from one process by summation order only


def _contributed(kind: str, func, args) -> Tensor:
    """This rank's input to a collective, flattened: c10d's all-gather, reduce-scatter and all-to-all
    take (outputs, inputs, ...), every other op (and the functional ones) its input first."""
    i = 1 if func.namespace == "c10d" and kind in ("all_gather", "reduce_scatter", "all_to_all") else 0
    parts = tensors_in(args[i]) if len(args) > i else []
    return torch.cat([p.detach().reshape(-1) for p in parts]).clone() if parts else torch.zeros(0)


class CommTap(CommCounter):
    """A `CommCounter` that also keeps a copy of each collective's input on this rank (`inputs`, one
    per call), taken before the collective runs (an all-reduce works in place)."""

    def __init__(self):
        super().__init__()
        self.inputs: list[Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = collective_kind(func)
        if kind is not None:
            self.inputs.append(_contributed(kind, func, args))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _matches(got: Tensor, want: Tensor) -> bool:
    """The same values, in whatever order the rank laid them out (a transposed, contiguous copy)."""
    g, w = got.reshape(-1).to(torch.float64).sort().values, want.reshape(-1).to(torch.float64).sort().values
    return bool(torch.allclose(g, w, rtol=RTOL, atol=ATOL))


def _size(name: str, what: str, sent: list[Tensor], want: Tensor, desc: str, hint: str, where) -> None:
    for r, s in enumerate(sent):
        if s.numel() != want.numel():
            raise AssertionError(f"{name}: {what} carried {s.numel() * s.element_size():,} bytes from rank {r}, "
                                 f"expected {want.numel() * want.element_size():,} ({desc}, "
                                 f"{tuple(want.shape)} float64, and nothing else); {hint} ({where})")


def expect_sum(name: str, what: str, sent: list[Tensor], wants: list[Tensor], desc: str, hint: str, where) -> None:
    """An all-reduce's inputs on the ranks (`sent`, per rank): each the size of the result, their sum
    one of `wants` (the layer's output, its input gradient: what the exercise all-reduces)."""
    _size(name, what, sent, wants[0], desc, hint, where)
    total = sum(sent[1:], sent[0].clone())
    if not any(_matches(total, w) for w in wants):
        raise AssertionError(f"{name}: what the ranks put into {what} does not sum to {desc}; {hint} ({where})")


def expect_blocks(name: str, what: str, sent: list[Tensor], wants: list[Tensor], desc: str, hint: str,
                  where) -> None:
    """An all-gather's inputs: rank r's is `wants[r]` (its block of the result)."""
    _size(name, what, sent, wants[0], desc, hint, where)
    for r, (s, w) in enumerate(zip(sent, wants)):
        if not _matches(s, w):
            raise AssertionError(f"{name}: what rank {r} put into {what} is not {desc}; {hint} ({where})")


def recorded(worker):
    """A rank's worker that also counts every collective it issues (`records`, for `verify_wire`: the
    constructors' and hooks' too) beside what it returns (`out`). Keeps the worker's name: the ranks
    import it by name."""
    @functools.wraps(worker)
    def run(*args, **kwargs):
        with CommCounter() as everything:
            out = worker(*args, **kwargs)
        return {"out": out, "records": everything.records()}
    return run


def verified(name: str, got: list[dict], t: int, where) -> list:
    """The ranks' results of `recorded`, once their counted bytes agree with their sockets' (every rank's: a short
    list would leave ranks unchecked and their inputs out of the sums)."""
    every_rank(name, got, t, fmt(where))
    verify_wire(name, [res["records"] for res in got], t, fmt(where))
    return [res["out"] for res in got]


# The one forward all-reduce of a column-then-row block (SwiGLU, attention) sums the partial products
# of the ranks' blocks: the output, B T dim float64, nothing else.
SUMS_OUTPUT = "all-reduce only the partial product of this rank's blocks (g after the row layer)"
SUMS_GRAD = ("f all-reduces this rank's partial input gradient (from its own blocks) once; a gradient already "
             "whole on every rank sums to t times it")


def expect_block_sums(name: str, got: list[dict], y, dx, where) -> None:
    """A column-then-row block's two all-reduces: forward the output's partial sums, backward the input
    gradient's."""
    expect_sum(name, "the forward all-reduce", [res["fwd_in"][0] for res in got], [y], "the output", SUMS_OUTPUT,
               where)
    expect_sum(name, "the backward all-reduce", [res["bwd_in"][0] for res in got], [dx], "the input gradient",
               SUMS_GRAD, where)
