"""Day 5: FSDP2's `reshard_after_forward` and prefetching, counted at the full profile's world size.

`reshard_prefetch(P, world_size)` shards a small Llama (the comparison config cut to `BLOCKS` blocks) with
torch's `fully_shard` inside a fake process group of `world_size` ranks (`dlo.plan.fake_world`: one
process, every collective returns at once), once per entry of `variants(world_size)`, and runs two forward and
backward passes (the second is counted: the first also initialises FSDP2). It counts, exactly:

- every all-gather and reduce-scatter of the step and its bytes, by phase (`dlo.measure.CommCounter`);
- the bytes of parameters held gathered beyond each rank's resident 1/N shard, sampled at every
  collective (memory only grows when an all-gather starts): a unit gathered, or being gathered, holds
  all its bytes; a unit resharded to k ranks after forward (`reshard_after_forward=k`) holds 1/k.

Which units are gathered is read from FSDP2 itself (each unit's registered parameters: plain tensors
when unsharded, DTensors sharded over k ranks and replicated across the others when resharded to k),
and one private attribute of torch 2.13's `FSDPParamGroup`, `_all_gather_result`: a prefetched
all-gather started but not yet copied out, which no public API shows. Not counted: FSDP2's flat
all-gather buffer during the copy-out and the gradients (a transient of about one unit each), and
the padding FSDP2 adds to rows not divisible by N (none in the course's Llamas at 8 ranks).

`reshard_claims(rows)` puts each count beside the formula in units of the root R (tied embedding
and final norm), a block B and Psi = R + L B. Nothing here is timed: whether prefetching hides the
all-gathers behind compute is a GPU question ("not measurable here").
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dlo.measure import CommCounter, tally

BLOCKS = 4  # enough to tell one gathered block from two, and a block from the 1/k shards of the others
TOKENS = 16  # per pass: the counts do not depend on the data, only the compute does
FSDP2_DOCS = "torch fully_shard docs"


def variants(world_size: int) -> list[tuple]:
    """(reshard_after_forward, prefetch) pairs: True / False / world_size // 2 (e.g. the ranks of one node
    of two), each without and with explicit prefetching of the next block."""
    return [(raf, d) for raf in (True, False, world_size // 2) for d in (0, 1)]


def _units(model) -> dict:
    """{name: (unit, [(module, param name)])}: the root and each block, with the parameters each
    owns (the root: every parameter outside the blocks; a tied weight once)."""
    blocks = {f"layers.{k}": b for k, b in model.layers.items()}
    inside = {id(m) for b in blocks.values() for m in b.modules()}
    owned, seen = [], set()
    for m in model.modules():
        for n, p in m.named_parameters(recurse=False):
            if id(m) not in inside and id(p) not in seen:
                seen.add(id(p))
                owned.append((m, n))
    out = {"root": (model, owned)}
    out.update({name: (b, [(m, n) for m in b.modules() for n, _ in m.named_parameters(recurse=False)])
                for name, b in blocks.items()})
    return out


def _gathered_bytes(units: dict, full: dict) -> dict:
    """{unit: bytes held beyond the 1/N shard} now: all of it when gathered or being gathered, the
    local shard when resharded to fewer ranks than N after forward, 0 when sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, (unit, owned) in units.items():
        if fully_shard.state(unit)._fsdp_param_group._all_gather_result is not None:  # prefetched, in flight
            out[name] = full[name]
            continue
        held = 0
        for m, n in owned:
            p = getattr(m, n)
            if not isinstance(p, DTensor):
                held += p.numel() * p.element_size()
            elif any(isinstance(pl, Replicate) for pl in p.placements):  # the post-forward 1/k shard
                held += p.to_local().numel() * p.element_size()
        out[name] = held
    return out


class _HeldCounter(CommCounter):
    """CommCounter that also samples the gathered bytes at every collective (plus the all-gather
    just issued: its unit is marked only once the call returns), the peak kept per phase."""

    def __init__(self, units: dict, full: dict):
        super().__init__()
        self.units, self.full = units, full
        self.peak: dict = {}

    def sample(self, issued: int = 0) -> None:
        """Keep the gathered bytes now (+ `issued`, an all-gather's output) if they are this phase's peak."""
        held = sum(_gathered_bytes(self.units, self.full).values()) + issued
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.calls)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.calls) > n:
            call = self.calls[-1]
            self.sample(call.nbytes if call.kind == "all_gather" else 0)
        return out


def sharded_llama(cfg, mesh, reshard=True, prefetch: int = 0) -> tuple:
    """(model, blocks): the Llama of `cfg` built on the meta device, each block and then the root a
    `fully_shard` unit over `mesh` (a 1-D mesh: FSDP; a 2-D (replicate, shard) mesh: HSDP), with explicit
    prefetching of the next `prefetch` blocks each way, materialised on the CPU and initialised (seed 0).
    Inside a process group (`dlo.plan.fake_world`)."""
    from torch.distributed.fsdp import fully_shard

    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    blocks = list(model.layers.values())
    for b in blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)  # every unit alike, the root too
    for i, b in enumerate(blocks):  # explicit prefetching: the next `prefetch` blocks, each way
        if prefetch:
            b.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            b.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model, blocks


def measure_variant(cfg, world_size: int, reshard, prefetch: int, x, y) -> dict:
    """One `fully_shard` configuration at `world_size` ranks: collectives and gathered-bytes peaks of its
    second forward and backward (fp32)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.experiments.day5_data import lm_loss
    from dlo.plan import fake_world

    with fake_world(world_size):
        model, blocks = sharded_llama(cfg, init_device_mesh("cpu", (world_size,)), reshard, prefetch)
        units = _units(model)
        full = {name: sum(getattr(m, n).numel() * getattr(m, n).element_size() for m, n in owned)
                for name, (_, owned) in units.items()}
        lm_loss(model, x, y).backward()  # lazy initialisation: FSDP2 learns the root and the order
        model.zero_grad()
        with _HeldCounter(units, full) as c:
            c.phase = "forward"
            loss = lm_loss(model, x, y)
            c.phase = "backward"
            c.sample()  # what forward left gathered is backward's first state (no collective shows it)
            loss.backward()
    comm = {f"{k} ({p})": row for (k, p), row in tally(c.records()).items()}
    return {"reshard_after_forward": reshard, "prefetch": prefetch, "world": world_size, "comm": comm,
            "peak": dict(c.peak), "root": full["root"], "block": full["layers.0"], "blocks": len(blocks),
            "psi": sum(full.values())}


def reshard_prefetch(P, world_size: int) -> list[dict]:
    """`measure_variant` for every entry of `variants(world_size)` on P.compare_model cut to `BLOCKS`
    blocks, one batch of `TOKENS` tokens (in this process; CPU seconds on the tiny model)."""
    from dlo.experiments.day5_data import check_world, llama_config, token_batches

    if world_size < 4 or world_size % 2:
        raise ValueError(f"world_size={world_size}: need an even world size of at least 4 ranks "
                         f"(reshard_after_forward=world_size // 2 must be a divisor other than 1 and the world size)")
    check_world(P, world_size)
    cfg = replace(llama_config(P, "compare_model"), n_layers=BLOCKS)
    x, y = token_batches(P, cfg, 0, "cpu", n=1)[0]
    x, y = x[:1, :TOKENS], y[:1, :TOKENS]
    threads = torch.get_num_threads()
    if cfg.dim <= 256:  # CPU-sized tensors gain nothing from threads (as in memory_vs_world)
        torch.set_num_threads(1)
    try:
        return [measure_variant(cfg, world_size, raf, d, x, y) for raf, d in variants(world_size)]
    finally:
        torch.set_num_threads(threads)


def predicted(r: dict) -> dict:
    """The formulas for one row, in bytes (R root, B block, L blocks, Psi = R + L B, N ranks; k the
    ranks a unit is resharded to after forward, d the blocks prefetched explicitly):

    - all-gathers: L + 1 in forward; L + 1 again in backward unless reshard_after_forward=False
      (then none: the units stay gathered); Psi bytes each pass. Reduce-scatters: L + 1, Psi.
    - sent in backward's all-gathers: (k-1)/k Psi (k = N when resharding to all ranks, 0 when not).
    - gathered in forward: R + (1 + d) B (one more unit per prefetched block); False keeps every
      unit, Psi; k keeps 1/k of the blocks already run: + (L - 1 - d) B / k.
    - gathered in backward: FSDP2 prefetches the next unit even when not told (implicit backward
      prefetch): R + 2 B; False: Psi; k: + (L - 1) B / k (the blocks not yet gathered again).
    """
    R, B, L, psi, N, d = r["root"], r["block"], r["blocks"], r["psi"], r["world"], r["prefetch"]
    raf = r["reshard_after_forward"]
    k = N if raf is True else 0 if raf is False else raf
    back_ag = 0 if raf is False else L + 1
    fw = psi if raf is False else R + (1 + d) * B + ((L - 1 - d) * B // k if raf is not True else 0)
    bw = psi if raf is False else R + 2 * B + ((L - 1) * B // k if raf is not True else 0)
    return {"all_gather (forward)": (L + 1, psi), "all_gather (backward)": (back_ag, psi if back_ag else 0),
            "reduce_scatter (backward)": (L + 1, psi), "sent all_gather (backward)": (k - 1) / k * psi if k else 0.0,
            "peak forward": fw, "peak backward": bw}


def table(rows: list[dict]) -> list[dict]:
    """One line per variant: counts and bytes measured, peaks measured / predicted."""
    from dlo.measure import fmt_bytes

    out = []
    for r in rows:
        p, c = predicted(r), r["comm"]
        ag_f, ag_b, rs = (c.get(k, {"calls": 0, "bytes": 0, "sent": 0.0}) for k in
                          ("all_gather (forward)", "all_gather (backward)", "reduce_scatter (backward)"))
        out.append({"reshard_after_forward": r["reshard_after_forward"], "prefetch": r["prefetch"],
                    "all-gathers fwd + bwd": f"{ag_f['calls']} + {ag_b['calls']}",
                    "gathered bytes fwd + bwd": f"{fmt_bytes(ag_f['bytes'])} + {fmt_bytes(ag_b['bytes'])}",
                    "bwd sent": fmt_bytes(ag_b["sent"]), "reduce-scatters": f"{rs['calls']} ({fmt_bytes(rs['bytes'])})",
                    "peak held fwd (formula)": f"{fmt_bytes(r['peak']['forward'])} ({fmt_bytes(p['peak forward'])})",
                    "peak held bwd (formula)": f"{fmt_bytes(r['peak']['backward'])} "
                                               f"({fmt_bytes(p['peak backward'])})"})
    return out


def reshard_claims(rows: list[dict]) -> list:
    """The formulas' statements beside the counts (exact: a tolerance of half a byte or a call), and
    the one claim about time, which a fake process group cannot judge."""
    from dlo.claims import Claim, approx, exact, not_measurable

    at = {(r["reshard_after_forward"], r["prefetch"]): r for r in rows}
    k = rows[0]["world"] // 2
    how, held = "counted (CommCounter), fake process group", "units gathered at every collective, sizes counted"

    def claim(what, claimed, want, got, basis=how):
        return Claim(what, FSDP2_DOCS, claimed, approx(want, abs_tol=0.5, text=f"= {want:,.0f}"), exact(got, basis))

    def comm(r, key, field):
        return r["comm"].get(key, {}).get(field, 0)

    out = []
    for raf, claimed in ((True, "2 Psi gathered + Psi reduced = 3 Psi"), (False, "Psi + Psi = 2 Psi"),
                         (k, "3 Psi, backward's gathers over k ranks")):
        r, p = at[(raf, 0)], predicted(at[(raf, 0)])
        want = p["all_gather (forward)"][1] + p["all_gather (backward)"][1] + p["reduce_scatter (backward)"][1]
        out.append(claim(f"raf={raf}: bytes all-gathered + reduce-scattered per step", claimed, want,
                         sum(row["bytes"] for row in r["comm"].values())))
    out.append(claim("raf=False: all-gathers in backward", "none (units stay gathered)", 0,
                     comm(at[(False, 0)], "all_gather (backward)", "calls")))
    out.append(claim(f"raf={k}: bytes sent by backward's all-gathers (ring)", "(k-1)/k Psi instead of (N-1)/N Psi",
                     predicted(at[(k, 0)])["sent all_gather (backward)"],
                     comm(at[(k, 0)], "all_gather (backward)", "sent")))
    out.append(claim("prefetching: collectives added (any raf)", "none: it moves them earlier", 0,
                     max(abs(sum(c["calls"] for c in at[(raf, 1)]["comm"].values())
                             - sum(c["calls"] for c in at[(raf, 0)]["comm"].values())) for raf in (True, False, k))))
    for (raf, d, phase), claimed in {(True, 0, "forward"): "R + B: one block at a time",
                                     (True, 1, "forward"): "R + 2 B: one more unit gathered at a time",
                                     (True, 0, "backward"): "R + 2 B (FSDP2 prefetches in backward untold)",
                                     (False, 0, "backward"): "Psi: every unit kept from forward",
                                     (k, 0, "backward"): "R + 2 B + (L-1) B / k"}.items():
        r = at[(raf, d)]
        out.append(claim(f"raf={raf}, prefetch {d}: peak gathered in {phase}", claimed,
                         predicted(r)[f"peak {phase}"], r["peak"][phase], held))
    out.append(not_measurable("prefetching hides each all-gather behind the previous unit's compute",
                              FSDP2_DOCS, "step time closer to compute alone",
                              "a fake process group's collectives take no time; a GPU question"))
    return out


__all__ = ["BLOCKS", "TOKENS", "measure_variant", "predicted", "reshard_claims", "reshard_prefetch", "table",
           "variants"]
