"""Autograder checks for Day 2's accounting exercise: matmul parameters and bytes of model state per
parameter (`check_flops_accounting`, re-exported by `dlo.checks.day2`, whose name
the test cell calls).

Every expected number is counted here, never restated from a formula: FLOPs by FlopCounterMode on
the check's own decoder (`_GPT`, tied and untied heads, with and without position embeddings and
biases), bytes by the tensors an optimizer really holds after one step. The untied decoders also hold
a raw 2-D position table (indexed) and a Linear they never call: the exercise's rule reads module types,
so it counts both where a FLOP count sees neither (a student measuring FLOPs instead fails there). The student's
`matmul_params` runs in a worker (`dlo.grading.api.run_student`) on a model built there from the
seed; the plain-number functions are called here.

The model and its worker live in `dlo.checks.day2_gpt`, which holds no answer: what the student's code receives
(`type(model).forward.__globals__`, the worker's frame) leads there. The helpers that count the answers here
(`ANSWERS`) are in the check's forbid list too, blocked by name and by code wherever the student's code finds
them (a frame further up, the collector): a red team returned their counts.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from dlo.checks.day2_gpt import _gpt, _matmul_params_worker
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import fmt, ok

# ----------------------------------------------------------------------------- matmul parameters, bytes per parameter

def _unmeasured(cfg: dict) -> dict:
    """The parameters of a `raw` model that the rule counts and FlopCounterMode does not see: {what: elements}."""
    if not cfg.get("raw"):
        return {}
    return {"the raw position table indexed by position": cfg["pos"] * cfg["d"],
            "the Linear the forward never calls": 3 * cfg["d"]}


def _hand_count(cfg: dict) -> float:
    """Forward FLOPs per token of the check's model, counted by FlopCounterMode."""
    from dlo.measure import count_flops

    model, tokens = _gpt(cfg), torch.randint(0, cfg["vocab"], (2, cfg["seq"]))
    with torch.no_grad():
        return count_flops(lambda: model(tokens)) / tokens.numel()


def _state_bytes_per_param(param_dtype: torch.dtype, optimizer: str, master_dtype: torch.dtype | None) -> float:
    """Bytes of weights, gradients, master copy and optimizer state per parameter, measured on real
    tensors of a small model after one optimizer step (the step counters left out)."""
    from dlo.measure import tensor_bytes

    torch.manual_seed(0)
    fp32 = [p.detach() for p in nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)).parameters()]
    weights = [p.to(param_dtype) for p in fp32]
    grads = [torch.ones_like(w) for w in weights]  # a gradient has its parameter's dtype
    master = [p.to(master_dtype).requires_grad_() for p in fp32] if master_dtype is not None else []
    stepped = master or [w.requires_grad_() for w in weights]  # what the optimizer updates
    for p, g in zip(stepped, grads):
        p.grad = g.to(p.dtype)
    opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
           "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
           "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1)}[optimizer](stepped)
    opt.step()
    state = sum(tensor_bytes(t for t in s.values() if isinstance(t, torch.Tensor) and t.numel() == p.numel())
                for p, s in ((p, opt.state[p]) for p in stepped))
    return (tensor_bytes(weights) + tensor_bytes(grads) + tensor_bytes(master) + state) / sum(p.numel() for p in fp32)


def _matmul_slip(cfg: dict, diff: int) -> str:
    """What a student's matmul_params that is `diff` off most likely did."""
    tok, pos = cfg["vocab"] * cfg["d"], (0 if cfg.get("raw") else cfg["pos"] * cfg["d"])
    looked_up = "a looked-up embedding table counted? (a lookup does no FLOPs)"
    hint = {pos: looked_up, tok + pos: looked_up, (0 if cfg["tied"] else tok): looked_up,
            -tok: "the head tied to the embedding counted zero times? it is a matmul weight"}
    if cfg["tied"]:
        hint[tok] = hint[tok + pos] = "the tied embedding counted twice, or a looked-up table counted?"
    unmeasured = _unmeasured(cfg)
    for what, size in unmeasured.items():
        hint.setdefault(-size, f"{what} left out? the rule reads module types, not how a tensor is used: it counts")
    if unmeasured:
        hint.setdefault(-sum(unmeasured.values()), f"{' and '.join(unmeasured)} left out? the rule reads module types, "
                                                  f"not FLOPs or use: both count")
    hint.pop(0, None)
    return hint.get(diff, "count each weight with >= 2 dims once, embedding tables only as the head")


# (weights' dtype, master copy's dtype or None): fp32, mixed, pure bf16, and dtypes the text does not list
DTYPE_PAIRS = ((torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None),
               (torch.float16, torch.float32), (torch.float16, None), (torch.float64, None),
               (torch.float16, torch.float64))  # a master copy that is not fp32: its width, not a 4


def _bytes_slip(got: float, param_dtype: torch.dtype, optimizer: str, master_dtype: torch.dtype | None) -> str:
    """' (...?)' when the student's number is a plausible wrong derivation's."""
    p = torch.finfo(param_dtype).bits // 8
    m = 0 if master_dtype is None else torch.finfo(master_dtype).bits // 8
    k = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer]
    # the likeliest first, where two give the same number
    wrongs = [(2 * p + m + k * p, "the optimizer's state at the weights' width? it has the dtype of what the "
                                  "optimizer steps: the master copy when there is one"),
              (2 * p + k * (m or p), "the master copy left out?"),
              (p + m + k * (m or p), "the gradients left out? (one per weight, in its dtype)"),
              (p + 2 * m + k * (m or p), "the gradients at the master's width? a gradient has its parameter's dtype"),
              (2 * p + m + (m or p) * 2, "two state values for every optimizer? SGD keeps none, momentum one, "
                                         "AdamW two"),
              (2 * p + (4 + 4 * k if m else -1), "the master copy and its state at fp32's 4 bytes? they have "
                                                 "master_dtype's width")]
    want = 2 * p + m + k * (m or p)
    return next((f" ({text})" for w, text in wrongs if w == got and w != want), "")


# the helpers that count the expected answers: off limits to the student's code (the worker does not use them)
ANSWERS = tuple(f"dlo.checks.day2_accounting.{f}" for f in ("_hand_count", "_unmeasured", "_state_bytes_per_param"))


@check(forbid=("dlo.accounting.matmul_params", "dlo.accounting.training_bytes_per_param",
               "dlo.accounting.model_state_bytes", "dlo.accounting.copy_widths", "dlo.accounting.precision_of",
               *ANSWERS))
def check_flops_accounting(matmul_params, training_bytes_per_param, seed: int = 0, trials: int = 3) -> None:
    """Two small functions, compared on random configurations with counts made here: `matmul_params(model)`
    with FlopCounterMode's count of the check's transformer (tied and untied heads), plus the parameters the rule
    counts that no FLOP count sees (`_unmeasured`); `training_bytes_per_param(param_dtype, optimizer,
    master_dtype=None)` with the bytes of real tensors after an optimizer step, on dtypes the text's examples do not
    list (float16, float64 weights, a float64 master copy), so that only a derivation passes.
    (6N + 12 l h s and MFU are formulas the notebook gives in full: `dlo.measure` has them, no exercise.)"""
    from dlo.grading.compare import assert_number

    name, rng = "flops_accounting", random.Random(case_seed(seed))
    for t in range(trials):
        heads = rng.choice([1, 2, 3])
        cfg = dict(seed=rng.randrange(10 ** 6), vocab=rng.choice([37, 50, 61]), d=heads * rng.choice([4, 6]),
                   layers=rng.choice([1, 2, 3]), heads=heads, ffn=rng.choice([2, 4]), tied=t % 2 == 0,
                   bias=rng.random() < 0.5, pos=rng.choice([0, 16]), seq=rng.choice([5, 9, 16]))
        if t % 2 == 1:  # untied trials: parameters the rule counts and no FLOP count sees (`_GPT`'s raw)
            cfg.update(raw=True, pos=16)
        layers, d, s = cfg["layers"], cfg["d"], cfg["seq"]
        fwd = _hand_count(cfg)
        n = round((fwd - 4 * layers * d * s) / 2)  # forward: 2 FLOPs per weight, 4 s d per layer of attention
        want = n + sum(_unmeasured(cfg).values())  # the rule reads module types, not use
        got = assert_number(name, "matmul_params(model)", run_student(_matmul_params_worker, matmul_params, cfg), cfg)
        if got != want:
            raise AssertionError(f"{name}: matmul_params = {got:g}, expected {want} for {fmt(cfg)}: "
                                 f"{_matmul_slip(cfg, round(got) - want)}")
    for param_dtype, master_dtype in DTYPE_PAIRS:
        for optimizer in ("sgd", "sgd_momentum", "adamw"):  # dlo.accounting.OPTIMIZER_STATES' names
            want = _state_bytes_per_param(param_dtype, optimizer, master_dtype)
            call = f"training_bytes_per_param({param_dtype}, {optimizer!r}, master_dtype={master_dtype})"
            got = assert_number(name, call, training_bytes_per_param(param_dtype, optimizer, master_dtype=master_dtype))
            if got != want:
                raise AssertionError(f"{name}: {call} = {got:g}, expected {want:g} (the bytes of real tensors after "
                                     f"a step): weights + gradients + master copy + optimizer state"
                                     f"{_bytes_slip(got, param_dtype, optimizer, master_dtype)}")
    ok(name, f"{trials} transformers, {3 * len(DTYPE_PAIRS)} dtype/optimizer cases, seed={seed}")
