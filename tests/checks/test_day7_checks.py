"""The Day 7 checks accept the solution notebook's code and reject the slips students make.

The reference solutions are the notebook's own solution cells (executed here from
solutions/day7_tensor_parallel), so these tests prove what the grader will see. Each exercise gets
its solution and one or two typical mistakes: a missing or doubled collective, a wrong shard, a
replicated norm, a gathered logit, a plan without sequence parallelism, a forbidden library call.
The checks' ranks come from one pool of 2 ranks kept alive across tests (`tests.rank_pool`: a launch
costs seconds of interpreter start-up); the stub test goes through a real launch per check, as the
notebook does, and the forbidden-library test comes last since a failure on a rank ends the pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks import day7
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def sol():
    return load_solution("day7_tensor_parallel")


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- 1. f, g and the layers

def test_linears_accept(sol, ranks):
    day7.check_tp_linears(sol.f, sol.g, sol.ColumnParallelLinear, sol.RowParallelLinear, seed=2)


def test_linears_reject_f_without_all_reduce(sol, ranks):
    def f_identity(x, group=None):  # forgets f's backward: each rank keeps its partial gradient
        return x * 1.0
    with pytest.raises(AssertionError, match="f: input gradient on rank 0"):
        day7.check_tp_linears(f_identity, sol.g, sol.ColumnParallelLinear, sol.RowParallelLinear)




# ----------------------------------------------------------------------------- 2. SwiGLU

def test_swiglu_accept(sol, ranks):
    day7.check_tp_swiglu(sol.TensorParallelSwiGLU, seed=3)


def test_swiglu_rejects_two_fs(sol, ranks):
    class TwoFs(sol.TensorParallelSwiGLU):
        def forward(self, x):  # right numbers, but backward all-reduces the input gradient twice
            a, b = self.w1(sol.f(x, self.group)), self.w3(sol.f(x, self.group))
            return sol.g(self.w2(F.silu(a) * b), self.group)
    with pytest.raises(AssertionError, match="two all-reduces mean w1 and w3"):
        day7.check_tp_swiglu(TwoFs)


# ----------------------------------------------------------------------------- 3. attention

def test_attention_accept(sol, ranks):
    day7.check_tp_attention(sol.TensorParallelAttention, seed=2)


def test_attention_rejects_interleaved_heads(sol, ranks):
    class Interleaved(sol.TensorParallelAttention):
        def __init__(self, attention, group=None):  # rank r takes every t-th row: not whole heads
            super().__init__(attention, group)
            t, r = dist.get_world_size(group), dist.get_rank(group)
            with torch.no_grad():
                for name in ("wq", "wk", "wv"):
                    getattr(self, name).weight.copy_(getattr(attention, name).weight[r::t])
    with pytest.raises(AssertionError, match="tp_attention: output differs"):
        day7.check_tp_attention(Interleaved)


# ----------------------------------------------------------------------------- 4. sequence parallelism

def test_sequence_parallel_accept(sol, ranks):
    day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, sol.SequenceParallelMLP, seed=2)


def test_sequence_parallel_rejects_a_replicated_norm(sol, ranks):
    class NormAfterGather(sol.SequenceParallelMLP):
        def forward(self, x):  # right values, but the norm saves all T tokens on every rank
            h = self.norm(sol.gather_from_sp(x, self.group))
            return x + sol.reduce_scatter_to_sp(self.w2(F.silu(self.w1(h)) * self.w3(h)), self.group)
    with pytest.raises(AssertionError, match="run the norm on the shard"):
        day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, NormAfterGather)


# ----------------------------------------------------------------------------- 5. cross-entropy

def test_vocab_ce_accept(sol, ranks):
    day7.check_vocab_parallel_cross_entropy(sol.vocab_parallel_cross_entropy, seed=2)


def test_vocab_ce_rejects_gathered_logits(sol, ranks):
    def gathered(logits, target, group=None):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.detach(), group=group)
        full = torch.cat(parts, -1)
        full.requires_grad_(True)
        return F.cross_entropy(full, target)
    with pytest.raises(AssertionError, match="gathering the logits"):
        day7.check_vocab_parallel_cross_entropy(gathered)


# ----------------------------------------------------------------------------- 6. DTensor plan

def test_dtensor_plan_accept(sol, ranks):
    day7.check_dtensor_plan(sol.apply_tp_plan, seed=2)


def test_dtensor_plan_rejects_plain_tensor_parallelism(sol, ranks):
    def no_sequence_parallel(model, tp_mesh):  # right numbers, all-reduces instead of RS/AG, norms replicated
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        model.tie_weights()
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()})
        return model
    with pytest.raises(AssertionError, match="forward \\(CommDebugMode\\)"):
        day7.check_dtensor_plan(no_sequence_parallel)


def test_a_stub_fails():
    """The released notebook's stubs raise NotImplementedError; the rank's error comes back as the
    check's AssertionError (every test cell of the untouched release scoring 0 is `dlo grade`'s test)."""
    with pytest.raises(AssertionError, match="NotImplementedError"):
        day7.check_vocab_parallel_cross_entropy(stub)


def test_linears_reject_the_library(sol, ranks):
    """Last: the forbidden call fails on the ranks, which ends the pool."""
    class Borrowed(torch.nn.Module):
        def __init__(self, linear, group=None, gather_output=False):
            super().__init__()
            from dlo.distributed import tensor_parallel
            self.inner = tensor_parallel.ColumnParallelLinear(linear, group, gather_output=gather_output)
    with pytest.raises(AssertionError, match="off limits"):
        day7.check_tp_linears(sol.f, sol.g, Borrowed, sol.RowParallelLinear)
