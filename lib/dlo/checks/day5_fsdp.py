"""Autograder check for Day 5's exercise 5 (FSDP2 on the Llama), re-exported by `dlo.checks.day5`.

The student's `parallelize(model, mesh, ...)` runs on `world_size` ranks (a trusted worker below):
the structure it builds (activation checkpointing, then torch.compile, then fully_shard per block
and the root, the tie kept), the collectives of a step, the recomputation in backward and the dtype
the blocks compute with are recorded there; parameters after one SGD step and k AdamW steps are
compared here with one process on the whole batch (the torchtitan test pattern).
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch import nn

from dlo.checks.day5_zero import BYTES_TOL, STEP, batch, lm_loss, optimizer_for, train_on_full_batch
from dlo.checks.rank_count import every_rank
from dlo.grading.api import case_seed, check, on_ranks, verify_wire
from dlo.grading.compare import DTYPE, assert_close, ok
from dlo.measure import CommCounter, comm_bytes

FSDP_REFS = ("dlo.distributed.fsdp.apply_fsdp", "dlo.distributed.fsdp.apply_ac", "dlo.distributed.fsdp.apply_compile",
             "dlo.distributed.parallelize.parallelize_llama")
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def llama_case(seed: int):
    """A CPU-sized Llama 3.2 (tied embedding, grouped-query attention) with odd vocabulary and MLP."""
    from dlo.models.llama import LlamaConfig

    rng = random.Random(seed)
    cfg = LlamaConfig.from_name("tiny", vocab_size=rng.choice([61, 67]), dim=24, n_heads=4, n_kv_heads=2,
                                n_layers=rng.choice([2, 3]), ffn_dim=rng.choice([37, 41]), max_seq_len=64)
    return cfg, {"T": rng.choice([5, 7]), "per_rank": rng.choice([2, 3]), "sgd_lr": rng.uniform(0.2, 0.5),
                 "lr": rng.uniform(5e-3, 2e-2), "weight_decay": rng.uniform(0.0, 0.1), "vocab": cfg.vocab_size}


def llama(cfg, seed: int) -> nn.Module:
    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.to(DTYPE)


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def llama_reference(cfg, c: dict, seed: int, kind: str, steps: int, world_size: int) -> dict:
    model = train_on_full_batch(llama(cfg, seed + 1), c, seed, kind, steps, world_size)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _structure(model, compiled: list, returned: list) -> dict:
    """What parallelize built; `returned`: what the stand-in for torch.compile returned, each block holding one
    (`model.layers[name]` is it, or `nn.Module.compile` set it as the block's compiled call)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    layers = list(model.layers.values())
    ids = {id(r) for r in returned}
    return {"blocks_compiled": [id(b) in ids or id(b.__dict__.get("_compiled_call_impl")) in ids for b in layers],
            "root": isinstance(model, FSDPModule),
            "blocks_sharded": [isinstance(b, FSDPModule) for b in layers],
            "blocks_checkpointed": [hasattr(b, "_checkpoint_wrapped_module") for b in layers],
            "tied": model.output.weight is model.tok_embeddings.weight,
            "shard0": all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in model.parameters()),
            "compiled": compiled}


class Compiled(nn.Module):
    """What the check's stand-in for torch.compile returns for a module: the module under `_orig_mod` (as torch's
    `OptimizedModule` keeps it, attributes read through), its forward run as it is, each call counted. The check
    looks for it where the exercise applies it (`model.layers[name]`) and counts that the step's forward went
    through it: a parallelize that called torch.compile and dropped its result passed when the stand-in returned
    its argument (a red team's, 2026-12-02)."""

    def __init__(self, module: nn.Module, calls: list):
        super().__init__()
        self._orig_mod = module
        object.__setattr__(self, "_calls", calls)

    def forward(self, *args, **kwargs):
        self._calls[0] += 1
        return self._orig_mod(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if name.startswith("__") or modules is None or "_orig_mod" not in modules:
                raise
            return getattr(modules["_orig_mod"], name)


def _compiled_calls(fn, calls: list):
    """The stand-in's result for a function or a bound method (`nn.Module.compile` compiles its module's
    `_call_impl`): fn, its calls counted."""
    def compiled(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)
    return compiled


def _counting(forward, calls: list):
    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)
    return counted


def fsdp_parts(cfg, c: dict, seed: int, world_size: int, steps: int) -> list[dict]:
    """What rank r is given, built here on the grader's side: the sizes and hyper-parameters, the
    Llama's initial weights (every rank starts from the same model, as fully_shard expects) and its
    own slice of each step's batch; never the global batch nor the seed."""
    model, batches = llama(cfg, seed + 1), [batch(c, seed, s, world_size * c["per_rank"]) for s in range(steps)]
    n = world_size
    return [{"c": c, "model": model, "batches": [(x[r::n].clone(), y[r::n].clone()) for x, y in batches]}
            for r in range(n)]


def _fsdp_run(fn, mine, kind, steps, policy, ac_mode, compile_):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    n, c = dist.get_world_size(), mine["c"]
    model = copy.deepcopy(mine["model"])
    compiled, returned, compiled_calls, real = [], [], [0], torch.compile

    def recording_compile(obj=None, *args, **kwargs):  # compiling costs minutes on a CPU: record instead
        target = getattr(obj, "__self__", obj)
        compiled.append({"checkpointed": hasattr(target, "_checkpoint_wrapped_module"),
                         "sharded": isinstance(target, FSDPModule), "type": type(target).__name__})
        returned.append(Compiled(obj, compiled_calls) if isinstance(obj, nn.Module) else
                        _compiled_calls(obj, compiled_calls) if callable(obj) else obj)
        return returned[-1]
    torch.compile = recording_compile
    try:
        with CommCounter() as setup:  # the wire check below needs every byte the rank sends, setup included
            mesh = init_device_mesh("cpu", (n,))
            ret = fn(model, mesh, param_dtype=policy[0], reduce_dtype=policy[1], ac_mode=ac_mode, compile=compile_)
    finally:
        torch.compile = real
    wire = setup.records()
    model = ret if isinstance(ret, nn.Module) else model
    out = {"structure": _structure(model, compiled, returned)}
    ffn_calls, dtypes = [0], []
    for name, m in model.named_modules():
        if name.endswith("feed_forward"):  # wrap forward: module hooks do not fire during recomputation
            m.forward = _counting(m.forward, ffn_calls)
        if name.endswith("attention.wq"):
            m.register_forward_pre_hook(lambda mod, a: dtypes.append(str(mod.weight.dtype)))
    opt_cls, kw = optimizer_for(c, kind)
    opt = opt_cls(model.parameters(), **kw)
    for s in range(steps):
        x, y = mine["batches"][s]
        with CommCounter() as comm:  # every byte of the step, point-to-point included
            comm.phase = "forward"
            loss = lm_loss(model, x, y)
            comm.phase = "backward"
            loss.backward()
            comm.phase = "step"
            opt.step()
            opt.zero_grad()
        if s == 0:
            out["comm"], out["ffn_calls"], out["dtypes"] = comm.records(), ffn_calls[0], sorted(set(dtypes))
            out["compiled_calls"] = compiled_calls[0]
        out.setdefault("other", set()).update(other_comms(comm.records()))
        wire += comm.records()
    with CommCounter() as gather:
        out["params"] = {_clean(k): p.full_tensor().detach().clone() for k, p in model.named_parameters()}
    out["wire"] = wire + gather.records()
    out["other"] = sorted(out["other"])
    return out


def other_comms(calls: list) -> set:
    """(kind, phase) of the messages FSDP2 does not send: anything but all-gathers and reduce-scatters
    in forward and backward (point-to-point included)."""
    return {(x["kind"], x["phase"]) for x in calls if x["kind"] not in ("all_gather", "reduce_scatter")
            or x["phase"] == "step"}


def _fsdp_worker(mine: dict, fn, steps: int):
    """`mine`: this rank's part (`fsdp_parts`)."""
    full = (None, None)
    return {"sgd": _fsdp_run(fn, mine, "sgd", 1, full, "full", True),
            "adamw": _fsdp_run(fn, mine, "adamw", steps, full, "none", False),
            "bf16": _fsdp_run(fn, mine, "sgd", 1, (torch.bfloat16, torch.float32), "none", False)}


def _every_block(name: str, s: dict, n_layers: int, where: str) -> None:
    """One flag per block: an empty list would pass `all(...)` and name no block."""
    for key in ("blocks_sharded", "blocks_checkpointed"):
        if len(s[key]) != n_layers:
            raise AssertionError(f"{name}: the grader got {key} of {len(s[key])} of the model's {n_layers} blocks: "
                                 f"model.layers holds every block, parallelized in place ({where})")


def _check_fsdp_structure(name: str, s: dict, n_layers: int, where: str) -> None:
    _every_block(name, s, n_layers, where)
    if not all(s["blocks_sharded"]):
        hint = (" (each block is checkpoint-wrapped around an FSDP module: wrap for activation checkpointing "
                "first, then fully_shard)" if all(s["blocks_checkpointed"]) else "")
        raise AssertionError(f"{name}: model.layers[i] is not an FSDP module for blocks "
                             f"{[i for i, b in enumerate(s['blocks_sharded']) if not b]}: fully_shard each block{hint} "
                             f"({where})")
    if not s["root"]:
        raise AssertionError(f"{name}: the root model is not an FSDP module: fully_shard(model) last ({where})")
    if not all(s["blocks_checkpointed"]):
        raise AssertionError(f"{name}: with ac_mode='full' every block must be wrapped with checkpoint_wrapper "
                             f"(inside its FSDP unit) ({where})")
    if not s["tied"]:
        raise AssertionError(f"{name}: output.weight is no longer tok_embeddings.weight: a tied embedding must stay in "
                             f"one unit with the head (leave both to the root) ({where})")
    if not s["shard0"]:
        raise AssertionError(f"{name}: every parameter should be a DTensor sharded on dim 0 over the mesh ({where})")
    comp = s["compiled"]
    if len(comp) != n_layers or not all(x["checkpointed"] and not x["sharded"] for x in comp):
        raise AssertionError(f"{name}: with compile=True, torch.compile each block once, after activation "
                             f"checkpointing and before fully_shard (torchtitan's order); seen: {comp} ({where})")
    held = s.get("blocks_compiled")
    if not isinstance(held, list) or len(held) != n_layers or not all(held):
        missing = [i for i, b in enumerate(held) if not b] if isinstance(held, list) else "?"
        raise AssertionError(f"{name}: with compile=True model.layers does not hold what torch.compile returned for "
                             f"blocks {missing}: torch.compile(block) returns a new module, which replaces the block "
                             f"(model.layers.register_module(name, torch.compile(block))); the block it was given "
                             f"still runs uncompiled ({where})")


def _check_flags_honoured(name: str, run: dict, n_layers: int, where: str) -> None:
    """A run with ac_mode="none", compile=False: no wrapper, no compile, each block's forward once (a
    parallelize that checkpoints and compiles whatever it is told passed when only the "full" run was read)."""
    s = run["structure"]
    _every_block(name, s, n_layers, where)
    wrapped = [i for i, b in enumerate(s["blocks_checkpointed"]) if b]
    if wrapped:
        raise AssertionError(f"{name}: with ac_mode='none' blocks {wrapped} are wrapped with checkpoint_wrapper: "
                             f"checkpoint only when ac_mode == 'full' ({where})")
    if s["compiled"]:
        raise AssertionError(f"{name}: with compile=False torch.compile was called {len(s['compiled'])} times: "
                             f"compile only when compile=True ({where})")
    if run["ffn_calls"] != n_layers:
        raise AssertionError(f"{name}: with ac_mode='none' the blocks' feed-forward ran {run['ffn_calls']} times in a "
                             f"step; expected {n_layers} (no recomputation without activation checkpointing) "
                             f"({where})")


def _check_full_precision(name: str, run: dict, where: str) -> None:
    """param_dtype=None and reduce_dtype=None: the blocks compute with the float64 parameters and the gradients
    are reduce-scattered in float64 (a reduce_dtype left at the parameters' dtype), as many bytes as all-gathered."""
    if run["dtypes"] != [str(DTYPE)]:
        raise AssertionError(f"{name}: with param_dtype=None the blocks compute with {run['dtypes']} weights; "
                             f"expected the parameters' own {DTYPE}: pass param_dtype to the MixedPrecisionPolicy "
                             f"as given ({where})")
    gathered = comm_bytes(run["comm"], "all_gather", "forward")
    reduced = comm_bytes(run["comm"], "reduce_scatter", STEP)
    if abs(reduced / max(gathered, 1) - 1) > 2 * BYTES_TOL:
        raise AssertionError(f"{name}: with reduce_dtype=None (the parameters' {DTYPE}) reduce-scattered {reduced:,} "
                             f"bytes for {gathered:,} all-gathered in forward; expected as many: pass reduce_dtype "
                             f"to the MixedPrecisionPolicy as given ({where})")


@check(forbid=FSDP_REFS)
def check_fsdp2(fn, seed: int = 0, world_size: int = 2, steps: int = 3) -> None:
    """`fn(model, mesh, *, param_dtype, reduce_dtype, ac_mode, compile)` on a Llama: activation
    checkpointing per block, then torch.compile per block, then fully_shard per block and the
    root with a MixedPrecisionPolicy. Checked: the structure and order, one all-gather per unit in
    forward, a recomputed forward per block in backward, bf16 all-gathers with fp32 reduce-scatters,
    and parameters equal to one process after one SGD step and k AdamW steps (float64)."""
    name, secret = "fsdp2", case_seed(seed)  # the case's seed: secret when graded
    cfg, c = llama_case(secret)
    res = on_ranks(_fsdp_worker, world_size, fn, steps, per_rank=fsdp_parts(cfg, c, secret, world_size, steps))
    where = f"world_size={world_size}, n_layers={cfg.n_layers}, seed={seed}"
    every_rank(name, res, world_size, where)
    counted = [[rec for run in ("sgd", "adamw", "bf16") for rec in got[run]["wire"]] for got in res]
    verify_wire(name, counted, world_size, where)
    sgd, adamw = (llama_reference(cfg, c, secret, k, s, world_size) for k, s in (("sgd", 1), ("adamw", steps)))
    for r, got in enumerate(res):
        _check_fsdp_structure(name, got["sgd"]["structure"], cfg.n_layers, f"{where}, rank {r}")
        for run in ("adamw", "bf16"):  # the runs with ac_mode="none", compile=False
            _check_flags_honoured(name, got[run], cfg.n_layers, f"{where}, rank {r}")
        for run in ("sgd", "adamw"):  # the runs with param_dtype=None, reduce_dtype=None
            _check_full_precision(name, got[run], f"{where}, rank {r}")
        calls = got["sgd"]["comm"]
        other = sorted({tuple(x) for run in ("sgd", "adamw", "bf16") for x in got[run]["other"]})
        if other:
            raise AssertionError(f"{name}: rank {r} also sent {other} (kind, phase): FSDP2 moves parameters by "
                                 f"all-gathers and gradients by reduce-scatters only; every byte a rank sends is "
                                 f"counted, point-to-point included ({where})")
        n_fwd = sum(x["kind"] == "all_gather" and x["phase"] == "forward" for x in calls)
        n_rs = sum(x["kind"] == "reduce_scatter" for x in calls)
        if n_fwd != cfg.n_layers + 1 or n_rs != cfg.n_layers + 1:
            raise AssertionError(f"{name}: {n_fwd} all-gathers in forward and {n_rs} reduce-scatters per step; one "
                                 f"unit per block plus the root makes {cfg.n_layers + 1} of each ({where})")
        if got["sgd"].get("compiled_calls") != cfg.n_layers:
            raise AssertionError(f"{name}: the compiled blocks were called {got['sgd'].get('compiled_calls')} times "
                                 f"in a step's forward; expected {cfg.n_layers}: the model's forward runs each block "
                                 f"through what torch.compile returned ({where})")
        if got["sgd"]["ffn_calls"] != 2 * cfg.n_layers:
            raise AssertionError(f"{name}: the blocks' feed-forward ran {got['sgd']['ffn_calls']} times in a step with "
                                 f"activation checkpointing; expected {2 * cfg.n_layers} (forward, then recomputed "
                                 f"in backward) ({where})")
        bf = got["bf16"]
        if bf["dtypes"] != ["torch.bfloat16"]:
            raise AssertionError(f"{name}: with param_dtype=bfloat16 the blocks compute with {bf['dtypes']} weights: "
                                 f"pass MixedPrecisionPolicy(param_dtype, reduce_dtype) to fully_shard ({where})")
        gathered = comm_bytes(bf["comm"], "all_gather", "forward")
        reduced = comm_bytes(bf["comm"], "reduce_scatter", STEP)
        if abs(reduced / max(gathered, 1) - 2) > 2 * BYTES_TOL:
            raise AssertionError(f"{name}: reduce-scattered {reduced:,} bytes for {gathered:,} all-gathered in "
                                 f"forward; bf16 parameters and fp32 gradients make it 2x: reduce_dtype=float32 "
                                 f"({where})")
        # float64, but the Llama's RMSNorm takes its mean of squares in float32 (as Meta's and HF's): a
        # different batch split moves that by an ulp, ~1e-7 relative, which AdamW's normalisation lifts to
        # ~1e-6 where a gradient is small; a slip is off by >= 1e-3 (SGD) or by the learning rate (AdamW)
        for label, params, refs, tol in (("one SGD step", got["sgd"]["params"], sgd, (1e-6, 1e-8)),
                                         (f"{steps} AdamW steps", got["adamw"]["params"], adamw, (1e-5, 1e-6))):
            for key, want in refs.items():
                assert_close(name, f"parameter {key} after {label}", params.get(key), want, f"{where}, rank {r}",
                             rtol=tol[0], atol=tol[1])
    ok(name, f"{cfg.n_layers} blocks on {world_size} ranks: order, units, recomputation, bf16/fp32 policy and "
             f"{steps} steps, seed={seed}")
