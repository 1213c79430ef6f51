"""Day 11's transfer-learning checks: freezing a feature extractor and discriminative learning rates.

The student's functions act on modules, so each runs in a worker (`run_student`) on models made here; the
worker trains one step or maps the returned parameters back to their names and returns plain data. The
references are `dlo.tuning.transfer.freeze` and `discriminative_groups` on identical copies of the models.
"""

from __future__ import annotations

import copy
import random

import torch
from torch import nn

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok
from dlo.tuning.transfer import NORMS, discriminative_groups, freeze

TRANSFER = ("dlo.tuning.transfer.*",)


def _norm2d(c: int, three_d: bool) -> nn.Module:
    """A BatchNorm2d, or a BatchNorm3d between two views (BatchNorm1d and 2d named one by one miss it)."""
    return nn.Sequential(nn.Unflatten(1, (c, 1)), nn.BatchNorm3d(c), nn.Flatten(1, 2)) if three_d else nn.BatchNorm2d(c)


def _model(rng: random.Random, t: int) -> nn.Module:
    """A small convnet with BatchNorm (1d, 2d, in case 0 a 3d), a Dropout and a nested block in its features,
    Identity layers at random places (the BatchNorm layers have no fixed index: a red team put the check's three
    in eval mode by their indices, 2026-11-30); a Linear head."""
    c, h = rng.choice([3, 4, 5]), rng.choice([6, 7, 9])
    layers = [nn.Conv2d(2, c, 3, padding=1), _norm2d(c, t == 0 or rng.random() < 0.3), nn.ReLU(),
              nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), _norm2d(c, rng.random() < 0.3)), nn.ReLU(),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, h), nn.BatchNorm1d(h), nn.Dropout(0.25), nn.ReLU()]
    for _ in range(rng.randint(1, 3)):
        layers.insert(rng.randint(0, len(layers)), nn.Identity())
    model = nn.Sequential(nn.Sequential(*layers), nn.Linear(h, rng.choice([2, 3, 5]))).train()
    # modules in eval mode before the freeze stay so: case 1 the Dropout, then a random one of the others (a freeze
    # that sets every other module to train mode passed while all started in it)
    others = [m for m in model[0].modules() if m is not model[0] and not isinstance(m, NORMS)]
    for m in [next(m for m in others if isinstance(m, nn.Dropout))] * (t == 1) + rng.sample(others, 1):
        m.eval()
    return model


def _freeze_worker(freeze_fn, model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict:
    count = freeze_fn(model[0])
    modes = {n: m.training for n, m in model.named_modules()}
    grad = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # all of them: requires_grad must keep the frozen ones still
    torch.manual_seed(seed)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.state_dict()
    return {"count": count, "modes": modes, "grad": grad,
            "changed": {k: not torch.equal(before[k], after[k]) for k in before}}


@check(forbid=TRANSFER, hint="set requires_grad and the BatchNorm layers' mode yourself")
def check_freeze(freeze_fn, seed: int = 0, trials: int = 3) -> None:
    """`freeze_fn(module) -> int`: no parameter of `module` trains, its BatchNorm statistics stay, the other
    modules keep their mode; the number of frozen parameters (elements) returned. Against dlo's `freeze`."""
    name, rng = "freeze", random.Random(case_seed(seed))
    for t in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        model = _model(rng, t)
        norms = [m for m in model[0].modules() if isinstance(m, NORMS)]
        norms[1].weight = norms[0].weight             # one tensor in two BatchNorms (c channels each): counted once
        for p in rng.sample(list(model[0].parameters()), 2):
            p.requires_grad_(False)                   # frozen before: still counted, still frozen
        x = torch.randn(rng.choice([6, 10]), 2, 5, 5)
        y = torch.randint(0, model[1].out_features, (x.shape[0],))
        ref = copy.deepcopy(model)
        want_count = freeze(ref[0])
        want_modes = {n: m.training for n, m in ref.named_modules()}
        got = run_student(_freeze_worker, freeze_fn, model, x, y, t)
        case = f"case {t}: {sum(p.numel() for p in ref.parameters())} parameters, {want_count} of them in features"
        moved = [k for k, c in got["changed"].items() if c and k.startswith("0.")]
        stats = [k for k in moved if "running" in k or "num_batches" in k]
        weights = [k for k in moved if k not in stats]
        if weights:
            raise AssertionError(f"{name}: frozen parameters still updated by the optimizer ({', '.join(weights[:3])}"
                                 f"): set requires_grad=False on every parameter of the module, biases and nested "
                                 f"blocks included ({case})")
        if stats:
            raise AssertionError(f"{name}: BatchNorm statistics still moving in the frozen part "
                                 f"({', '.join(stats[:3])}): requires_grad does not stop them; put every BatchNorm "
                                 f"layer in eval mode (1d, 2d and 3d: nn.modules.batchnorm._BatchNorm) ({case})")
        still = [k for k, g in got["grad"].items() if k.startswith("0.") and g]
        if still:
            raise AssertionError(f"{name}: {still[0]} still has requires_grad=True: set requires_grad=False on every "
                                 f"parameter of the module (a hook that zeroes its gradient is not frozen: weight "
                                 f"decay or momentum still move it) ({case})")
        head = [k for k, g in got["grad"].items() if k.startswith("1.") and not g]
        if head or not any(c for k, c in got["changed"].items() if k.startswith("1.")):
            raise AssertionError(f"{name}: the head no longer trains: freeze only the module given, not the model "
                                 f"({case})")
        wrong_modes = [n for n, m in got["modes"].items() if n.startswith("0") and m != want_modes[n]]
        if wrong_modes:
            which = dict(ref.named_modules())[wrong_modes[0]]
            what = ("BatchNorm layers go to eval mode" if isinstance(which, NORMS) else
                    f"only the BatchNorm layers change mode: every other module keeps the mode it had (here "
                    f"{'train' if want_modes[wrong_modes[0]] else 'eval'}), set nothing else")
            raise AssertionError(f"{name}: module {wrong_modes[0]} ({type(which).__name__}) is in "
                                 f"{'train' if got['modes'][wrong_modes[0]] else 'eval'} mode: {what} ({case})")
        if got["count"] != want_count:
            raise AssertionError(f"{name}: returned {got['count']}, expected {want_count}: the number of frozen "
                                 f"parameter elements, sum of p.numel() over module.parameters(): every one, "
                                 f"trainable before or not, a tensor shared by two layers once ({case})")
    ok(name, f"{trials} models: parameters still, BatchNorm statistics still, head trains, count")


# ----------------------------------------------------------------------------- discriminative learning rates

def _block(kind: str, a: int, b: int) -> nn.Module:
    return {"linear": lambda: nn.Linear(a, b), "norm": lambda: nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b)),
            "prelu": lambda: nn.Sequential(nn.Linear(a, b), nn.PReLU(b)), "gru": lambda: nn.GRUCell(a, b)}[kind]()


def _blocks(rng: random.Random, t: int) -> list[nn.Module]:
    """3-5 blocks, input to output; one frozen whole (case 0: the last, the output's) and one in part (its first
    parameter, or its second, the rest of the block trains). Cases 0 and 1 have a trainable PReLU or GRUCell block:
    parameters not named weight and bias of a Linear or LayerNorm (a red team listed only those, 2026-11-30)."""
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
    return blocks


def _label_groups(groups, blocks) -> list[dict]:
    names = {id(p): f"block {i}: {n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    out = []
    for g in groups:
        params = g.get("params") if isinstance(g, dict) else None
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        out.append({"params": [names.get(id(p), "a parameter of no block") for p in params],
                    "lr": float(g["lr"]) if isinstance(g, dict) and "lr" in g else None})
    return out


def _groups_worker(groups_fn, blocks, lr: float, factor: float) -> dict:
    groups = groups_fn(blocks, lr, factor)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return {"type": type(groups).__name__}
    return {"groups": _label_groups(groups, blocks)}


@check(forbid=TRANSFER, hint="build the list of dicts yourself")
def check_discriminative_groups(groups_fn, seed: int = 0, trials: int = 4) -> None:
    """`groups_fn(blocks, lr, factor) -> [{"params": [...], "lr": ...}, ...]` equal to dlo's
    `discriminative_groups`: one group per block with trainable parameters, input to output, block k of L at
    lr / factor^(L-1-k), frozen parameters left out."""
    name, rng = "discriminative_groups", random.Random(case_seed(seed))
    for t in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        blocks = _blocks(rng, t)
        lr, factor = rng.choice([1e-3, 3e-4, 0.01]), rng.choice([2.6, 2.0, 3.0])
        want = _label_groups(discriminative_groups(blocks, lr, factor), blocks)
        frozen = {f"block {i}: {n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()
                  if not p.requires_grad}
        got = run_student(_groups_worker, groups_fn, blocks, lr, factor)
        case = f"{len(blocks)} blocks, lr={lr:g}, factor={factor:g}, frozen: {sorted(frozen)}"
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
        lrs, want_lrs = [g["lr"] for g in got], [g["lr"] for g in want]
        if any(a is None for a in lrs):
            raise AssertionError(f"{name}: every group needs its own 'lr' ({case})")
        if all(abs(a - b) <= 1e-12 * b for a, b in zip(lrs, want_lrs)):
            continue
        ks = [k for k, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())]
        swapped = (want_lrs[::-1], [lr / factor ** k for k in ks], [lr / factor ** j for j in range(len(want))])
        if any(all(abs(a - b) <= 1e-12 * b for a, b in zip(lrs, wrong)) for wrong in swapped):
            raise AssertionError(f"{name}: the learning rates are swapped: the block nearest the output gets lr, "
                                 f"the one nearest the input the smallest ({case}): expected {want_lrs}, got {lrs}")
        kept = [lr / factor ** (len(want) - 1 - k) for k in range(len(want))]   # L: the groups kept
        top = [lr / factor ** (ks[-1] - k) for k in ks]                           # lr to the last block that trains
        if any(all(abs(a - b) <= 1e-12 * b for a, b in zip(lrs, wrong)) for wrong in (kept, top)):
            raise AssertionError(f"{name}: a frozen block still counts: block k of L gets lr / factor^(L-1-k), L "
                                 f"counting every block given, also the ones left out (a frozen last block "
                                 f"included: then no group gets lr) ({case}): expected {want_lrs}, "
                                 f"got {lrs}")
        raise AssertionError(f"{name}: learning rates {lrs}, expected {want_lrs} ({case})")
    ok(name, f"{trials} block lists with frozen blocks and parameters: groups, order and rates")
