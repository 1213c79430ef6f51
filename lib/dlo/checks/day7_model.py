"""Day 7's exercises 3 and 6 on the Llama's own modules (grouped-query attention split by heads,
the DTensor plan of a Llama block), re-exported by `dlo.checks.day7`.
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks.day7_comms import CommTap, expect_block_sums, expect_blocks, recorded, verified
from dlo.checks.day7_shared import (
    DTENSOR,
    F_G,
    LAYERS,
    assert_block_close,
    expect_comms,
    expect_own_work,
    expect_split_work,
    fwd_bwd,
    only_blocks,
    param_grad,
    reference,
    reference_flops,
    seeded_gen,
)
from dlo.checks.rank_count import every_rank
from dlo.grading.api import case_seed, check, on_ranks
from dlo.grading.compare import DTYPE, assert_close, ok

# ----------------------------------------------------------------------------- 3. attention split by heads

def llama_config(seed: int, t: int, salt: int, **extra):
    from dlo.models.llama import LlamaConfig

    rng = random.Random(seed * 7 + salt)
    n_kv = t * rng.choice([1, 3])
    n_heads = n_kv * rng.choice([1, 2, 3])
    head_dim = rng.choice([2, 4, 6])
    return LlamaConfig(vocab_size=t * rng.choice([11, 13]), dim=n_heads * head_dim, n_layers=2, n_heads=n_heads,
                       n_kv_heads=n_kv, ffn_dim=t * rng.choice([3, 5]), max_seq_len=64, **extra)


def _attention_case(seed: int, t: int) -> dict:
    from dlo.models.llama import Attention, LlamaConfig, rope_cos_sin, rope_frequencies

    cfg = llama_config(seed, t, 3)
    rng, gen = random.Random(seed), seeded_gen(seed, 3)
    attn = Attention(cfg).to(DTYPE)
    for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen, dtype=DTYPE) / lin.in_features ** 0.5)
    B, T = rng.choice([1, 3]), rng.choice([3, 5, 7])
    cos, sin = rope_cos_sin(rope_frequencies(cfg), T)
    bad = Attention(LlamaConfig(vocab_size=8, dim=4 * t, n_layers=1, n_heads=2 * t, n_kv_heads=1, ffn_dim=4))
    return {"attn": attn, "bad": bad, "cos": cos, "sin": sin,
            "x": torch.randn(B, T, cfg.dim, generator=gen, dtype=DTYPE),
            "up": torch.randn(B, T, cfg.dim, generator=gen, dtype=DTYPE),
            "where": dict(B=B, T=T, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, world_size=t,
                          seed=seed)}


@recorded
def _attention_worker(mine, cls):
    """`mine`: this rank's heads of the attention (`only_blocks`: the rows of its heads in wq, wk, wv,
    their columns in wo), RoPE's tables, the input and output gradient (the same on every rank) and an
    attention whose KV heads do not split, drawn on the grader's side."""
    t, c = dist.get_world_size(), mine
    layer = cls(c["attn"], None)
    res = fwd_bwd(lambda x: layer(x, c["cos"], c["sin"]), c["x"], c["up"], flops=True)
    res.update({w: param_grad(layer, f"{w}.weight", "the tensor-parallel attention")
                for w in ("wq", "wk", "wv", "wo")})
    res["bad"] = None
    if t > 1:
        try:
            cls(c["bad"], None)
        except ValueError as e:
            res["bad"] = str(e)
    return res


@check(forbid=LAYERS + F_G + DTENSOR)
def check_tp_attention(cls, seed: int = 0, world_size: int = 2) -> None:
    """`cls(attention, group=None)` splits a Llama `Attention` by heads (wq, wk, wv by output features:
    rank r keeps query heads [r H/t, (r+1) H/t) and KV heads [r Hkv/t, (r+1) Hkv/t); wo by input
    features; the other heads' weights are NaN on its rank) and runs `layer(x, cos, sin)` with one
    all-reduce forward and one backward; a degree that does not divide the KV heads raises ValueError
    naming n_kv_heads."""
    name, t = "tp_attention", world_size
    c = _attention_case(case_seed(seed), t)  # a secret seed when graded
    heads = {"wq": 0, "wk": 0, "wv": 0, "wo": 1}  # heads are contiguous rows of wq, wk, wv, columns of wo
    parts = [{"attn": only_blocks(c["attn"], t, r, heads), **{k: c[k] for k in ("bad", "cos", "sin", "x", "up")}}
             for r in range(t)]
    got = verified(name, on_ranks(_attention_worker, world_size, cls, per_rank=parts), t,
                   {**c["where"], "seed": seed})
    attn = c["attn"]
    whole = reference_flops(lambda x: copy.deepcopy(attn)(x, c["cos"], c["sin"]), c["x"], c["up"])
    y, dx = reference(lambda x: attn(x, c["cos"], c["sin"]), c["x"], c["up"])
    for r, res in enumerate(got):
        here = {**c["where"], "seed": seed, "rank": r}
        expect_comms(name, "forward", res["fwd"], {"all_reduce": 1}, "q, k, v and the attention are local; only "
                     "wo's partial sums are all-reduced", here)
        expect_comms(name, "backward", res["bwd"], {"all_reduce": 1}, "apply f once to x, before wq, wk and wv",
                     here)
        assert_block_close(name, "output", res["y"], y, here)
        assert_block_close(name, "input gradient", res["dx"], dx, here)
        for w in ("wq", "wk", "wv"):
            assert_block_close(name, f"{w} gradient (the rows of this rank's heads)", res[w],
                         getattr(attn, w).weight.grad.chunk(t, 0)[r], here)
        assert_block_close(name, "wo gradient (the columns of this rank's heads)", res["wo"],
                     attn.wo.weight.grad.chunk(t, 1)[r], here)
        expect_split_work(name, res["flops"], whole, t, here)
        if t > 1 and (res["bad"] is None or "n_kv_heads" not in res["bad"]):
            raise AssertionError(f"{name}: an attention with 1 KV head on {t} ranks must raise ValueError naming "
                                 f"n_kv_heads (a rank needs whole KV heads), got "
                                 f"{'no error' if res['bad'] is None else repr(res['bad'])} ({here})")
    expect_block_sums(name, got, y, dx, {**c["where"], "seed": seed})
    expect_own_work(name, got, whole, t, {**c["where"], "seed": seed})
    ok(name, f"{c['where']['n_heads']} heads / {c['where']['n_kv_heads']} KV heads on {world_size} ranks, seed={seed}")


# ----------------------------------------------------------------------------- 6. the DTensor plan

def _dtensor_case(seed: int, t: int) -> dict:
    cfg = llama_config(seed, t, 6, tie_embeddings=True)
    rng, gen = random.Random(seed), seeded_gen(seed, 6)
    B, T = rng.choice([1, 3]), t * rng.choice([1, 3])
    return {"cfg": cfg, "tokens": torch.randint(0, cfg.vocab_size, (B, T), generator=gen),
            "targets": torch.randint(0, cfg.vocab_size, (B, T), generator=gen),
            "where": dict(B=B, T=T, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, vocab=cfg.vocab_size,
                          layers=cfg.n_layers, world_size=t, seed=seed)}


def _llama(cfg, seed: int):
    from dlo.models.llama import Llama

    model = Llama(cfg).to(DTYPE)
    model.init_weights(seed=seed)
    return model


class _PlanTap(CommTap):
    """`CommTap` that lets DTensor's own dispatch run first (as CommDebugMode does): a mode sees an operator on
    DTensors before DTensor desugars it, and a collective DTensor issues inside that (loss_parallel's all-reduces)
    would run with the mode set aside; returned NotImplemented, DTensor runs it with the mode still on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__module__", "").startswith("torch.distributed.tensor") for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


def _dtensor_worker(mine, fn):
    """`mine`: the Llama to parallelize, the tokens and targets (the same on every rank), drawn on the
    grader's side from its seed. The collectives of forward and backward are the grader's count (`CommTap`, with
    what this rank put into each), not CommDebugMode's: torch's class in the rank's process is the student's to
    patch (a red team's plan without sequence parallelism set `CommDebugMode.get_comm_counts` to return
    torchtitan's counts, 2026-12-03). Not `recorded`: parallelize_module and the mesh send bytes beside the
    counter (measured: 139,968 bytes on the sockets, 90,112 counted plus 31,680 of headers, for the solution), so
    the sockets cannot back this count; what the all-gathers carried does (`check_dtensor_plan`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    c, model = mine, mine["model"]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fn(model, mesh)
    full = lambda z: z.full_tensor() if isinstance(z, DTensor) else z  # noqa: E731
    with _PlanTap() as fwd:
        logits = model(c["tokens"])
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), c["targets"].flatten())
    with _PlanTap() as bwd, loss_parallel():
        loss.backward()
    return {"loss": full(loss).detach(), "sharded_logits": isinstance(logits, DTensor),
            "grads": {n: None if p.grad is None else full(p.grad).detach() for n, p in model.named_parameters()},
            "local": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                      for n, p in model.named_parameters()},
            "fwd": fwd.by_kind("calls"), "bwd": bwd.by_kind("calls"),
            "gathered": [v for call, v in zip(fwd.calls, fwd.inputs) if call.kind == "all_gather"]}


def _normed(model, tokens) -> list:
    """The outputs of the norms that sequence parallelism all-gathers, in the forward's order: each block's
    attention_norm and ffn_norm, then the final norm (one process, the grader's model)."""
    out, hooks = [], []
    for block in model.layers.values():
        hooks += [block.attention_norm.register_forward_hook(lambda m, i, o: out.append(o.detach())),
                  block.ffn_norm.register_forward_hook(lambda m, i, o: out.append(o.detach()))]
    hooks.append(model.norm.register_forward_hook(lambda m, i, o: out.append(o.detach())))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return out


@check(forbid=("dlo.distributed.tensor_parallel.apply_tp", "dlo.distributed.tensor_parallel.llama_tp_plan",
               "dlo.distributed.tensor_parallel.apply_megatron_tp"))
def check_dtensor_plan(fn, seed: int = 0, world_size: int = 2) -> None:
    """`fn(model, tp_mesh)` parallelizes a Llama in place with `parallelize_module` (tensor and sequence
    parallelism, logits left sharded by vocabulary for `loss_parallel`). One step's loss and every
    gradient against one process, and the collectives of forward and backward, counted by the grader on the
    ranks (`CommTap`), against torchtitan's plan: per block one all-gather and one
    reduce-scatter around the attention and around the MLP, one more of each for the embedding and the
    output, and the three all-reduces of the vocabulary-parallel loss; each forward all-gather carries the
    rank's sequence shard of the norm before it (sequence parallelism: the norms ran on Shard(1))."""
    name, secret = "dtensor_plan", case_seed(seed)  # a secret seed when graded
    c = _dtensor_case(secret, world_size)
    # The model is whole on every rank, unlike the other exercises' layers: parallelize_module
    # distributes each parameter from the module it is given (scattered from rank 0 by default, each
    # rank's own chunk with src_data_rank=None), and the replicated ones (norms) whole, so no rank
    # can be given its shard alone. What stays here is the seed, and with it the case's drawing.
    part = {"model": _llama(c["cfg"], secret), "tokens": c["tokens"], "targets": c["targets"]}
    c["where"]["seed"] = seed
    got = every_rank(name, on_ranks(_dtensor_worker, world_size, fn, per_rank=[part] * world_size), world_size)
    model = _llama(c["cfg"], secret)
    loss = F.cross_entropy(model(c["tokens"]).flatten(0, 1), c["targets"].flatten())
    loss.backward()
    L = c["cfg"].n_layers
    want_fwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 3}
    want_bwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
    for r, res in enumerate(got):
        here = {**c["where"], "rank": r}
        if not res["sharded_logits"]:
            raise AssertionError(f"{name}: the model returned plain logits; keep them a DTensor sharded on the "
                                 f"vocabulary (output: ColwiseParallel(..., output_layouts=Shard(-1), "
                                 f"use_local_output=False)) so that loss_parallel needs no all-gather ({here})")
        expect_comms(name, "forward (the grader's count)", res["fwd"], want_fwd,
                     "sequence parallelism: the norms on Shard(1), PrepareModuleInput all-gathers before the "
                     "attention and the MLP, wo and w2 reduce-scatter (output_layouts=Shard(1)), the embedding "
                     "reduce-scatters, the output all-gathers its input; loss_parallel all-reduces 3 times", here)
        expect_comms(name, "backward (the grader's count)", res["bwd"], want_bwd,
                     "the conjugates of the forward's all-gathers and reduce-scatters", here)
        gathered = len(res["gathered"]) if isinstance(res["gathered"], list) else 0
        if gathered != 2 * L + 1:
            raise AssertionError(f"{name}: rank {r} returned what {gathered} forward all-gathers carried, "
                                 f"its count says {2 * L + 1}: the grader got nothing to check for the rest ({here})")
        assert_close(name, "loss", res["loss"], loss.detach(), here)
        for pname, p in model.named_parameters():
            if res["grads"].get(pname) is None:
                raise AssertionError(f"{name}: parameter {pname} has no gradient on rank {r} ({here})")
            hint = " (tied to output.weight: call model.tie_weights() after parallelize_module)" \
                if pname == "tok_embeddings.weight" else ""
            assert_close(name, f"gradient of {pname}{hint}", res["grads"][pname], p.grad, here)
        full_numel = {n: p.numel() for n, p in model.named_parameters()}
        if set(res["local"]) != set(full_numel):
            raise AssertionError(f"{name}: rank {r} returned the local shapes of {len(res['local'])} of the model's "
                                 f"{len(full_numel)} parameters: the grader got no shape to check for the rest "
                                 f"({here})")
        big = {n: s for n, s in res["local"].items() if n.endswith(("wq.weight", "w1.weight", "w2.weight"))}
        unsharded = [n for n, s in big.items() if math.prod(s) != full_numel[n] // world_size]
        if unsharded:
            raise AssertionError(f"{name}: {unsharded[:3]} hold {[big[n] for n in unsharded[:3]]} on rank {r}: "
                                 f"each rank should keep 1/{world_size} of them ({here})")
    normed = _normed(_llama(c["cfg"], secret), c["tokens"])
    for i, h in enumerate(normed):
        which = "the final norm" if i == 2 * L else f"block {i // 2}'s {('attention_norm', 'ffn_norm')[i % 2]}"
        expect_blocks(name, f"forward all-gather {i + 1} of {2 * L + 1}", [res["gathered"][i] for res in got],
                      list(h.chunk(world_size, 1)), f"the output of {which} on its sequence shard",
                      "sequence parallelism: SequenceParallel() on the norms (Shard(1)), PrepareModuleInput "
                      "all-gathers their output before the attention and the MLP, the output layer's input is "
                      "Shard(1)", c["where"])
    ok(name, f"{L} blocks on {world_size} ranks, seed={seed}")
