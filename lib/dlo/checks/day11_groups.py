"""Day 11's discriminative learning rates: `check_discriminative_groups`, re-exported by `dlo.checks.day11`.
The reference is `dlo.tuning.transfer.discriminative_groups` on the same blocks; the worker maps the returned
groups back to the blocks' names and records each rate's type (a string or a tensor is no learning rate).
"""

from __future__ import annotations

import numbers
import random

import torch
from torch import nn

from dlo.checks.day11_transfer import TRANSFER
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok
from dlo.tuning.transfer import discriminative_groups

# ----------------------------------------------------------------------------- discriminative learning rates

def _block(kind: str, a: int, b: int) -> nn.Module:
    return {"linear": lambda: nn.Linear(a, b), "norm": lambda: nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b)),
            "prelu": lambda: nn.Sequential(nn.Linear(a, b), nn.PReLU(b)), "gru": lambda: nn.GRUCell(a, b)}[kind]()


def _blocks(rng: random.Random, t: int) -> list[nn.Module]:
    """3-5 blocks, input to output; one frozen whole (case 0: the last, the output's) and one in part (its first
    parameter, or its second, the rest of the block trains). Cases 0 and 1 have a trainable PReLU or GRUCell block:
    parameters not named weight and bias of a Linear or LayerNorm (a red team listed only those, 2026-11-30). Case 2
    (and case 3 at random) has one more block without parameters (a ReLU, Dropout or Identity: a block all the same,
    counted in L) after a trainable one (a red team's depth counted only blocks with parameters, 2026-12-01)."""
    widths = [rng.choice([2, 3, 4]) for _ in range(rng.randint(4, 6))]
    kinds = [rng.choice(["linear", "norm", "linear", "norm", "prelu", "gru"]) for _ in widths[1:]]
    whole = len(kinds) - 1 if t == 0 else rng.randrange(len(kinds))
    if t < 2:
        kinds[rng.choice([i for i in range(len(kinds)) if i != whole])] = ("gru", "prelu")[t]
    blocks = [_block(kind, a, b) for kind, a, b in zip(kinds, widths, widths[1:])]
    for p in blocks[whole].parameters():
        p.requires_grad_(False)
    part = rng.choice([i for i in range(len(blocks)) if i != whole])
    params = list(blocks[part].parameters())
    params[0 if t == 1 or rng.random() < 0.3 else 1].requires_grad_(False)
    if t == 2 or (t == 3 and rng.random() < 0.5):
        first = min(i for i in range(len(blocks)) if i != whole)   # a trainable block below it: its rate tells
        blocks.insert(rng.randint(first + 1, len(blocks)), rng.choice([nn.ReLU(), nn.Dropout(0.1), nn.Identity()]))
    return blocks


def _label_groups(groups, blocks) -> list[dict]:
    """Each group's parameters by name, its rate as a float (None: no number) and the type of its "lr" (None: no
    "lr"), read where the groups were made (a float() here turned a red team's string rates into numbers)."""
    names = {id(p): f"block {i}: {n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    out = []
    for g in groups:
        params = g.get("params") if isinstance(g, dict) else None
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        lr = g.get("lr") if isinstance(g, dict) else None
        number = isinstance(lr, numbers.Real) and not isinstance(lr, bool)
        out.append({"params": [names.get(id(p), "a parameter of no block") for p in params],
                    "lr": float(lr) if number else None,
                    "lr_type": type(lr).__name__ if isinstance(g, dict) and "lr" in g else None})
    return out


def _groups_worker(groups_fn, blocks, lr: float, factor: float | None) -> dict:
    groups = groups_fn(blocks, lr) if factor is None else groups_fn(blocks, lr, factor)   # None: its default
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return {"type": type(groups).__name__}
    return {"groups": _label_groups(groups, blocks)}


def _close(lrs: list[float], wrong: list[float]) -> bool:
    return len(lrs) == len(wrong) and all(abs(a - b) <= 1e-12 * b for a, b in zip(lrs, wrong))


def _rate_slip(lrs, blocks, lr: float, factor: float, given: bool, want: list) -> str | None:
    """The mistake that gives the rates `lrs` for the right groups, if a known one does."""
    L = len(blocks)
    ks = [k for k, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())]
    if not given and ks[0] < L - 1 and lrs[0] > 0:   # the rates of another factor: the default is not 2.6
        implied = (lr / lrs[0]) ** (1 / (L - 1 - ks[0]))
        if abs(implied - factor) > 1e-9 and _close(lrs, [lr / implied ** (L - 1 - k) for k in ks]):
            return (f"called without `factor`, it divided by {implied:g}: the default is {factor:g} (ULMFiT's, as "
                    f"in the signature given: factor={factor:g})")
    swapped = (want[::-1], [lr / factor ** k for k in ks], [lr / factor ** j for j in range(len(want))])
    if any(_close(lrs, wrong) for wrong in swapped):
        return ("the learning rates are swapped: the block nearest the output gets lr, the one nearest the input the "
                "smallest")
    owning = [k for k, b in enumerate(blocks) if any(True for _ in b.parameters())]
    if len(owning) < L and _close(lrs, [lr / factor ** (len(owning) - 1 - owning.index(k)) for k in ks]):
        return ("a block without parameters (an activation, a Dropout) still counts: L is the number of blocks "
                "given and k a block's index among all of them")
    kept = [lr / factor ** (len(want) - 1 - k) for k in range(len(want))]   # L: the groups kept
    top = [lr / factor ** (ks[-1] - k) for k in ks]                           # lr to the last block that trains
    if any(_close(lrs, wrong) for wrong in (kept, top)):
        return ("a frozen block still counts: block k of L gets lr / factor^(L-1-k), L counting every block given, "
                "also the ones left out (a frozen last block included: then no group gets lr)")
    return None


@check(forbid=TRANSFER, hint="build the list of dicts yourself")
def check_discriminative_groups(groups_fn, seed: int = 0, trials: int = 4) -> None:
    """`groups_fn(blocks, lr, factor) -> [{"params": [...], "lr": ...}, ...]` equal to dlo's
    `discriminative_groups`: one group per block with trainable parameters, input to output, block k of L at
    lr / factor^(L-1-k), frozen parameters left out; `factor` 2.6 when not given (case 1)."""
    name, rng = "discriminative_groups", random.Random(case_seed(seed))
    for t in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        blocks = _blocks(rng, t)
        lr, factor = rng.choice([1e-3, 3e-4, 0.01]), rng.choice([2.6, 2.0, 3.0])
        given = t != 1   # case 1 leaves factor out: its default, 2.6 (a red team's default was 2.0, 2026-12-01)
        factor = factor if given else 2.6
        want = _label_groups(discriminative_groups(blocks, lr, factor), blocks)
        frozen = {f"block {i}: {n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()
                  if not p.requires_grad}
        got = run_student(_groups_worker, groups_fn, blocks, lr, factor if given else None)
        empty = [k for k, b in enumerate(blocks) if not any(True for _ in b.parameters())]
        case = (f"{len(blocks)} blocks, lr={lr:g}, " + (f"factor={factor:g}" if given else "factor not given") +
                f", frozen: {sorted(frozen)}" + (f", block {empty[0]} without parameters" if empty else ""))
        if "type" in got:
            raise AssertionError(f"{name}: return a list of dicts {{'params': [...], 'lr': ...}}, got {got['type']}")
        got = got["groups"]
        listed = [p for g in got for p in g["params"]]
        trainable = [p for g in want for p in g["params"]]
        if [p for p in listed if p in frozen]:
            raise AssertionError(f"{name}: frozen parameter {next(p for p in listed if p in frozen)} is in a group: "
                                 f"leave out the parameters with requires_grad=False ({case})")
        twice = sorted({p for p in listed if listed.count(p) > 1})
        if twice:
            raise AssertionError(f"{name}: {twice[0]} is in two groups: each parameter in exactly one ({case})")
        missing = [p for p in trainable if p not in listed]
        if missing:
            raise AssertionError(f"{name}: {missing[0]} is in no group: every trainable parameter of every block "
                                 f"(weights and biases, nested layers) belongs to its block's group ({case})")
        if [g["params"] for g in got] != [g["params"] for g in want]:
            raise AssertionError(f"{name}: the groups are not one per block with trainable parameters, in the "
                                 f"blocks' order (input to output), each in the block's parameters() order ({case}): "
                                 f"expected {[g['params'] for g in want]}, got {[g['params'] for g in got]}")
        if any(g["lr_type"] is None for g in got):
            raise AssertionError(f"{name}: every group needs its own 'lr' ({case})")
        text = next((g["lr_type"] for g in got if g["lr"] is None), None)
        if text:
            raise AssertionError(f"{name}: a group's 'lr' is a {text}: give the rate as a number, lr / "
                                 f"factor ** (L - 1 - k) (an optimizer compares it with 0 and multiplies by it) "
                                 f"({case})")
        lrs, want_lrs = [g["lr"] for g in got], [g["lr"] for g in want]
        if _close(lrs, want_lrs):
            continue
        slip = _rate_slip(lrs, blocks, lr, factor, given, want_lrs)
        if slip:
            raise AssertionError(f"{name}: {slip} ({case}): expected {want_lrs}, got {lrs}")
        raise AssertionError(f"{name}: learning rates {lrs}, expected {want_lrs} ({case})")
    ok(name, f"{trials} block lists with frozen blocks and parameters: groups, order and rates")
