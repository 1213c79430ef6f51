"""Tensor parallelism by hand and with DTensor against one process built from the same weights
(the torchtitan test pattern), in float64, on odd sizes. Each launch checks many things at once:
starting ranks is the slow part."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlo.distributed import launch, tp_comms
from dlo.distributed import tensor_parallel as tp
from dlo.measure import CommCounter
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64
B, T, C, F_IN = 3, 6, 5, 7  # T divisible by 2 and 3 (sequence parallelism); C, F_IN odd


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _inputs(t):
    g = torch.Generator().manual_seed(7)
    out_c = 3 * t  # split output features: 3 per rank
    return {"lin_col": nn.Linear(F_IN, out_c).to(D), "lin_row": nn.Linear(out_c, C).to(D),
            "qkv": nn.Linear(C, 3 * out_c).to(D), "emb": nn.Embedding(5 * t, C).to(D),
            "mlp": SwiGLU(C, 2 * t).to(D), "norm": nn.RMSNorm(C).to(D),
            "x": torch.randn(B, T, F_IN, generator=g, dtype=D), "h": torch.randn(B, T, out_c, generator=g, dtype=D),
            "xc": torch.randn(B, T, C, generator=g, dtype=D), "tokens": torch.randint(0, 5 * t, (B, T), generator=g),
            "logits": torch.randn(B * T, 5 * t, generator=g, dtype=D) * 3 + 500.0,  # +500: exp overflows unshifted
            "target": torch.randint(0, 5 * t, (B * T,), generator=g)}


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _run(fn, x, up):
    """Forward, then backward of <out, up>: the output, the input's gradient, the comm counts."""
    x = x.clone().requires_grad_(True)
    with CommCounter() as fwd:
        y = fn(x)
    with CommCounter() as bwd:
        (y * up).sum().backward()
    return y.detach(), x.grad, fwd.by_kind(), bwd.by_kind()


def _worker():
    torch.manual_seed(0)
    t, r = dist.get_world_size(), dist.get_rank()
    m = _inputs(t)
    g = torch.Generator().manual_seed(100)
    up = torch.randn(B, T, 3 * t, generator=g, dtype=D)  # upstream gradients
    upc = torch.randn(B, T, C, generator=g, dtype=D)
    out = {}
    col = tp.ColumnParallelLinear(m["lin_col"])
    out["col"] = _run(col, m["x"], up.chunk(t, -1)[r]) + (_grads(col),)
    colg = tp.ColumnParallelLinear(m["lin_col"], gather_output=True)
    out["col_gather"] = _run(colg, m["x"], up)[:2]
    row = tp.RowParallelLinear(m["lin_row"])
    out["row"] = _run(row, m["h"].chunk(t, -1)[r], upc) + (_grads(row),)
    row_rep = tp.RowParallelLinear(m["lin_row"], input_is_parallel=False)
    out["row_scatter"] = _run(row_rep, m["h"], upc)[:2]
    mlp = tp.TensorParallelSwiGLU(m["mlp"])
    out["mlp"] = _run(mlp, m["xc"], upc) + (_grads(mlp),)
    # sequence parallelism: the MLP and a column/row pair on sequence shards
    shard = lambda z: z.chunk(t, 1)[r]  # noqa: E731
    mlp_sp = tp.TensorParallelSwiGLU(m["mlp"], sequence_parallel=True)
    out["mlp_sp"] = _run(lambda z: mlp_sp(m["norm"](z)), shard(m["xc"]), shard(upc)) + (_grads(mlp_sp),)
    col_sp = tp.ColumnParallelLinear(m["lin_col"], sequence_parallel=True)
    row_sp = tp.RowParallelLinear(m["lin_row"], sequence_parallel=True)
    out["colrow_sp"] = _run(lambda z: row_sp(torch.tanh(col_sp(z))), shard(m["x"]), shard(upc)) \
        + ({**_grads(col_sp), **{f"row.{k}": v for k, v in _grads(row_sp).items()}},)
    qkv = tp.ColumnParallelLinear(m["qkv"], parts=3)
    out["qkv_weight"] = qkv.weight.detach()
    emb = tp.VocabParallelEmbedding(m["emb"])
    y = emb(m["tokens"])
    (y * upc).sum().backward()
    out["emb"] = (y.detach(), emb.weight.grad.clone())
    emb_sp = tp.VocabParallelEmbedding(m["emb"], sequence_parallel=True)
    out["emb_sp"] = emb_sp(m["tokens"]).detach()
    logits = m["logits"].chunk(t, -1)[r].clone().requires_grad_(True)
    with CommCounter() as ce_fwd:
        loss = tp.vocab_parallel_cross_entropy(logits, m["target"])
    loss.backward()
    out["ce"] = (loss.detach(), logits.grad, ce_fwd.by_kind())
    if t == 2:
        out["llama"] = {mode: _llama_run(mode) for mode in ("megatron", "megatron+sp", "dtensor")}
    return out


LLAMA = dict(vocab_size=6 * 11, dim=24, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=2 * 9, max_seq_len=32)


def _llama_data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, LLAMA["vocab_size"], (3, 6), generator=g), torch.randint(0, LLAMA["vocab_size"], (3, 6),
                                                                                     generator=g)


def _llama():
    from dlo.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(**LLAMA)).to(D)
    model.init_weights(seed=0)
    return model


def _llama_run(mode):
    """One step of the tied GQA Llama split by hand (with or without sequence parallelism) or by
    DTensor's plan: the loss, every gradient (whole, or this rank's shard) and the collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    model, (x, y) = _llama(), _llama_data()
    if mode == "dtensor":
        tp.apply_tp(model, init_device_mesh("cpu", (dist.get_world_size(),)))
        with CommCounter() as fwd, loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with CommCounter() as bwd, loss_parallel():
            loss.backward()
        full = lambda z: z.full_tensor() if isinstance(z, DTensor) else z  # noqa: E731
        return full(loss).detach(), {n: full(p.grad) for n, p in model.named_parameters()}, \
            {k: v["calls"] for k, v in fwd.by_kind().items()}, {k: v["calls"] for k, v in bwd.by_kind().items()}
    tp.apply_megatron_tp(model, sequence_parallel=mode.endswith("sp"))
    with CommCounter() as fwd:
        loss = tp.vocab_parallel_cross_entropy(model(x), y)
    with CommCounter() as bwd:
        loss.backward()
        tp.sync_replicated_grads(model)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, \
        {k: v["calls"] for k, v in fwd.by_kind().items()}, {k: v["calls"] for k, v in bwd.by_kind().items()}


def _reference(t, r):
    torch.manual_seed(0)
    m = _inputs(t)
    g = torch.Generator().manual_seed(100)
    up = torch.randn(B, T, 3 * t, generator=g, dtype=D)
    upc = torch.randn(B, T, C, generator=g, dtype=D)

    def run(module, x, u, params=True):
        x = x.clone().requires_grad_(True)
        y = module(x)
        (y * u).sum().backward()
        grads = None
        if params:
            grads = _grads(module)
            module.zero_grad()
        return y.detach(), x.grad, grads
    return m, up, upc, run


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    t = request.param
    return t, launch(_worker, t, backend="gloo")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_column_and_row_equal_one_process(results):
    t, res = results
    for r, out in enumerate(res):
        m, up, upc, run = _reference(t, r)
        y, gx, gw = run(m["lin_col"], m["x"], up)
        got_y, got_gx, fwd, bwd, grads = out["col"]
        _close(got_y, y.chunk(t, -1)[r])
        _close(got_gx, gx)  # f all-reduced the input gradient
        _close(grads["weight"], gw["weight"].chunk(t, 0)[r])
        _close(grads["bias"], gw["bias"].chunk(t, 0)[r])
        assert fwd == {} and bwd["all_reduce"]["calls"] == 1
        _close(out["col_gather"][0], y)
        _close(out["col_gather"][1], gx)
        y, gx, gw = run(m["lin_row"], m["h"], upc)
        got_y, got_gx, fwd, bwd, grads = out["row"]
        _close(got_y, y)
        _close(got_gx, gx.chunk(t, -1)[r])
        _close(grads["weight"], gw["weight"].chunk(t, 1)[r])
        _close(grads["bias"], gw["bias"])
        assert fwd["all_reduce"]["calls"] == 1 and bwd == {}
        _close(out["row_scatter"][0], y)
        _close(out["row_scatter"][1], gx)


def test_swiglu_one_all_reduce_each_way(results):
    t, res = results
    for r, out in enumerate(res):
        m, up, upc, run = _reference(t, r)
        y, gx, gw = run(m["mlp"], m["xc"], upc)
        got_y, got_gx, fwd, bwd, grads = out["mlp"]
        _close(got_y, y)
        _close(got_gx, gx)
        _close(grads["w1.weight"], gw["w1.weight"].chunk(t, 0)[r])
        _close(grads["w3.weight"], gw["w3.weight"].chunk(t, 0)[r])
        _close(grads["w2.weight"], gw["w2.weight"].chunk(t, 1)[r])
        assert fwd == {"all_reduce": fwd["all_reduce"]} and fwd["all_reduce"]["calls"] == 1
        assert bwd == {"all_reduce": bwd["all_reduce"]} and bwd["all_reduce"]["calls"] == 1
        # the bytes a rank sends per all-reduce: 2 (t-1)/t of the (B, T, C) activation
        assert fwd["all_reduce"]["sent"] == pytest.approx(2 * (t - 1) / t * B * T * C * 8)


def test_sequence_parallel_equals_one_process(results):
    t, res = results
    for r, out in enumerate(res):
        m, up, upc, run = _reference(t, r)
        y, gx, gw = run(lambda z, m=m: m["mlp"](m["norm"](z)), m["xc"], upc, params=False)
        gw = _grads(m["mlp"])
        got_y, got_gx, fwd, bwd, grads = out["mlp_sp"]
        _close(got_y, y.chunk(t, 1)[r])
        _close(got_gx, gx.chunk(t, 1)[r])
        _close(grads["w1.weight"], gw["w1.weight"].chunk(t, 0)[r])
        _close(grads["w2.weight"], gw["w2.weight"].chunk(t, 1)[r])
        assert {k: v["calls"] for k, v in fwd.items()} == {"all_gather": 1, "reduce_scatter": 1}
        assert {k: v["calls"] for k, v in bwd.items()} == {"all_gather": 1, "reduce_scatter": 1}
        # column with the shard saved (Megatron): one more all-gather in backward
        y, gx, _ = run(lambda z, m=m: m["lin_row"](torch.tanh(m["lin_col"](z))), m["x"], upc, params=False)
        got_y, got_gx, fwd, bwd, grads = out["colrow_sp"]
        _close(got_y, y.chunk(t, 1)[r])
        _close(got_gx, gx.chunk(t, 1)[r])
        _close(grads["weight"], m["lin_col"].weight.grad.chunk(t, 0)[r])
        assert {k: v["calls"] for k, v in bwd.items()} == {"all_gather": 2, "reduce_scatter": 1}
    # the bias of a sequence-parallel row layer saw this rank's tokens only: the ranks' sum is whole
    bias_grads = [out["colrow_sp"][4]["row.bias"] for out in res]
    _close(sum(bias_grads), m["lin_row"].bias.grad)


def test_vocabulary_parallel_embedding_and_cross_entropy(results):
    t, res = results
    for r, out in enumerate(res):
        m, up, upc, run = _reference(t, r)
        y = m["emb"](m["tokens"])
        (y * upc).sum().backward()
        _close(out["emb"][0], y.detach())
        _close(out["emb"][1], m["emb"].weight.grad.chunk(t, 0)[r])
        _close(out["emb_sp"], y.detach().chunk(t, 1)[r])
        logits = m["logits"].clone().requires_grad_(True)
        loss = F.cross_entropy(logits, m["target"])
        loss.backward()
        got_loss, got_grad, comms = out["ce"]
        _close(got_loss, loss.detach())
        _close(got_grad, logits.grad.chunk(t, -1)[r])
        assert set(comms) == {"all_reduce"} and comms["all_reduce"]["calls"] == 3
        assert comms["all_reduce"]["bytes"] == 3 * B * T * 8  # N numbers each, never (N, V)
        qkv = m["qkv"].weight.detach()
        want = torch.cat([p.chunk(t, 0)[r] for p in qkv.chunk(3, 0)])
        _close(out["qkv_weight"], want)


def test_bad_degree_names_the_dimension():
    class Cfg:
        n_heads, n_kv_heads, dim, ffn_dim, vocab_size = 24, 8, 3072, 8192, 128256
    tp.check_tp_degree(Cfg, 8)
    with pytest.raises(ValueError, match="n_kv_heads=8"):
        tp.check_tp_degree(Cfg, 16)
    Cfg.ffn_dim = 8190
    with pytest.raises(ValueError, match="ffn_dim=8190"):
        tp.check_tp_degree(Cfg, 4)
    Cfg.ffn_dim = 8192
    Cfg.vocab_size = 50257
    with pytest.raises(ValueError, match="vocab_size=50257"):
        tp.check_tp_degree(Cfg, 2)


def test_single_rank_is_plain_torch():
    x = torch.randn(2, 3, 4, dtype=D, requires_grad=True)
    assert tp_comms.copy_to_tp(x) is x and tp_comms.reduce_from_tp(x) is x
    lin = nn.Linear(4, 6).to(D)
    _close(tp.ColumnParallelLinear(lin)(x), lin(x))


def test_llama_split_by_hand_and_by_dtensor(results):
    """The tied GQA Llama: Megatron by hand (with and without sequence parallelism) and torchtitan's
    DTensor plan give one process's loss and gradients; the collectives are the plan's."""
    t, res = results
    if t != 2:
        pytest.skip("the Llama runs on 2 ranks")
    ref = _llama()
    x, y = _llama_data()
    loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    L = LLAMA["n_layers"]
    for r, out in enumerate(res):
        for mode, (got_loss, grads, fwd, bwd) in out["llama"].items():
            _close(got_loss, loss.detach())
            for name, p in ref.named_parameters():
                g = grads[name]
                if g.shape != p.grad.shape:  # this rank's shard: find the split dimension
                    dim = next(i for i, (a, b) in enumerate(zip(g.shape, p.grad.shape)) if a != b)
                    want = p.grad.chunk(t, dim)[r]
                else:
                    want = p.grad
                _close(g, want)
            if mode == "megatron":  # embedding g + 2 per block forward; 2 f per block + output f backward
                assert fwd == {"all_reduce": 2 * L + 1 + 3} and bwd == {"all_reduce": 2 * L + 1}
            if mode == "megatron+sp":  # the norms' gradients: one all-reduce each after backward
                assert fwd["reduce_scatter"] == 2 * L + 1 and fwd["all_gather"] == 2 * L + 1
                assert bwd["all_reduce"] == 2 * L + 1
            if mode == "dtensor":  # (loss_parallel's 3 all-reduces bypass the dispatcher mode; CommDebugMode sees them)
                assert {k: fwd[k] for k in ("all_gather", "reduce_scatter")} == {"all_gather": 2 * L + 1,
                                                                                 "reduce_scatter": 2 * L + 1}
                assert bwd == {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
