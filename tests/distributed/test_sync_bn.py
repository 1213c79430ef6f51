"""SyncBatchNorm vs nn.BatchNorm on the concatenated global batch, without a process group, and
convert_sync_batchnorm. One launch of 3 ranks with unequal batches runs every multi-process check:
once over the world (3 ranks) and once over the subgroup of ranks 0 and 1 (2 ranks)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo.distributed import launch
from dlo.distributed.sync_bn import SyncBatchNorm, convert_sync_batchnorm
from dlo.measure import CommCounter

SIZES, C, STEPS = (2, 3, 5), 4, 2  # per-rank batch sizes (unequal on purpose), channels, train steps
CASES = {  # layer, trailing dims of (N, C, *), hyper-parameters
    "1d": (nn.BatchNorm1d, (), dict(momentum=0.1)),
    "1d_len": (nn.BatchNorm1d, (6,), dict(momentum=0.3, affine=False)),
    "2d": (nn.BatchNorm2d, (3, 5), dict(momentum=None)),  # cumulative average of the statistics
}
GROUPS = {"world": [0, 1, 2], "pair": [0, 1]}


def _bn(kind, sync=False, group=None):
    cls, _, kwargs = CASES[kind]
    torch.manual_seed(0)
    bn = cls(C, **kwargs).double()
    if bn.affine:  # away from the (1, 0) init, so that a mix-up of weight and bias shows
        with torch.no_grad():
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.normal_()
    return convert_sync_batchnorm(bn, group) if sync else bn


def _data(kind, step, n):
    """Global batch of n samples: input x (mean 3, std 2: a mean that matters) and loss weights w."""
    g = torch.Generator().manual_seed(100 * step + list(CASES).index(kind))
    shape = (n, C, *CASES[kind][1])
    x = 3 + 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return x, torch.randn(shape, generator=g, dtype=torch.float64)


def _rows(members, r):
    lo = sum(SIZES[m] for m in members if m < r)
    return slice(lo, lo + SIZES[r])


def _step(bn, x, w):
    """loss = (w * y).sum(); returns y, dx and the parameter gradients."""
    x = x.clone().requires_grad_()
    y = bn(x)
    (w * y).sum().backward()
    grads = [p.grad.clone() for p in bn.parameters()]
    bn.zero_grad()
    return y.detach(), x.grad, grads


def _worker():
    r = dist.get_rank()
    pair = dist.new_group(GROUPS["pair"])  # every rank calls new_group, members or not
    out = {}
    for name, group in (("world", None), ("pair", pair)):
        members = GROUPS[name]
        if r not in members:
            continue
        n, rows = sum(SIZES[m] for m in members), _rows(members, r)
        for kind in CASES:
            bn = _bn(kind, sync=True, group=group)
            steps = []
            for s in range(STEPS):
                x, w = _data(kind, s, n)
                with CommCounter() as rec:
                    steps.append((*_step(bn, x[rows], w[rows]), rec.count()))
            buffers = [b.clone() for b in bn.buffers()]
            bn.eval()
            with CommCounter() as rec:
                y_eval = bn(_data(kind, STEPS, n)[0][rows])
            out[name, kind] = steps, buffers, y_eval, rec.count()
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_worker, len(SIZES), timeout=60)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("name", GROUPS)
def test_matches_batchnorm_on_the_global_batch(ranks, name, kind):
    members = GROUPS[name]
    n = sum(SIZES[m] for m in members)
    ref = _bn(kind)
    close = dict(rtol=0, atol=1e-10)  # float64, only the summation order differs
    for s in range(STEPS):
        x, w = _data(kind, s, n)
        y, dx, grads = _step(ref, x, w)
        for r in members:
            got_y, got_dx, _, n_calls = ranks[r][name, kind][0][s]
            torch.testing.assert_close(got_y, y[_rows(members, r)], **close)
            torch.testing.assert_close(got_dx, dx[_rows(members, r)], **close)
            assert n_calls == 2, "expected one all-reduce in forward and one in backward"
        for i, g in enumerate(grads):  # local parameter gradients sum to the global ones
            torch.testing.assert_close(sum(ranks[r][name, kind][0][s][2][i] for r in members), g, **close)
    ref.eval()
    y_eval = ref(_data(kind, STEPS, n)[0])
    for r in members:
        _, buffers, got_eval, n_calls = ranks[r][name, kind]
        for got, want in zip(buffers, ref.buffers()):
            torch.testing.assert_close(got, want, **close)
        torch.testing.assert_close(got_eval, y_eval[_rows(members, r)], **close)
        assert n_calls == 0, "eval mode must not communicate"


@pytest.mark.parametrize("kind", CASES)
def test_without_process_group_is_batchnorm(kind):
    ref, ours = _bn(kind), _bn(kind, sync=True)
    assert isinstance(ours, SyncBatchNorm)
    for s, train in enumerate((True, True, False)):
        ref.train(train), ours.train(train)
        x, w = _data(kind, s, 7)
        for got, want in zip(_step(ours, x, w), _step(ref, x, w)):
            got, want = (got, want) if isinstance(got, list) else ([got], [want])
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(ours.buffers(), ref.buffers()))
    with pytest.raises(ValueError, match=r"\(N, C, \*\)"):
        ours(torch.zeros(C, dtype=torch.float64))


def test_convert_replaces_nested_batchnorm_and_keeps_state():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=0.2), nn.ReLU(),
                        nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.BatchNorm1d(5, affine=False)))
    x = torch.randn(6, 3, 4, 4)
    for _ in range(2):  # non-trivial running statistics and num_batches_tracked
        net(x)
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 2.0)
    net.eval()
    want, state, params = net(x), {k: v.clone() for k, v in net.state_dict().items()}, list(net.parameters())
    out = convert_sync_batchnorm(net)
    assert out is net and isinstance(out[1], SyncBatchNorm) and isinstance(out[3][2], SyncBatchNorm)
    assert not any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) for m in out.modules())
    assert (out[1].eps, out[1].momentum, out[3][2].affine, out[1].training) == (1e-3, 0.2, False, False)
    assert all(a is b for a, b in zip(out.parameters(), params)) and len(list(out.parameters())) == len(params)
    assert state.keys() == out.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in out.state_dict().items())
    assert torch.equal(out(x), want)
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm3d(2)), SyncBatchNorm)
