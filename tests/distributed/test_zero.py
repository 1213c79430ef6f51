"""dlo.distributed.zero and zero_comms: the flat partition, the accountant against the paper's
numbers, the bytes each engine holds at several world sizes (fake process group, in this process),
and one launch of 3 ranks where every engine trains like one process on the whole batch and sends
the paper's 2 Psi / 3 Psi."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from dlo.checks.day5_zero import batch, case, lm_loss, reference, seen_parameters, tied_lm
from dlo.distributed import launch
from dlo.distributed.ddp import DataParallelBucket
from dlo.distributed.zero import ZeRO1, ZeRO2, ZeRO3, memory_per_rank
from dlo.distributed.zero_comms import FlatBuffer, shard_numel
from dlo.measure import CommCounter, held_bytes
from dlo.plan import fake_world
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

LLAMA_3B = 3_212_749_824



pytestmark = pytest.mark.usefixtures("one_thread")

def test_flat_buffer_pads_binds_and_frees():
    a, b = torch.nn.Parameter(torch.arange(6.0).view(2, 3)), torch.nn.Parameter(torch.tensor([7.0, 8.0]))
    flat = FlatBuffer([a, b], world_size=3)
    assert (flat.numel, flat.shard_numel, flat.data.numel()) == (8, 3, 9)
    assert flat.shard(2).tolist() == [7.0, 8.0, 0.0] and flat.shard(0).tolist() == [0.0, 1.0, 2.0]  # padding last
    with torch.no_grad():
        flat.data.add_(1)
    assert b.tolist() == [8.0, 9.0] and a.data_ptr() == flat.data.data_ptr()  # the parameters are views
    grads = FlatBuffer([a, b], world_size=3, bind=False)
    assert grads.view(1).shape == b.shape and grads.data.abs().sum() == 0 and b.tolist() == [8.0, 9.0]
    flat.free()
    assert not flat.allocated and held_bytes(a, b) == 0
    flat.alloc()
    assert flat.allocated and held_bytes(a) == 9 * 4
    assert [shard_numel(n, w) for n, w in ((7, 2), (8, 2), (1, 4))] == [4, 4, 1]
    with pytest.raises(ValueError, match="no tensors"):
        FlatBuffer([], world_size=2)


def test_accountant_gives_the_papers_numbers():
    ddp = memory_per_rank(LLAMA_3B, 8, 0)
    assert ddp["total"] == 16 * LLAMA_3B and round(ddp["total"] / 1e9, 1) == 51.4  # 2 + 2 + 12 bytes
    per_rank = [memory_per_rank(LLAMA_3B, 8, s)["total"] / 1e9 for s in (1, 2, 3)]
    assert [round(x, 1) for x in per_rank] == [17.7, 12.0, 6.4]  # 4P + 12P/N, 2P + 14P/N, 16P/N
    assert memory_per_rank(LLAMA_3B, 8, 3)["total"] / 2 ** 30 == pytest.approx(5.98, abs=0.01)
    assert memory_per_rank(10, 4, 3, param_dtype=torch.float32)["total"] == 16 * 3  # ceil(10 / 4) = 3
    assert memory_per_rank(10, 1, 0, param_dtype=torch.float32, optimizer="sgd")["total"] == 80
    assert memory_per_rank(10, 1, 0, param_dtype=torch.float16, optimizer="sgd_momentum")["optimizer"] == 80
    with pytest.raises(ValueError, match="stage"):
        memory_per_rank(10, 2, 4)
    with pytest.raises(ValueError, match="optimizer"):
        memory_per_rank(10, 2, 1, optimizer="lion")


def _engine(stage, model, opt=torch.optim.AdamW, lr=1e-2, **kw):
    if stage == 1:
        return ZeRO1(model, opt, lr=lr, **kw)
    if stage == 2:
        return ZeRO2(model, opt, bucket_cap_mb=1e-3, lr=lr, **kw)  # 131 doubles: many buckets
    return ZeRO3(model, opt, units=list(model.blocks), lr=lr, **kw)


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_engines_hold_what_the_accountant_says(world_size):
    c = case(4)
    psi, tensors = sum(p.numel() for p in tied_lm(c, 0).parameters()), len(list(tied_lm(c, 0).parameters()))
    with fake_world(world_size):
        for stage in (1, 2, 3):
            engine = _engine(stage, tied_lm(c, 0))
            lm_loss(engine, *batch(c, 0, 0, 2)).backward()
            engine.step()
            want = memory_per_rank(psi, world_size, stage, param_dtype=torch.float64)["total"]
            # beyond the formula: N-1 padding elements per flat buffer (parameters, gradients, two
            # moments; one buffer per tensor at most) and AdamW's 4-byte step counter per shard
            assert want <= held_bytes(engine) <= want + 8 * 4 * (world_size - 1) * tensors + 4 * tensors, stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # 0: bucketed DDP, the same gradient hooks
def test_a_discarded_engine_is_collected(stage):
    """A parameter keeps its post-accumulate-grad hooks on torch's C++ side, out of the collector's sight:
    an engine that hooked its own bound method would outlive its last reference, with its buffers and
    optimizer state (on a GPU, one more model state for each engine an experiment builds: Day 5's table)."""
    c = case(4)
    with fake_world(2):
        model = tied_lm(c, 0)
        engine = DataParallelBucket(model, bucket_cap_mb=1e-3) if stage == 0 else _engine(stage, model)
        lm_loss(engine, *batch(c, 0, 0, 2)).backward()
        if stage:
            engine.step()
        gone = weakref.ref(engine)
        del engine, model
        gc.collect()
        assert gone() is None


def test_engines_refuse_bad_input():
    model = tied_lm(case(0), 0)
    with pytest.raises(RuntimeError, match="no process group"):
        ZeRO1(model)
    with fake_world(2):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            ZeRO2(model, bucket_cap_mb=0)


def _train_worker(seed):
    r, n = dist.get_rank(), dist.get_world_size()
    c = case(seed)
    variants = {"ZeRO-1": (1, {}), "ZeRO-2": (2, {}), "ZeRO-3": (3, {}), "ZeRO-3 prefetch": (3, {"prefetch": True}),
                "ZeRO-3 no reshard": (3, {"reshard_after_forward": False})}
    optimizers = {"sgd": (torch.optim.SGD, {"lr": c["sgd_lr"]}, 1),
                  "adamw": (torch.optim.AdamW, {"lr": c["lr"], "weight_decay": c["weight_decay"]}, 3)}
    out = {}
    for name, (stage, kw) in variants.items():
        for kind, (opt, okw, steps) in optimizers.items():
            model = tied_lm(c, seed + 1 + r)  # every rank its own weights: rank 0's must win
            engine = _engine(stage, model, opt, **okw, **kw)
            for s in range(steps):
                x, y = batch(c, seed, s, n * c["per_rank"])
                with CommCounter() as comm:
                    lm_loss(engine, x[r::n], y[r::n]).backward()
                    engine.step()
                engine.zero_grad()
            seen = seen_parameters(model, lambda e=engine, t=x[:1]: e(t))
            out[(name, kind)] = {"params": seen, "sent": comm.sent(), "kinds": comm.by_kind()}
    dist.barrier()
    return out


def test_engines_train_like_one_process_and_send_the_papers_bytes():
    seed, n = 5, 3
    c = case(seed)
    psi = sum(p.numel() for p in tied_lm(c, 0).parameters())
    res = launch(_train_worker, n, seed, backend="gloo", timeout=120)
    refs = {"sgd": reference(c, seed, "sgd", 1, n), "adamw": reference(c, seed, "adamw", 3, n)}
    factor = {"ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3, "ZeRO-3 prefetch": 3, "ZeRO-3 no reshard": 2}
    for rank_out in res:
        for (name, kind), got in rank_out.items():
            for key, want in refs[kind].items():
                torch.testing.assert_close(got["params"][key], want, rtol=1e-12, atol=1e-12, msg=f"{name} {kind} {key}")
            unit = 8 * psi * (n - 1) / n  # ring model: (N-1)/N of the payload per collective
            assert got["sent"] / unit == pytest.approx(factor[name], rel=0.03), name
            assert "all_reduce" not in got["kinds"], name
    assert res[0][("ZeRO-3", "adamw")]["kinds"]["all_gather"]["calls"] == 2 * (c["n_blocks"] + 1)
