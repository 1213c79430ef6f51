"""Expert parallelism against the single-process MoE on each rank's tokens (outputs, input and weight
gradients, fp64, odd and unequal token counts, top-1 and top-2, with and without dropping) at 2 and 3
gloo ranks; the all-to-all bytes against the split sizes and the formula; a combine in the wrong order
shown to differ."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dlo.distributed import expert_parallel as ep
from dlo.distributed import launch
from dlo.errors import BadInput
from dlo.measure import CommCounter
from dlo.models.moe import MoE
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
DIM, HIDDEN = 5, 7
CASES = [(1, None), (2, 1.0), (2, 0.5)]  # (top_k, capacity_factor)


def experts(n):
    return 2 * n  # two experts per rank


def full_layer(n, top_k, capacity_factor):
    torch.manual_seed(11)
    return MoE(DIM, HIDDEN, experts(n), top_k=top_k, capacity_factor=capacity_factor).to(D)


def rank_tokens(r):
    """Rank r's tokens: 7 + 2r of them (odd, unequal)."""
    return torch.randn(7 + 2 * r, DIM, generator=torch.Generator().manual_seed(100 + r), dtype=D)


def upstream(r):
    return torch.randn(7 + 2 * r, DIM, generator=torch.Generator().manual_seed(200 + r), dtype=D)


class CombineInArrivalOrder(ep.ExpertParallelMoE):
    """Wrong: the expert-major outputs sent home without undoing the regrouping."""

    def restore_order(self, y, perm):
        return y


def _step(model, r):
    x = rank_tokens(r).requires_grad_(True)
    with CommCounter() as fwd:
        out = model(x)
    with CommCounter() as bwd:
        ((out.y * upstream(r)).sum() + out.aux_loss).backward()
    ep.sync_router_grad(model)
    return x, out, fwd, bwd


def _worker():
    n, r = dist.get_world_size(), dist.get_rank()
    res = {}
    for top_k, cf in CASES:
        model = ep.ExpertParallelMoE(full_layer(n, top_k, cf))
        x, out, fwd, bwd = _step(model, r)
        res[top_k, cf] = {"y": out.y.detach(), "x_grad": x.grad, "kept": out.tokens_per_expert,
                          "grads": {k: p.grad for k, p in model.named_parameters()}, "splits": model.last_splits,
                          "fwd": fwd.records(), "bwd": bwd.records(), "aux": out.aux_loss.detach()}
    wrong = CombineInArrivalOrder(full_layer(n, 2, None))
    res["wrong"] = wrong(rank_tokens(r)).y.detach()
    try:
        ep.ExpertParallelMoE(MoE(DIM, HIDDEN, n + 1))
    except BadInput as e:
        res["bad_degree"] = str(e)
    return res


def reference(n, top_k, cf):
    """The single-process layer on each rank's tokens (one group each), the gradients summed over ranks."""
    layer = full_layer(n, top_k, cf)
    per_rank = []
    for r in range(n):
        x = rank_tokens(r).requires_grad_(True)
        out = layer(x)
        ((out.y * upstream(r)).sum() + out.aux_loss).backward()
        per_rank.append((out.y.detach(), x.grad, out.tokens_per_expert, out.aux_loss.detach()))
    return per_rank, {k: p.grad for k, p in layer.named_parameters()}


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    n = request.param
    return n, launch(_worker, n, backend="gloo")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_equal_to_the_single_process_moe(results):
    n, res = results
    for top_k, cf in CASES:
        per_rank, grads = reference(n, top_k, cf)
        mine = experts(n) // n
        for r, out in enumerate(res):
            got = out[top_k, cf]
            y, x_grad, kept, aux = per_rank[r]
            _close(got["y"], y)
            _close(got["x_grad"], x_grad)
            assert torch.equal(got["kept"], kept)
            _close(got["aux"], aux)
            _close(got["grads"]["router.weight"], grads["router.weight"])
            for w in ("w1", "w3", "w2"):
                _close(got["grads"][w], grads[w][r * mine:(r + 1) * mine])
    assert sum(int(out[2, 0.5]["kept"].sum()) for out in res) < sum(2 * (7 + 2 * r) for r in range(n))  # drops


def test_all_to_all_bytes(results):
    """Forward: the counts exchange (E int64), the dispatch (A rows) and the combine (the rows received);
    backward the two row all-to-alls again. Off-rank rows: what a rank really sends."""
    n, res = results
    row = DIM * 8
    for out in res:
        for case in CASES:
            got = out[case]
            rows_out, rows_in = sum(got["splits"]["in"]), sum(got["splits"]["out"])
            fwd = [rec["bytes"] for rec in got["fwd"] if rec["kind"] == "all_to_all"]
            assert fwd == [experts(n) * 8, rows_out * row, rows_in * row]
            bwd = sorted(rec["bytes"] for rec in got["bwd"] if rec["kind"] == "all_to_all")
            assert bwd == sorted([rows_in * row, rows_out * row])
    # the formula under balanced routing: (N-1)/N of k S rows, twice forward, four times with backward
    assert ep.ep_bytes_per_rank(12, DIM, 2, n, 8) == 2 * (n - 1) / n * 2 * 12 * row
    assert ep.ep_bytes_per_rank(12, DIM, 2, n, 8, backward=True) == 2 * ep.ep_bytes_per_rank(12, DIM, 2, n, 8)


def test_combine_in_the_wrong_order_differs(results):
    n, res = results
    per_rank, _ = reference(n, 2, None)
    assert any(not torch.allclose(out["wrong"], per_rank[r][0], atol=1e-3) for r, out in enumerate(res))


def test_expert_major_order_and_bad_degree():
    counts = torch.tensor([[1, 2], [0, 3]])  # source 0: 1 row for expert 0, 2 for expert 1; source 1: 0, 3
    assert ep.expert_major_order(counts).tolist() == [0, 1, 2, 3, 4, 5]
    counts = torch.tensor([[2, 1], [1, 2]])  # arrival: s0e0 s0e0 s0e1 s1e0 s1e1 s1e1
    assert ep.expert_major_order(counts).tolist() == [0, 1, 3, 2, 4, 5]


def test_experts_not_divisible_by_ranks_refused(results):
    n, res = results
    assert all(f"{n + 1} experts cannot be spread evenly over {n} ranks" in out["bad_degree"] for out in res)
