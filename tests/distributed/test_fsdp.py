"""dlo.distributed.fsdp: the torchtitan steps on the Llama. Structure without ranks (activation
checkpointing, compile recorded instead of run), then one launch of 2 ranks: a meta-initialised,
checkpointed, FSDP2-sharded Llama trains like the same Llama on one process (the torchtitan test),
the tie survives, the units all-gather once each, bf16 is what the blocks compute with, and our
ZeRO-3 gives FSDP2's losses step for step."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dlo.distributed import launch
from dlo.distributed.fsdp import apply_ac, apply_compile, apply_fsdp
from dlo.distributed.zero import ZeRO3
from dlo.measure import CommCounter
from dlo.models.llama import Llama, LlamaConfig
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = LlamaConfig.from_name("tiny", vocab_size=61, dim=24, n_heads=4, n_kv_heads=2, n_layers=3, ffn_dim=37)


def _tokens(step: int, n: int):
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, CFG.vocab_size, (n, 9), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _meta():
    with torch.device("meta"):
        return Llama(CFG)


def test_apply_ac_wraps_blocks():
    model = apply_ac(_meta(), "full")
    assert all(hasattr(b, "_checkpoint_wrapped_module") for b in model.layers.values())
    model = apply_ac(_meta(), "selective")
    assert [hasattr(b, "_checkpoint_wrapped_module") for b in model.layers.values()] == [True, False, True]
    assert not any(hasattr(b, "_checkpoint_wrapped_module") for b in apply_ac(_meta(), "none").layers.values())
    with pytest.raises(ValueError, match="mode"):
        apply_ac(_meta(), "op")
    with pytest.raises(TypeError, match="layers"):
        apply_ac(torch.nn.Linear(2, 2), "full")


def test_apply_compile_compiles_each_block(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append((m, kw)) or m)  # minutes on a CPU otherwise
    model = apply_compile(apply_ac(_meta(), "full"))
    assert [m for m, _ in seen] == list(model.layers.values()) and all(kw == {"fullgraph": True} for _, kw in seen)
    assert all(hasattr(m, "_checkpoint_wrapped_module") for m, _ in seen)  # after AC: the torchtitan order


def _fsdp_worker(steps: int):
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = apply_fsdp(apply_ac(_meta(), "full"), mesh, param_dtype=None, reduce_dtype=None)
    model.to_empty(device="cpu")  # shard first, then materialise: no rank ever holds the whole model
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, calls = [], None
    for s in range(steps):
        x, y = _tokens(s, 2 * n)
        with CommCounter() as comm:
            comm.phase = "forward"
            loss = _loss(model, x[r::n], y[r::n])
            comm.phase = "backward"
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        calls = calls or [(c.kind, c.phase) for c in comm.calls]
    params = {k.replace("_checkpoint_wrapped_module.", ""): p.full_tensor().detach()
              for k, p in model.named_parameters()}
    tied = model.output.weight is model.tok_embeddings.weight
    # bf16 all-gathers, fp32 reductions: the blocks compute in bf16
    bf16 = apply_fsdp(Llama(CFG), mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dtypes = []
    bf16.layers["0"].attention.wq.register_forward_pre_hook(lambda m, a: dtypes.append(m.weight.dtype))
    _loss(bf16, *_tokens(0, 2)).backward()
    # our ZeRO-3 and FSDP2 from the same weights: the same losses
    same = {}
    for name in ("ours", "fsdp2"):
        torch.manual_seed(1)
        net = Llama(CFG)
        if name == "ours":
            engine = ZeRO3(net, torch.optim.AdamW, units=list(net.layers.values()), lr=1e-2)
            step, zero = engine.step, engine.zero_grad
        else:
            engine = apply_fsdp(net, mesh, param_dtype=None, reduce_dtype=None)
            o = torch.optim.AdamW(net.parameters(), lr=1e-2)
            step, zero = o.step, o.zero_grad
        same[name] = []
        for s in range(steps):
            x, y = _tokens(s, 2 * n)
            loss = _loss(engine, x[r::n], y[r::n])
            loss.backward()
            step()
            zero()
            same[name].append(loss.item())
    dist.barrier()
    return {"losses": losses, "params": params, "tied": tied, "calls": calls, "dtypes": dtypes, "same": same}


def test_fsdp_trains_like_one_process():
    steps, n = 2, 2
    res = launch(_fsdp_worker, n, steps, backend="gloo", timeout=120)
    model = Llama(CFG)
    model.init_weights(seed=0)  # per-parameter seeds: the same values as the sharded initialisation
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x, y = _tokens(s, 2 * n)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    mean = torch.stack([res[k]["losses"][s] for k in range(n) for s in range(steps)]).view(n, steps).mean(0)
    torch.testing.assert_close(mean, torch.stack(losses), rtol=1e-5, atol=1e-6)  # fp32, another sum order
    for got in res:
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
        assert got["tied"]
        forward = [k for k, ph in got["calls"] if ph == "forward"]
        assert forward == ["all_gather"] * (CFG.n_layers + 1)  # the root, then one unit per block
        assert got["calls"].count(("reduce_scatter", "backward")) == CFG.n_layers + 1
        assert got["dtypes"] == [torch.bfloat16]
        torch.testing.assert_close(torch.tensor(got["same"]["ours"]), torch.tensor(got["same"]["fsdp2"]),
                                   rtol=1e-5, atol=1e-6)
