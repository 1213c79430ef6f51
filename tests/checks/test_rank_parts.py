"""Hostile submissions for the on-ranks checks of Days 5-7 (issue 26): each recomputes the expected
result from what its rank was given, or from what it finds in its callers' frames, and issues a
dummy collective or message so that the counts match. The checks used to give every rank the seed
and the whole problem (the model, the global batch, the full sequence), and each of these got full
marks; now the case is drawn on the grader's side and each rank holds only its part (of a layer it
splits, its own blocks: the other ranks' are NaN there), and a rank that gathers the whole layer
through collectives in its constructor (uncounted) and computes all of it fails on its FLOPs.

The honest submissions (the solution notebook's) pass the same checks in test_day5/6/7_checks.py.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks import day5, day6, day7

pytestmark = pytest.mark.usefixtures("one_thread")


def load_solution(day: str):
    from tests.checks.conftest import load_solution  # here: the ranks import this module, where conftest's are sealed

    return load_solution(day)


@pytest.fixture(scope="module")
def tp():
    return load_solution("day7_tensor_parallel")


def on_the_stack(test):
    """The first value in a caller's frame (or in a dict or list there) for which test(value) holds."""
    for info in inspect.stack()[1:]:
        for value in list(info.frame.f_locals.values()):
            items = [value, *(value.values() if isinstance(value, dict) else ())]
            for item in items:
                try:
                    if test(item):
                        return item
                except Exception:  # noqa: BLE001, S112 - a value the test cannot look at
                    continue
    return None


def seed_on_the_stack() -> bool:
    """A redraw of the case needs its seed: is one in a caller's frame?"""
    return any(isinstance(info.frame.f_locals.get(name), int) for info in inspect.stack()[1:]
               for name in ("seed", "secret"))


def dummy_all_reduce():
    dist.all_reduce(torch.zeros(1, dtype=torch.float64))


# ----------------------------------------------------------------------------- Day 7

def whole_weight(linear, dim):
    """The whole weight of a layer split along `dim`, rebuilt by an all-gather of every rank's block
    (in a constructor: no check counts its collectives)."""
    t, r = dist.get_world_size(), dist.get_rank()
    mine = linear.weight.detach().chunk(t, dim)[r].contiguous()
    parts = [torch.empty_like(mine) for _ in range(t)]
    dist.all_gather(parts, mine)
    return torch.cat(parts, dim)


class WholeSwiGLU(torch.nn.Module):
    """The right numbers with no split at all: the whole SwiGLU on each rank, the shards' gradients
    taken from it, and the two all-reduces issued for show; the whole weights read from the layer
    it is given, or (`gather`) all-gathered in the constructor."""

    gather = False

    def __init__(self, ffn, group=None):
        super().__init__()
        t, r = dist.get_world_size(), dist.get_rank()
        self.whole = {}
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            lin = getattr(ffn, name)
            self.whole[name] = whole_weight(lin, dim) if self.gather else lin.weight.detach()
            setattr(self, name, torch.nn.Linear(1, 1, bias=False))
            getattr(self, name).weight = torch.nn.Parameter(self.whole[name].chunk(t, dim)[r].clone())
        self.t, self.r = t, r

    def forward(self, x):
        full = []
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            parts = list(self.whole[name].chunk(self.t, dim))
            parts[self.r] = getattr(self, name).weight  # this rank's shard gets the gradient
            full.append(torch.cat(parts, dim))
        w1, w3, w2 = full
        dummy_all_reduce()
        y = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        return _AllReduceForShow.apply(y)


class GatheredSwiGLU(WholeSwiGLU):
    gather = True


def test_swiglu_finds_only_its_own_blocks_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="not finite; each rank is given only its own block"):
        day7.check_tp_swiglu(WholeSwiGLU)


def test_swiglu_gathered_whole_on_each_rank_fails_on_its_flops(ranks):
    with pytest.raises(AssertionError, match="FLOPs in forward and backward"):
        day7.check_tp_swiglu(GatheredSwiGLU)


class _AllReduceForShow(torch.autograd.Function):
    """Identity both ways; one all-reduce of a number in backward, for the count."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        dummy_all_reduce()
        return g


def whole_attention(tp, gather: bool):
    class WholeAttention(tp.TensorParallelAttention):
        """The honest layer (its shards, names and all-reduces) beside the whole attention computed on
        each rank, as a submission that takes its output from the whole layer does: the layer it is
        given, or (`gather`) one whose weights it all-gathered in the constructor."""

        def __init__(self, attention, group=None):
            super().__init__(attention, group)
            self.whole = copy.deepcopy(attention)
            if gather:
                with torch.no_grad():
                    for name, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
                        lin = getattr(self.whole, name)
                        lin.weight.copy_(whole_weight(lin, dim))

        def forward(self, x, cos, sin):
            mine = super().forward(x, cos, sin)  # the shards' gradients, and the all-reduces
            return mine + 0 * self.whole(x, cos, sin)
    return WholeAttention


def test_attention_finds_only_its_own_heads_on_its_rank(tp, ranks):
    with pytest.raises(AssertionError, match="not finite; each rank is given only its own block"):
        day7.check_tp_attention(whole_attention(tp, gather=False))


def test_attention_gathered_whole_on_each_rank_fails_on_its_flops(tp, ranks):
    with pytest.raises(AssertionError, match="FLOPs in forward and backward"):
        day7.check_tp_attention(whole_attention(tp, gather=True))


def test_row_layer_finds_no_full_input_on_its_rank(tp, ranks):
    class RowFromTheStack(tp.RowParallelLinear):
        """The whole input found in a caller's frame (this rank's block kept, for its gradient) times
        the whole weight (this rank's columns kept): the output with no sum over ranks, and an
        all-reduce of a number for show."""

        def __init__(self, linear, group=None):
            super().__init__(linear, group)
            self.whole = linear.weight.detach().clone()

        def forward(self, x):
            t, r = dist.get_world_size(), dist.get_rank()
            full = on_the_stack(lambda v: isinstance(v, torch.Tensor) and v.shape[:-1] == x.shape[:-1]
                                and v.shape[-1] == t * x.shape[-1] and torch.equal(v.chunk(t, -1)[r], x.detach()))
            if full is None:
                raise RuntimeError("no full input on the stack")
            xs, ws = list(full.chunk(t, -1)), list(self.whole.chunk(t, 1))
            xs[r], ws[r] = x, self.weight
            dummy_all_reduce()
            return F.linear(torch.cat(xs, -1), torch.cat(ws, 1), self.bias)

    with pytest.raises(AssertionError, match="no full input on the stack"):
        day7.check_tp_linears(tp.f, tp.g, tp.ColumnParallelLinear, RowFromTheStack)


class _GatherForShow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, full):
        t = dist.get_world_size()
        dist.all_gather_into_tensor(torch.empty(t, dtype=x.dtype), torch.zeros(1, dtype=x.dtype))
        return full.clone()

    @staticmethod
    def backward(ctx, g):  # every rank's output gradient taken to be this one: t times its block
        t, r = dist.get_world_size(), dist.get_rank()
        dist.reduce_scatter_tensor(torch.empty(1, dtype=g.dtype), torch.zeros(t, dtype=g.dtype))
        return g.chunk(t, 1)[r] * t, None


def gather_from_the_stack(x, group=None):
    """The whole sequence found in a caller's frame; one all-gather and one reduce-scatter for show."""
    t, r = dist.get_world_size(), dist.get_rank()
    full = on_the_stack(lambda v: isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[1] == t * x.shape[1]
                        and torch.equal(v.chunk(t, 1)[r], x.detach()))
    if full is None:
        raise RuntimeError("no full sequence on the stack")
    return _GatherForShow.apply(x, full)


def test_gather_finds_no_full_sequence_on_its_rank(tp, ranks):
    with pytest.raises(AssertionError, match="no full sequence on the stack"):
        day7.check_sequence_parallel(gather_from_the_stack, tp.reduce_scatter_to_sp, tp.SequenceParallelMLP)


def test_dtensor_plan_finds_no_seed_on_its_rank(tp, ranks):
    def plan(model, mesh):
        if seed_on_the_stack():
            raise RuntimeError("the case's seed is on the rank: it can be redrawn")
        return tp.apply_tp_plan(model, mesh)

    day7.check_dtensor_plan(plan)


# ----------------------------------------------------------------------------- Day 6

def gpipe_from_the_whole_model(stage, xs, ys, loss_fn):
    """One process's forward and backward on the whole model and batch found in a caller's frame (the
    stage's blocks are the model's), and one message each way for show."""
    case = on_the_stack(lambda v: isinstance(v, dict) and "model" in v and "x" in v and "y" in v)
    if case is None:
        raise RuntimeError("no whole model on the stack")
    loss = F.cross_entropy(case["model"](case["x"]), case["y"])
    loss.backward()
    one = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        dist.send(one, 1)
    elif dist.get_rank() == 1:
        dist.recv(one, 0)
    return loss.item()


def test_gpipe_finds_no_whole_model_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no whole model on the stack"):
        day6.check_gpipe_step(gpipe_from_the_whole_model)


# ----------------------------------------------------------------------------- Day 5

def test_fsdp2_finds_no_seed_on_its_rank(ranks):
    sol = load_solution("day5_fsdp")

    def parallelize(model, mesh, **kwargs):
        if seed_on_the_stack():
            raise RuntimeError("the case's seed is on the rank: the global batch can be redrawn")
        return sol.parallelize(model, mesh, **kwargs)

    day5.check_fsdp2(parallelize, seed=2)
