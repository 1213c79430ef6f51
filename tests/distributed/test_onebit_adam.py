"""1-bit Adam: sign packing, the compressed all-reduce (exact where the values are representable,
error feedback elsewhere, the bytes it sends) and the optimizer (its warm-up is data-parallel AdamW,
every rank keeps the same parameters once it compresses). One 3-rank launch does the distributed part."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo.distributed import launch
from dlo.distributed import onebit_adam as ob
from dlo.measure import CommCounter

CHUNK = 16


def test_signs_pack_into_bytes_and_back():
    x = torch.randn(48, generator=torch.Generator().manual_seed(0))
    x[3] = 0.0  # zero counts as +1
    packed = ob.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 6
    assert torch.equal(ob.unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    bits, scales = ob.compress(x, CHUNK)
    assert torch.allclose(scales, x.view(-1, CHUNK).abs().mean(1))
    want = torch.where(x >= 0, 1.0, -1.0) * scales.repeat_interleave(CHUNK)
    assert torch.equal(ob.decompress(bits, scales, CHUNK), want)
    with pytest.raises(ValueError, match="multiple of 8"):
        ob.pack_signs(torch.ones(12))
    assert ob.padded_size(100, 3, 16) == 144


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _worker(steps: int, warmup: int):
    r, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    # the compressed all-reduce: exact on values it can represent (one magnitude per chunk, the same signs)
    n = 2 * world_size * CHUNK
    signs = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    scale = torch.arange(n // CHUNK, dtype=torch.float32).repeat_interleave(CHUNK) + 1
    x = signs * scale * (r + 1)
    e_w, e_s = torch.zeros(n), torch.zeros(n // world_size)
    with CommCounter() as comm:
        out["exact"] = ob.compressed_allreduce(x, e_w, e_s, CHUNK)
    out["sent"], out["kinds"] = comm.sent(), sorted(comm.by_kind())
    # error feedback: the same random input every step; the running mean of the outputs converges
    x = torch.randn(n, generator=torch.Generator().manual_seed(r))
    e_w, e_s = torch.zeros(n), torch.zeros(n // world_size)
    outs = [ob.compressed_allreduce(x, e_w, e_s, CHUNK) for _ in range(40)]
    out["x"], out["first"], out["mean40"] = x, outs[0], torch.stack(outs).mean(0)
    # the optimizer: warm-up steps, then compressed ones
    model = _model()
    if r != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # rank 0's weights must win the broadcast
    opt = ob.OneBitAdam(model.parameters(), lr=0.05, betas=(0.8, 0.9), weight_decay=0.1, warmup_steps=warmup,
                     chunk=CHUNK)
    params = []
    for step in range(steps):
        x, y = _batch(step, r)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    out["params"] = params
    return out


def _adamw_reference(steps: int, world_size: int):
    """One process, the whole batch (the ranks' equal halves together): torch's AdamW."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-8)
    params = []
    for step in range(steps):
        xs, ys = zip(*(_batch(step, r) for r in range(world_size)))
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def test_compressed_allreduce_and_optimizer_on_three_ranks():
    world_size, steps, warmup = 3, 6, 3
    res = launch(_worker, world_size, steps, warmup, timeout=120)
    xs = torch.stack([r["x"] for r in res])
    n = xs.shape[1]
    for r in res:
        signs = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
        want = signs * (torch.arange(n // CHUNK, dtype=torch.float32).repeat_interleave(CHUNK) + 1) * 2.0  # mean(1,2,3)
        torch.testing.assert_close(r["exact"], want)  # float32 means of small integers: exact up to rounding
        assert torch.equal(r["first"], res[0]["first"])  # every rank decompresses the same vector
        # error feedback: after 40 rounds the mean output is much closer to the true mean than one round
        err1 = (r["first"] - xs.mean(0)).norm() / xs.mean(0).norm()
        err40 = (r["mean40"] - xs.mean(0)).norm() / xs.mean(0).norm()
        assert err40 < 0.2 * err1, (err1, err40)
        # bytes: all-to-all and all-gather of n/8 sign bytes and n/CHUNK fp32 scales, (N-1)/N each way
        assert r["kinds"] == ["all_gather", "all_to_all"]
        assert r["sent"] == pytest.approx(2 * (world_size - 1) / world_size * (n / 8 + 4 * n / CHUNK))
    want = _adamw_reference(steps, world_size)
    for k in range(warmup):  # warm-up: data-parallel AdamW; float32 sums in another order, hence the tolerance
        for got, ref in zip(res[0]["params"][k], want[k]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for k in range(steps):  # compression: every rank applies the same averaged momentum
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["params"][k], res[0]["params"][k]))
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(res[0]["params"][-1], want[-1]))  # 1 bit: not Adam


def test_bad_settings_fail_before_any_communication():
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        ob.OneBitAdam([nn.Parameter(torch.ones(3))], warmup_steps=0)
