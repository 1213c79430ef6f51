"""The test bench of the Day 5 ZeRO checks (`dlo.checks.day5`): a small language model with a tied
embedding and tensors of odd sizes (nothing divides by the world size), its data, the reference (one
process on the whole batch), what the trusted worker observes with (`seen_parameters`, `settled_growth`)
and the comparisons of the parameters and of every byte sent. `dlo.checks.day5_fsdp` reuses the data,
the loss and the byte counts.

The rest of the bench: the worker that runs a student's engine on each rank (`dlo.checks.day5_worker`),
the memory a rank keeps (`dlo.checks.day5_memory`) and the disturbed step that tells ZeRO from DDP
(`dlo.checks.day5_sync`).
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from dlo.grading.compare import DTYPE, assert_close
from dlo.measure import live_bytes, tally
from dlo.models import count_parameters

BYTES_TOL = 0.05  # payload bytes vs 2 Psi / 3 Psi: padding every flat buffer to a multiple of N costs < 2% here


# ----------------------------------------------------------------------------- the test model

class Block(nn.Module):
    """x + W2 tanh(W1 x + b1) + b2: a residual MLP block of odd sizes."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))  # (B, T, C)


class TiedLM(nn.Module):
    """Embedding -> blocks -> LayerNorm -> head whose weight *is* the embedding's (tied)."""

    def __init__(self, vocab: int, dim: int, hidden: int, n_blocks: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)  # (B, T) -> (B, T, C)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, T, vocab)


def case(seed: int) -> dict:
    """Sizes and hyper-parameters drawn from the seed (odd sizes; Psi odd)."""
    rng = random.Random(seed)
    return {"vocab": rng.choice([13, 17, 19]), "dim": rng.choice([7, 9]), "hidden": rng.choice([19, 23]),
            "n_blocks": rng.choice([6, 7]), "T": rng.choice([3, 5]), "per_rank": rng.choice([2, 3]),
            "sgd_lr": rng.uniform(0.2, 0.5), "lr": rng.uniform(5e-3, 2e-2), "weight_decay": rng.uniform(0.0, 0.1)}


def tied_lm(c: dict, seed: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(c["vocab"], c["dim"], c["hidden"], c["n_blocks"]).to(DTYPE)


def batch(c: dict, seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return (torch.randint(0, c["vocab"], (n, c["T"]), generator=g),
            torch.randint(0, c["vocab"], (n, c["T"]), generator=g))


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def optimizer_for(c: dict, kind: str):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": c["sgd_lr"]}
    return torch.optim.AdamW, {"lr": c["lr"], "weight_decay": c["weight_decay"]}


def named_leaves(model: nn.Module) -> dict:
    """{"blocks.0.w1.weight": param} for every module's own parameters; a tied one under both names."""
    return {f"{mn}.{pn}".lstrip("."): p for mn, m in model.named_modules()
            for pn, p in m.named_parameters(recurse=False)}


def train_on_full_batch(model: nn.Module, c: dict, seed: int, kind: str, steps: int, world_size: int) -> nn.Module:
    """`steps` optimizer steps in one process on the whole global batch (world_size x per_rank sequences):
    what the sharded engines must reproduce."""
    opt_cls, kw = optimizer_for(c, kind)
    opt = opt_cls(model.parameters(), **kw)
    for s in range(steps):
        lm_loss(model, *batch(c, seed, s, world_size * c["per_rank"])).backward()
        opt.step()
        opt.zero_grad()
    return model


def reference(c: dict, seed: int, kind: str, steps: int, world_size: int) -> dict:
    """One process, the whole global batch, rank 0's initial weights."""
    model = train_on_full_batch(tied_lm(c, seed + 1), c, seed, kind, steps, world_size)
    return {k: p.detach().clone() for k, p in named_leaves(model).items()}


# ----------------------------------------------------------------------------- what the worker observes with

def seen_parameters(model: nn.Module, forward) -> dict:
    """The parameters every module holds while its own forward runs (ZeRO-3 gathers them just
    before): recorded by forward pre-hooks registered after the engine's, during `forward()`."""
    seen, names = {}, {m: n for n, m in model.named_modules()}

    def pre(mod, args):
        for pn, p in mod.named_parameters(recurse=False):
            key = f"{names[mod]}.{pn}".lstrip(".")
            if p.untyped_storage().nbytes() < (p.storage_offset() + p.numel()) * p.element_size():
                raise AssertionError(f"parameter {key} holds no data during its module's forward: gather a unit's "
                                     f"parameters in a forward pre-hook, as views the module uses (p.data = view)")
            seen.setdefault(key, p.detach().clone())
    hooks = [m.register_forward_pre_hook(pre) for m in model.modules() if list(m.parameters(recurse=False))]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return seen


def settled_growth(before: int, held: int, wait_s: float = 1.0) -> int:
    """The rank's tensor bytes since `before` (`live_bytes`). A collective's tensors outlive its wait() by a
    moment (gloo's thread lets go of the finished work just after it signals it, and their Python objects
    stay while C++ holds them), so a growth above what the engine reaches (`held`) is measured again for
    up to `wait_s` seconds and the least is kept: what an engine keeps stays, a finished collective's
    buffers do not."""
    growth = live_bytes() - before
    deadline = time.monotonic() + wait_s
    while growth > held and time.monotonic() < deadline:
        time.sleep(0.02)
        growth = min(growth, live_bytes() - before)
    return growth


# ----------------------------------------------------------------------------- comparisons

def count_psi(c: dict) -> int:
    return count_parameters(tied_lm(c, 0))


def compare_params(name: str, got: dict, want: dict, start: dict, n: int, what: str, where) -> None:
    for key, w in want.items():
        g = got.get(key)
        if g is None:
            raise AssertionError(f"{name}: parameter {key} was not seen during forward ({where})")
        if what == "SGD" and g.shape == w.shape and not torch.allclose(g.to(DTYPE), w, rtol=1e-9, atol=1e-12):
            step_got, step_want = (start[key] - g).flatten(), (start[key] - w).flatten()
            i = int(step_want.abs().argmax())
            if step_want[i] != 0:
                k = (step_got[i] / step_want[i]).item()
                if abs(k - n) < 1e-6 * n:
                    raise AssertionError(f"{name}: after one SGD step {key} moved {n}x too far: the gradients are "
                                         f"summed over the ranks, divide by the world size ({where})")
                if abs(k) < 1e-9:
                    raise AssertionError(f"{name}: after one SGD step {key} did not move: this rank's shard of "
                                         f"the gradient never reached the optimizer ({where})")
        assert_close(name, f"parameter {key} after {what}", g, w, where)


def verify_training(name: str, res: list, c: dict, seed: int, steps: int, n: int, shown_seed=None) -> None:
    """`seed`: the case's (secret when graded); `shown_seed`: the test cell's, for the messages."""
    init = {k: p.detach() for k, p in named_leaves(tied_lm(c, seed + 1)).items()}
    sgd, adamw = reference(c, seed, "sgd", 1, n), reference(c, seed, "adamw", steps, n)
    for r, got in enumerate(res):
        where = {"rank": r, "world_size": n, "seed": seed if shown_seed is None else shown_seed}
        for key, w in init.items():
            if key in got["start"] and not torch.equal(got["start"][key].to(DTYPE), w):
                raise AssertionError(f"{name}: before the first step, parameter {key} on rank {r} differs from rank "
                                     f"0's: broadcast rank 0's parameters when the engine is built "
                                     f"({fmt_where(where)})")
        compare_params(name, got["sgd"], sgd, init, n, "SGD", where)
        compare_params(name, got["adamw"], adamw, init, n, f"{steps} AdamW steps", where)


def fmt_where(where: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in where.items())


STEP = ("forward", "backward", "step")  # the phases of the counted SGD step


def padding_bytes(c: dict, world_size: int) -> int:
    """The most one collective of the whole model may carry beyond Psi: every parameter tensor padded to
    a multiple of N (N - 1 elements each; an engine padding one flat buffer per unit pads less)."""
    return (world_size - 1) * len(list(tied_lm(c, 0).parameters())) * torch.finfo(DTYPE).bits // 8


def verify_every_byte(name: str, res: list, stage: int, psi_bytes: int, steps: int, where: str,
                      pad_bytes: int = 0) -> None:
    """Every byte each rank sent, by kind and phase, within what the engine needs (plus BYTES_TOL of
    Psi): at construction a broadcast of the parameters (a tied weight twice at most), before and
    after the step only ZeRO-3's gathers for a forward, in the step one reduce-scatter and the
    all-gathers, in the AdamW steps as many as those steps need. Anything else - a send or recv, an
    all-reduce, a broadcast mid-step - is data moved where the exercise's accounting cannot see it.
    Each collective of the budget may carry `pad_bytes` (`padding_bytes`) beyond Psi: at an N that does
    not divide the sizes, the padding of every all-gather adds up over the AdamW steps' seven (a
    correct engine was refused at N = 3 when the tolerance did not grow with them)."""
    g = 1 if stage == 3 else 0  # ZeRO-3 gathers the parameters for every forward (and again in backward)
    budgets = {"init": {"broadcast": 2}, "start": {"all_gather": g}, "after": {"all_gather": g},
               STEP: {"reduce_scatter": 1, "all_gather": 1 + g},  # the step's phases count together
               "drift": {"reduce_scatter": 1, "all_gather": 1},  # ZeRO-1/2's disturbed step (`disturbed_step`)
               "adamw": {"reduce_scatter": steps, "all_gather": steps * (1 + g) + g}}
    for r, got in enumerate(res):
        totals: dict[tuple, int] = {}
        for key in ("comm", "adamw_comm", "one_bucket_comm"):
            for (kind, phase), row in tally(got.get(key, ())).items():
                k = (key, STEP if phase in STEP else phase, kind)
                totals[k] = totals.get(k, 0) + row["bytes"]
        order = list(budgets)
        over = [(phase, kind, b) for (_, phase, kind), b in sorted(
                    totals.items(), key=lambda kv: (order.index(kv[0][1]) if kv[0][1] in order else 9, str(kv[0])))
                if b > budgets.get(phase, {}).get(kind, 0) * (psi_bytes + pad_bytes) + BYTES_TOL * psi_bytes]
        if over:
            said = ", ".join(f"{kind} {b / psi_bytes:.2f} Psi in {'the step' if phase == STEP else phase}"
                             for phase, kind, b in over)
            raise AssertionError(f"{name}: rank {r} sent more than ZeRO-{stage} needs: {said}. Every byte a rank "
                                 f"sends is counted, point-to-point included, from the engine's construction on: "
                                 f"the broadcast of the parameters when it is built, then only the reduce-scatter "
                                 f"of the gradients and the all-gather of the parameters ({where})")


def expect_bytes(name: str, what: str, got: int, psi_bytes: int, k: float, hint: str, where: str) -> None:
    if abs(got - k * psi_bytes) > BYTES_TOL * psi_bytes:
        raise AssertionError(f"{name}: {what}: {got / psi_bytes:.3f} Psi of payload per step, expected {k:g} Psi "
                             f"(within {BYTES_TOL:g} Psi); {hint} ({where})")
