"""ZeRO-1/2's disturbed step: what the parameters prove where the memory meters cannot look.

In one more SGD step of the ZeRO-1/2 checks, ranks 1.. have their copy of the parameters disturbed between
backward and step (`disturbed_step`), each value by its own amount, drawn by the grader and given to that rank
only (`disturbance`). ZeRO-1/2 (Rajbhandari et al. 2020, sec. 5.1-5.2) step each shard on its owner, from the
owner's copy as it stands, and all-gather the updated shards. So after the step:

- every rank holds the same parameters (`verify_in_sync`): a rank that updates every parameter itself, from the
  whole gradient and the whole optimizer state (DDP's way), keeps its own disturbance;
- each value carries its owner's disturbance (`verify_owners`): about (N - 1) / N of the values moved by what a
  rank 1.. added. A rank that also keeps a hidden full copy of the parameters (numpy, out of every tensor
  meter's sight) and steps it instead shows none, and no rank can tell another's disturbance without sending
  it: (N - 1) / N Psi more on the wire, which the sockets count.
"""

from __future__ import annotations

import torch
from torch import nn

from dlo.checks.day5_zero import batch, count_psi, lm_loss, optimizer_for, tied_lm
from dlo.grading.compare import DTYPE

DISTURBANCE, SPREAD = 0.5, 0.05  # a value of ranks 1.. moves by DISTURBANCE + U(0, SPREAD), each its own
OWNED_TOL = 1e-9  # |after - (undisturbed + owner's disturbance)|: float64 agrees with one process to ~1e-15


def disturbance(c: dict, seed: int, r: int) -> dict:
    """{parameter name: what rank r adds to it} (nothing on rank 0), from the case's seed: the grader draws it
    and gives each rank its own (`day5_worker.rank_part`)."""
    if r == 0:
        return {}
    g = torch.Generator().manual_seed(seed * 1009 + r)
    return {k: DISTURBANCE + SPREAD * torch.rand(p.shape, generator=g, dtype=DTYPE)
            for k, p in tied_lm(c, 0).named_parameters()}


def disturbed_step(engine, model: nn.Module, batch, disturb: dict) -> None:
    """On a rank: one SGD step in which this rank's copy of the parameters is moved by `disturb` between backward and
    step, as a lost update or a flipped bit would (see the module's text)."""
    lm_loss(engine, *batch).backward()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key in disturb:
                p.add_(disturb[key].to(p.dtype))
    engine.step()
    engine.zero_grad()


def verify_in_sync(name: str, res: list, stage: int, where: str) -> None:
    """Every rank holds rank 0's parameters after the disturbed step, bit for bit: it catches DDP in ZeRO's clothes
    - a reduce-scatter and an all-gather of the *gradients* (ZeRO-1's bytes, its counters and its sockets agree),
    then every parameter updated on every rank with the whole optimizer state kept where a tensor meter does not
    look - from the parameters alone, which no code on the rank can rewrite after they are sent."""
    for r, got in enumerate(res[1:], 1):
        for key, want in res[0]["drift"].items():
            g = got["drift"].get(key)
            if g is not None and g.shape == want.shape and torch.equal(g, want):
                continue
            off = "is not seen in its forward" if g is None or g.shape != want.shape else \
                f"differs from rank 0's by up to {(g - want).abs().max().item():.3g}"
            raise AssertionError(
                f"{name}: rank {r}'s copy of the parameters was disturbed (+{DISTURBANCE:g} to "
                f"{DISTURBANCE + SPREAD:g} on every value) between backward and a step; after the step its {key} "
                f"{off}. A ZeRO-{stage} step ends with the all-gather of the updated shards, which gives every rank "
                f"its owners' values, so the copies cannot drift; a rank that updates every parameter itself, with "
                f"the whole optimizer state (DDP's way, however the whole gradient reached it), keeps the "
                f"disturbance ({where})")


def drift_reference(c: dict, seed: int, n: int) -> dict:
    """The parameters after the checks' SGD step and the disturbed one without the disturbance: one process, two
    steps on the global batch of step 0 (both steps' batch on the ranks)."""
    model = tied_lm(c, seed + 1)
    opt_cls, kw = optimizer_for(c, "sgd")
    opt = opt_cls(model.parameters(), **kw)
    for _ in range(2):
        lm_loss(model, *batch(c, seed, 0, n * c["per_rank"])).backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in model.named_parameters()}


def verify_owners(name: str, res: list, c: dict, seed: int, n: int, stage: int, where: str) -> None:
    """After the disturbed step (the ranks agree: `verify_in_sync`), about (N - 1) / N of the values carry the
    disturbance of a rank 1.., their owner's; at least half that share is asked (honest layouts differ by their
    padding only, a few percent)."""
    want, drawn = drift_reference(c, seed, n), [disturbance(c, seed, r) for r in range(1, n)]
    carried = 0
    for key, u in want.items():
        g = res[0]["drift"].get(key)
        if g is None or g.shape != u.shape:  # rank 0's is what verify_in_sync holds the others to: all of it
            raise AssertionError(f"{name}: after the disturbed step rank 0's {key} was not seen in its forward: the "
                                 f"grader got no value of it to check ({where})")
        off = g.to(DTYPE) - u
        carried += int(torch.stack([(off - d[key]).abs() <= OWNED_TOL for d in drawn]).any(0).sum())
    psi = count_psi(c)
    share = psi * (n - 1) // n
    if carried < share / 2:
        raise AssertionError(
            f"{name}: ranks 1.. had their parameters disturbed between backward and a step (each value by its own "
            f"+{DISTURBANCE:g} to {DISTURBANCE + SPREAD:g}); after the step {carried:,} of the {psi:,} values carry "
            f"their owner's disturbance, ZeRO-{stage} about {share:,}: each rank steps its own shard of the "
            f"parameters as it holds them, and the all-gather hands its values to every rank. A rank that steps "
            f"every parameter from a copy of its own (a hidden full copy with the whole optimizer state: DDP's way) "
            f"shows none ({where})")
