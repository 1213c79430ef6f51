"""What a ZeRO rank keeps, against the ZeRO paper's formulas (`dlo.distributed.zero.memory_per_rank`): after
the step (`verify_memory`), during ZeRO-2's backward (`verify_backward`), during ZeRO-3's forward
(`verify_forward`) and its backward (`verify_unit_backward`), from the samples the worker took on the rank
(`dlo.checks.day5_worker`).

Two meters, both on the rank (what they cannot see: lib/dlo/grading/README.md): `held_bytes`, walked from
the engine, and `live_bytes`, every tensor of the rank. The rank's tensors are counted from before the
student's objects were unpickled, so a tensor kept where the walk does not go (a class attribute, a module
global, a closure) counts whenever it was made: in __init__, at the step before, or in forward. A check that
counted only what grew during backward let a ZeRO-2 keep every full gradient in a buffer made before it.
"""

from __future__ import annotations

import math

from dlo.checks.day5_zero import count_psi, tied_lm
from dlo.distributed.zero import memory_per_rank
from dlo.grading.compare import DTYPE
from dlo.models import count_parameters


def backward_in_flight(c: dict) -> int:
    """What a correct ZeRO-2/3 rank's tensors may hold during backward (or ZeRO-3's forward) beyond what its engine
    and autograd's saved activations hold (`day5_worker.outside_sampler`): autograd's gradients in flight, made
    visible to Python on a graded rank (a few activation gradients, rows x the widest layer, and a weight's
    gradient before it is accumulated), and the last two buckets, whose reduce-scatter's thread lets go of them a
    moment after wait() returns. Measured at seeds 0..7, 2 and 3 ranks (2026-11-30): the solution's growth reached
    0.17-0.32 Psi (about two activation gradients and a weight's), an engine keeping every full gradient until its
    last hook 1.3-1.5 Psi (1.03-1.10 just before that hook); this allows 0.37-0.66 Psi (over seeds 0..199)."""
    model = tied_lm(c, 0)
    biggest = max(p.numel() for p in model.parameters())
    rows, width = c["per_rank"] * c["T"], max(c["vocab"], c["hidden"], c["dim"])
    return 8 * (2 * rows * width + 2 * biggest + 2 * (60 + biggest))


def memory_slack(c: dict, n: int, stage: int = 0) -> int:
    """What a correct engine may hold beyond the formula (`ALLOWED` says it in words). ZeRO-1, exactly: the
    averaged gradient shard its optimizer reads (S = ceil(Psi / N) values, alive from the step to zero_grad:
    the formula counts the full gradient, not this second copy of a slice; +17% on the exercise's 2-rank
    case, 77,340 bytes held against the formula's 66,272), the padding of its two flat buffers (N - 1
    elements each) and AdamW's step counters (one small tensor per optimizer parameter). ZeRO-2/3, whose
    buckets and units the check does not know: N - 1 elements of padding per tensor, for parameters,
    gradients and two moments, the step counters, and one parameter's full gradient (the last one produced
    may wait for its bucket)."""
    model = tied_lm(c, 0)
    tensors = len(list(model.parameters()))
    counters = 16 * tensors
    if stage == 1:
        return 8 * math.ceil(count_psi(c) / n) + 2 * 8 * (n - 1) + counters
    biggest = max(p.numel() for p in model.parameters())
    return 8 * 4 * (n - 1) * tensors + counters + 2 * 8 * biggest


ALLOWED = {1: "the averaged gradient shard the optimizer reads (S values, until zero_grad), the two flat buffers' "
              "padding and AdamW's step counters",
           2: "padding, AdamW's step counters and one parameter's full gradient waiting for its bucket",
           3: "padding, AdamW's step counters and one parameter's full gradient waiting for its unit"}


def verify_memory(name: str, res: list, c: dict, stage: int, n: int, where: str) -> dict:
    psi = count_psi(c)
    want = memory_per_rank(psi, n, stage, param_dtype=DTYPE, optimizer="adamw")["total"]
    slack = memory_slack(c, n, stage)
    for r, got in enumerate(res):
        outside = max(0, got["live"] - got["held"])  # the rank's growth that the walk from the engine does not reach
        if got["held"] + outside > want + slack and outside > 0:
            raise AssertionError(f"{name}: rank {r} keeps {got['held'] + outside:,} bytes of tensors alive after the "
                                 f"step, {outside:,} of them outside the engine object (a class attribute, a module "
                                 f"global, a cache it does not hold); ZeRO-{stage} holds {want:,} by the formula (+ "
                                 f"{slack:,} allowed): what a rank keeps counts wherever it is kept ({where})")
        if got["held"] > want + slack:
            raise AssertionError(f"{name}: rank {r} holds {got['held']:,} bytes of model state after the step; ZeRO-"
                                 f"{stage} holds {want:,} by the formula (+ {slack:,} allowed: "
                                 f"{ALLOWED.get(stage, 'padding')}): something replicated "
                                 f"should be sharded, or a full-size buffer outlives the step ({where})")
    return {"psi": psi, "want": want, "slack": slack}


def _sampled(name: str, r: int, got: dict, what: tuple[str, ...], least: dict, where: str) -> None:
    """Each sample list the check reads holds what the watched step takes at least (`least`: one per block's
    forward, one at the last gradient): an empty one would say nothing was held."""
    for key in what:
        n = len(got["samples"][key])
        if n < least[key]:
            raise AssertionError(f"{name}: rank {r} returned {n} of the {least[key]} or more samples of its memory "
                                 f"during the watched {'forward' if key == 'forward' else 'step'} ({key}): the grader "
                                 f"got nothing to hold to the formula ({where})")


def verify_backward(name: str, res: list, c: dict, m: dict, cap: float, where: str) -> None:
    """ZeRO-2 during backward: the rank's tensors outside the engine and the activations (`outside`, counted from
    before the student's objects existed), and what the engine holds (`backward`)."""
    psi_b, in_flight = 8 * m["psi"], backward_in_flight(c)
    biggest = max(p.numel() for p in tied_lm(c, 0).parameters())
    peak_allowed = m["want"] + m["slack"] + 8 * 2 * (round(cap * 2 ** 20 / 8) + biggest)
    for r, got in enumerate(res):
        _sampled(name, r, got, ("outside", "backward"), {"outside": 1, "backward": 1}, where)
        outside = max(got["samples"]["outside"])
        if outside > in_flight:
            raise AssertionError(f"{name}: during backward rank {r} kept up to {outside:,} bytes of tensors outside "
                                 f"the engine object (a class attribute, a module global, a buffer made before "
                                 f"backward began), the full gradient is {psi_b:,}; ZeRO-2 never holds the whole "
                                 f"gradient, wherever it is kept and whenever it was made ({in_flight:,} allowed for "
                                 f"autograd's gradients in flight and buckets a finished reduce-scatter has not let go "
                                 f"of): reduce-scatter each bucket as it fills, from its last gradient's hook, and "
                                 f"keep no full-size gradient buffer ({where})")
        peak = max(got["samples"]["backward"])
        if peak > peak_allowed:
            raise AssertionError(f"{name}: during backward rank {r} held up to {peak:,} bytes; ZeRO-2 keeps only the "
                                 f"gradient shard and the buckets in flight ({peak_allowed:,} allowed): free a "
                                 f"bucket's full gradients (and p.grad) once its reduce-scatter is done ({where})")


def _unit_and_root(c: dict, m: dict) -> tuple[int, int]:
    """ZeRO-3's units: the parameters of one block, and of the root (embedding, final norm: the rest)."""
    unit = count_parameters(tied_lm(c, 0).blocks[0])
    return unit, m["psi"] - c["n_blocks"] * unit


def verify_forward(name: str, res: list, c: dict, m: dict, where: str) -> None:
    """ZeRO-3 during forward: what the engine holds after each unit's forward (`forward`), and the rank's tensors
    outside the engine and the activations after the last unit's (`outside`): a gathered copy kept where the
    walk from the engine does not go counts too."""
    unit, root = _unit_and_root(c, m)
    allowed, in_flight = m["want"] + m["slack"] + 8 * (root + unit), backward_in_flight(c)
    for r, got in enumerate(res):
        _sampled(name, r, got, ("outside", "forward"), {"outside": 1, "forward": c["n_blocks"]}, where)
        outside = max(got["samples"]["outside"])
        if outside > in_flight:
            raise AssertionError(f"{name}: during forward rank {r} kept up to {outside:,} bytes of tensors outside the "
                                 f"engine object (a class attribute, a module global, a closure it does not hold), "
                                 f"the whole model is {8 * m['psi']:,}; ZeRO-3 keeps its shards and the unit being "
                                 f"computed, wherever a copy is kept ({in_flight:,} allowed for activations and "
                                 f"collectives' buffers in flight): free each unit's gathered parameters after its "
                                 f"forward and keep no other copy of them ({where})")
        peak = max(got["samples"]["forward"])
        if peak > allowed:
            raise AssertionError(f"{name}: after the forward of a unit rank {r} held up to {peak:,} bytes ({allowed:,} "
                                 f"allowed: the shards, the root and one unit): free each unit's gathered parameters "
                                 f"after its forward ({where})")


def verify_unit_backward(name: str, res: list, c: dict, m: dict, where: str) -> None:
    """ZeRO-3 during backward: what the engine holds after each gradient (`backward`). A unit is gathered again when
    backward reaches it and freed once its gradients are reduce-scattered, so the engine holds the shards, the root
    (gathered for the whole backward), the unit being computed, one more (a prefetch) and one unit's gradients. A
    ZeRO-3 that gathered every unit again and kept it, with every full gradient, until the step passed the forward's
    samples and the step's byte totals (a red team's, 2026-12-02: 8.9-9.8 units above the formula and its slack,
    the solution 0.55-0.78; allowed the root and 3 units)."""
    unit, root = _unit_and_root(c, m)
    allowed = m["want"] + m["slack"] + 8 * (root + 3 * unit)
    n_grads = len(list(tied_lm(c, 0).parameters()))
    for r, got in enumerate(res):
        _sampled(name, r, got, ("backward",), {"backward": n_grads}, where)
        peak = max(got["samples"]["backward"])
        if peak > allowed:
            raise AssertionError(f"{name}: during backward rank {r} held up to {peak:,} bytes ({allowed:,} allowed: "
                                 f"the shards, the root, two gathered units and one unit's gradients; the whole model "
                                 f"is {8 * m['psi']:,}): reduce-scatter each unit's gradients as soon as its last one "
                                 f"arrives, drop them (p.grad = None) and free the unit's gathered parameters, during "
                                 f"backward ({where})")
