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

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def test_sequence_parallel_rejects_two_shards_more_saved(sol, ranks):
    with pytest.raises(AssertionError, match="saved .* bytes for backward"):
        day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, saves_two_shards_more(sol, False))


def test_sequence_parallel_rejects_a_replicated_norm(sol, ranks):
    class NormAfterGather(sol.SequenceParallelMLP):
        def forward(self, x):  # right values, but the norm saves all T tokens on every rank
            h = self.norm(sol.gather_from_sp(x, self.group))
            return x + sol.reduce_scatter_to_sp(self.w2(F.silu(self.w1(h)) * self.w3(h)), self.group)
    with pytest.raises(AssertionError, match="run the norm on the shard"):
        day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, NormAfterGather)


def test_sequence_parallel_rejects_a_norm_gradient_reduced_after_accumulation(sol, ranks):
    class ReducedAccumulated(sol.SequenceParallelMLP):
        def __init__(self, norm, ffn, group=None):  # whole after one backward; after two, the first part t times
            nn.Module.__init__(self)
            self.norm, self.group = norm, group
            self.w1, self.w3 = sol.shard_linear(ffn.w1, 0, group), sol.shard_linear(ffn.w3, 0, group)
            self.w2 = sol.shard_linear(ffn.w2, 1, group)
            norm.weight.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad, group=group))
    with pytest.raises(AssertionError, match="after a second backward without zero_grad"):
        day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, ReducedAccumulated)


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
    with pytest.raises(AssertionError, match="forward \\(the grader's count\\)"):
        day7.check_dtensor_plan(no_sequence_parallel)


# ----------------------------------------------------------------------------- red team: collectives for show
# Each passed its check at seeds 0..9 before the check held what the collectives carry: every rank
# rebuilds the whole weights (or the whole input) through the collectives the exercise allows, computes
# the whole layer and sends the right number of collectives; or moves the logits outside the counter.

def for_show():
    """The cheats' tools, made here: a rank unpickles them by value (this module does not import there)."""
    class AllReduceForShow(torch.autograd.Function):
        """Identity forward; backward all-reduces a gradient every rank already has whole, then divides by t."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad / dist.get_world_size()

    class WholeWeights(torch.autograd.Function):
        """This rank's blocks (split along `dims`) -> the whole tensors, by one all-reduce of the zero-padded blocks."""

        @staticmethod
        def forward(ctx, dims, *blocks):
            r, ctx.dims = dist.get_rank(), dims
            whole = []
            for b, d in zip(blocks, dims):
                shape = list(b.shape)
                shape[d] *= dist.get_world_size()
                whole.append(b.new_zeros(shape))
                whole[-1].narrow(d, r * b.shape[d], b.shape[d]).copy_(b)
            flat = torch.cat([w.flatten() for w in whole])
            dist.all_reduce(flat)
            return tuple(part.view_as(w).clone() for part, w in zip(flat.split([w.numel() for w in whole]), whole))

        @staticmethod
        def backward(ctx, *grads):
            t, r = dist.get_world_size(), dist.get_rank()
            return (None,) + tuple(g.chunk(t, d)[r].contiguous() for g, d in zip(grads, ctx.dims))

    def emm(a, w):  # a @ w.T as a broadcast product and a sum: no matmul for FlopCounterMode to count
        return (a.unsqueeze(-2) * w).sum(-1)

    return AllReduceForShow, WholeWeights, emm


def whole_column(sol):
    show = for_show()[0]

    class WholeColumn(sol.ColumnParallelLinear):
        def forward(self, x):  # gather_output=True: all-gathers [W_r | b_r], not the output
            if not self.gather_output:
                return super().forward(x)
            wb = torch.cat([self.weight, self.bias[:, None]], 1)
            parts = [torch.empty_like(wb) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, wb.detach().contiguous())
            parts[dist.get_rank()] = wb  # its own rows keep their gradient
            whole = torch.cat(parts, 0)
            return F.linear(show.apply(x), whole[:, :-1], whole[:, -1])
    return WholeColumn


def whole_row(sol):
    whole_weights = for_show()[1]

    class WholeRow(sol.RowParallelLinear):
        def forward(self, x):  # one all-reduce of [input block | weight block], zero-padded
            whole_x, whole_w = whole_weights.apply((x.dim() - 1, 1), x, self.weight)
            return F.linear(whole_x, whole_w, self.bias)
    return WholeRow


def whole_swiglu(sol):
    show, whole_weights, emm = for_show()

    class WholeSwiGLU(sol.TensorParallelSwiGLU):
        def forward(self, x):
            w1, w3, w2 = whole_weights.apply((0, 0, 1), self.w1.weight, self.w3.weight, self.w2.weight)
            x = show.apply(x)
            return emm(F.silu(emm(x, w1)) * emm(x, w3), w2)
    return WholeSwiGLU


def whole_attention(sol):
    show, whole_weights, emm = for_show()

    class WholeAttention(sol.TensorParallelAttention):
        def forward(self, x, cos, sin):
            import types

            ws = whole_weights.apply((0, 0, 0, 1), self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)
            whole = types.SimpleNamespace(head_dim=self.head_dim, **{
                n: (lambda z, w=w: emm(z, w)) for n, w in zip(("wq", "wk", "wv", "wo"), ws)})
            return sol.Attention.forward(whole, show.apply(x), cos, sin)
    return WholeAttention


def whole_norm(sol):
    class NormOnEveryToken(sol.SequenceParallelMLP):
        def forward(self, x):  # all-gathers the raw input; the norm's input kept where no meter looks
            h = sol.gather_from_sp(x, self.group)
            self.kept = h.detach()
            h = self.norm(h)
            return x + sol.reduce_scatter_to_sp(self.w2(F.silu(self.w1(h)) * self.w3(h)), self.group)
    return NormOnEveryToken


def saves_two_shards_more(sol, hidden: bool):
    """The solution's block that also saves two tensors of its shard's size (2x and its sine, for a cosine added
    times 0): more than the budget's slack beside the norm's and the MLP's own (half of what the norm on every
    token adds); `hidden`: under an identity hook pair, where PyTorch applies only the innermost pair and the
    grader's meter, were it an ordinary pair, would see nothing."""
    class TwoShardsMore(sol.SequenceParallelMLP):
        def forward(self, x):
            def run():
                return super(TwoShardsMore, self).forward(x) + 0 * (2 * x).sin().cos()
            if not hidden:
                return run()
            with torch.autograd.graph.saved_tensors_hooks(lambda z: z, lambda z: z):
                return run()
    return TwoShardsMore


def ce_by_columns():
    def ce(logits, target, group=None):
        """The whole logits through many all-reduces of at most 4 N doubles each, then F.cross_entropy."""
        t, r = dist.get_world_size(group), dist.get_rank(group)
        pad = (r * logits.shape[1], (t - r - 1) * logits.shape[1])
        pieces = [p.contiguous().clone() for p in F.pad(logits.detach(), pad).split(4, 1)]
        for p in pieces:
            dist.all_reduce(p, group=group)
        whole = torch.cat(pieces, 1) - F.pad(logits.detach(), pad) + F.pad(logits, pad)
        return F.cross_entropy(whole, target)
    return ce


def ce_below_the_dispatcher():
    def ce(logits, target, group=None):
        """The whole logits all-gathered by the gloo backend object itself, where no dispatch mode sees it."""
        t, r = dist.get_world_size(group), dist.get_rank(group)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        parts = [torch.empty_like(logits) for _ in range(t)]
        backend.allgather([parts], [logits.detach().contiguous()]).wait()
        pad = (r * logits.shape[1], (t - r - 1) * logits.shape[1])
        return F.cross_entropy(torch.cat(parts, 1) - F.pad(logits.detach(), pad) + F.pad(logits, pad), target)
    return ce


RED_TEAM = [
    ("linears: all-gathers the weights", lambda sol: (day7.check_tp_linears, (
        sol.f, sol.g, whole_column(sol), sol.RowParallelLinear)),
     "ColumnParallelLinear: the forward all-gather carried"),
    ("linears: all-reduces input and weights", lambda sol: (day7.check_tp_linears, (
        sol.f, sol.g, sol.ColumnParallelLinear, whole_row(sol))), "RowParallelLinear: the forward all-reduce carried"),
    ("swiglu: whole weights", lambda sol: (day7.check_tp_swiglu, (whole_swiglu(sol),)),
     "tp_swiglu: the forward all-reduce carried"),
    ("attention: whole weights", lambda sol: (day7.check_tp_attention, (whole_attention(sol),)),
     "tp_attention: the forward all-reduce carried"),
    ("sequence parallel: the norm on every token", lambda sol: (day7.check_sequence_parallel, (
        sol.gather_from_sp, sol.reduce_scatter_to_sp, whole_norm(sol))), "is not norm(x) of its sequence shard"),
    ("cross-entropy: logits by small all-reduces", lambda sol: (day7.check_vocab_parallel_cross_entropy, (
        ce_by_columns(),)), "moving the logits through all-reduces"),
]


@pytest.mark.parametrize("case", RED_TEAM, ids=[c[0] for c in RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_collectives_for_show_fail(sol, ranks, case, seed):
    """Red team (Day 7): each passed its check at seeds 0..9 before the collectives' contents were held."""
    _, build, phrase = case
    check, args = build(sol)
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(*args, seed=seed)


def test_a_gradient_all_reduced_for_show_fails():
    """The cheats above also all-reduce, in backward, the input gradient every rank computed whole (then divide
    by t): what the ranks sent sums to t times the gradient (the forward's payload fails first in the checks)."""
    from dlo.checks.day7_comms import SUMS_GRAD, expect_sum

    dx = torch.randn(3, 5, 7, dtype=torch.float64)
    expect_sum("tp_swiglu", "the backward all-reduce", [dx / 2, dx / 2], [dx], "the input gradient", SUMS_GRAD, {})
    with pytest.raises(AssertionError, match="a gradient already whole on every rank sums to t times it"):
        expect_sum("tp_swiglu", "the backward all-reduce", [dx, dx], [dx], "the input gradient", SUMS_GRAD, {})


@pytest.mark.parametrize("seed", [0, 3])
def test_bytes_sent_below_the_dispatcher_fail(seed):
    """Red team (Day 7): a gather by the backend object is not counted on the rank; its sockets count it (a real
    launch: the tests' pooled ranks are not metered)."""
    with pytest.raises(AssertionError, match="vocab_parallel_cross_entropy: the ranks' sockets sent"):
        day7.check_vocab_parallel_cross_entropy(ce_below_the_dispatcher(), seed=seed)


def test_a_stub_fails():
    """The released notebook's stubs raise NotImplementedError; the rank's error comes back as the
    check's AssertionError (every test cell of the untouched release scoring 0 is `dlo grade`'s test)."""
    with pytest.raises(AssertionError, match="NotImplementedError"):
        day7.check_vocab_parallel_cross_entropy(stub)


@pytest.mark.trust
def test_saved_tensor_hooks_are_forbidden_in_sequence_parallel(sol):
    """Red team (Day 7): the block above, its saved tensors under its own identity hook pair, passed the saved-bytes
    rule (the grader's meter saw nothing of the forward). Its own ranks: a forbidden call ends a pool."""
    with pytest.raises(AssertionError, match="off limits"):
        day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, saves_two_shards_more(sol, True))


# ----------------------------------------------------------------------------- red team: torch's DTensor, 2026-12-03
# DTensor places the collectives and writes their backward: each passed its check on real collectives (20/20 on Day
# 7 with the exercise 6 plan below). Real launches: a forbidden call on a rank ends the tests' pool.

def dtensor_cheats():
    """The red team's exercises 1-5 on DTensor (made here: a rank unpickles them by value)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def mesh(group):
        return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")

    def f(x, group=None):
        return DTensor.from_local(x, mesh(group), [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def g(x, group=None):
        m = mesh(group)
        return DTensor.from_local(x, m, [Partial()], run_check=False).redistribute(m, [Replicate()]).to_local()

    def gather_sp(x, group=None):
        m = mesh(group)
        return DTensor.from_local(x, m, [Shard(1)], run_check=False).redistribute(m, [Replicate()]).to_local(
            grad_placements=[Partial()])

    def scatter_sp(x, group=None):
        m = mesh(group)
        return DTensor.from_local(x, m, [Partial()], run_check=False).redistribute(m, [Shard(1)]).to_local()

    def ce(logits, target, group=None):
        m, r, vt = mesh(group), dist.get_rank(group), logits.shape[-1]
        z = DTensor.from_local(logits, m, [Shard(1)], run_check=False)
        z = z - z.detach().amax(dim=-1, keepdim=True).redistribute(m, [Replicate()])
        s = z.exp().sum(-1).redistribute(m, [Replicate()])
        local = target - r * vt
        hit = (local >= 0) & (local < vt)
        onehot = torch.zeros_like(logits)
        onehot[hit.nonzero().squeeze(-1), local[hit]] = 1.0
        zt = (z * DTensor.from_local(onehot, m, [Shard(1)], run_check=False)).sum(-1).redistribute(m, [Replicate()])
        return (s.log() - zt).to_local().mean()

    return f, g, gather_sp, scatter_sp, ce


def dtensor_swiglu(sol):
    f, g = dtensor_cheats()[:2]

    class DTensorSwiGLU(sol.TensorParallelSwiGLU):
        def forward(self, x):
            x = f(x, self.group)
            return g(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.group)
    return DTensorSwiGLU


def library_f_g_swiglu(sol):
    class LibraryFG(sol.TensorParallelSwiGLU):
        def forward(self, x):  # the course's own f and g (dlo.distributed.tp_comms)
            from dlo.distributed.tp_comms import copy_to_tp, reduce_from_tp
            x = copy_to_tp(x, self.group)
            return reduce_from_tp(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.group)
    return LibraryFG


def dtensor_attention(sol):
    f, g = dtensor_cheats()[:2]

    class DTensorAttention(sol.TensorParallelAttention):
        def forward(self, x, cos, sin):
            return g(sol.Attention.forward(self, f(x, self.group), cos, sin), self.group)
    return DTensorAttention


def dtensor_sequence_parallel(sol):
    gather_sp, scatter_sp = dtensor_cheats()[2:4]

    class DTensorSP(sol.SequenceParallelMLP):
        def forward(self, x):
            h = gather_sp(self.norm(x), self.group)
            return x + scatter_sp(self.w2(F.silu(self.w1(h)) * self.w3(h)), self.group)
    return gather_sp, scatter_sp, DTensorSP


FORBIDDEN_HOLDERS = [
    ("linears: DTensor's f and g", lambda sol: (day7.check_tp_linears, (
        *dtensor_cheats()[:2], sol.ColumnParallelLinear, sol.RowParallelLinear)), "_c10d_functional::all_reduce"),
    ("swiglu: DTensor's f and g", lambda sol: (day7.check_tp_swiglu, (dtensor_swiglu(sol),)),
     "_c10d_functional::all_reduce"),
    ("swiglu: the library's f and g", lambda sol: (day7.check_tp_swiglu, (library_f_g_swiglu(sol),)),
     "dlo.distributed.tp_comms.copy_to_tp"),
    ("attention: DTensor's f and g", lambda sol: (day7.check_tp_attention, (dtensor_attention(sol),)),
     "_c10d_functional::all_reduce"),
    ("sequence parallel: DTensor's redistributes", lambda sol: (day7.check_sequence_parallel,
                                                                 dtensor_sequence_parallel(sol)),
     "_c10d_functional::all_gather_into_tensor"),
    ("cross-entropy: DTensor's reductions", lambda sol: (day7.check_vocab_parallel_cross_entropy,
                                                         (dtensor_cheats()[4],)), "_c10d_functional::all_reduce"),
]


@pytest.mark.parametrize("case", FORBIDDEN_HOLDERS, ids=[c[0] for c in FORBIDDEN_HOLDERS])
def test_dtensor_and_the_library_f_g_are_forbidden(sol, case):
    """Red team (Day 7, 2026-12-03): each passed its check (the DTensor ones on real collectives, their counts and
    payloads right). Honest code's collectives are torch.distributed's, `c10d::` operators: the accept tests."""
    _, build, phrase = case
    check, args = build(sol)
    with pytest.raises(AssertionError, match=re.escape(phrase) + " is off limits"):
        check(*args)


def test_dtensor_plan_counts_are_the_graders():
    """Red team (Day 7, 2026-12-03): plain Megatron TP, no sequence parallelism, with CommDebugMode's
    get_comm_counts patched to return torchtitan's counts: loss, gradients and shards right, 3/3. The grader counts
    (and reads what the all-gathers carried) itself. A real launch: the patch would outlive the test on pooled ranks."""
    def patched(model, tp_mesh):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.debug import CommDebugMode
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
        L, calls = len(model.layers), []
        fwd = {"all_gather_into_tensor": 2 * L + 1, "reduce_scatter_tensor": 2 * L + 1, "all_reduce": 3}
        bwd = {"all_gather_into_tensor": 2 * L + 1, "reduce_scatter_tensor": 2 * L + 1}

        def get_comm_counts(self):
            calls.append(1)
            return dict(fwd if len(calls) % 2 == 1 else bwd)
        CommDebugMode.get_comm_counts = get_comm_counts
        return model
    with pytest.raises(AssertionError, match="forward \\(the grader's count\\): collectives \\{'all_reduce'"):
        day7.check_dtensor_plan(patched)


def test_linears_reject_the_library(sol, ranks):
    """Last: the forbidden call fails on the ranks, which ends the pool."""
    class Borrowed(torch.nn.Module):
        def __init__(self, linear, group=None, gather_output=False):
            super().__init__()
            from dlo.distributed import tensor_parallel
            self.inner = tensor_parallel.ColumnParallelLinear(linear, group, gather_output=gather_output)
    with pytest.raises(AssertionError, match="off limits"):
        day7.check_tp_linears(sol.f, sol.g, Borrowed, sol.RowParallelLinear)
