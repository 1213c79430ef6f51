"""Autograder check for Day 8's SmoothQuant exercise (re-exported by `dlo.checks.day8`, the day's one
checks module): the smoothing factors of Xiao et al. 2023, Eq. 4, against `dlo.smoothquant`."""

from __future__ import annotations

import random

import torch

from dlo import smoothquant
from dlo.grading.api import case_seed, check
from dlo.grading.compare import assert_close, ok

# torch's cross-layer equalization is SmoothQuant's factors at alpha = 0.5 (the holder audit, 2026-12-02)
SMOOTH = ("dlo.smoothquant.smoothing_factors", "dlo.smoothquant.smooth_llama", "dlo.smoothquant.fold_",
          "torch.ao.quantization._equalize.*")


def _name_the_slip(name: str, s, want: torch.Tensor, act: torch.Tensor, w: torch.Tensor, alpha: float, hp) -> None:
    """AssertionError naming the wrong derivation `s` matches, if it matches one (nothing otherwise)."""
    if not isinstance(s, torch.Tensor) or s.shape != want.shape or torch.allclose(s.double(), want.double(),
                                                                                   rtol=1e-4, atol=1e-6):
        return
    ok_ = (act > 0) & (w > 0)
    a, b = act.clamp(min=1e-30), w.clamp(min=1e-30)
    slips = {"the exponents swapped (alpha on the weights' maximum): solve max|X_j| / s_j = P_j^(1-alpha) for s_j":
             w ** alpha / a ** (1 - alpha),
             "1 / s: dividing X_j by s_j must shrink the large activations, so s_j grows with max|X_j|":
             b ** (1 - alpha) / a ** alpha,
             "a product max|X_j|^alpha max|W_j|^(1-alpha): solve max|X_j| / s_j = P_j^(1-alpha) for s_j":
             act ** alpha * w ** (1 - alpha)}
    matched = [slip for slip, value in slips.items()  # at alpha = 0 or 1 two slips may give the same s
               if torch.allclose(s.double()[ok_], value.double()[ok_], rtol=1e-4, atol=1e-6)]
    if matched:
        raise AssertionError(f"{name}: s looks like {'; or '.join(matched)} "
                             f"({', '.join(f'{k}={v}' for k, v in hp.items())})")
    if torch.allclose(s.double()[ok_], want.double()[ok_], rtol=1e-4, atol=1e-6):
        raise AssertionError(f"{name}: right where both maxima are > 0, wrong where one is 0: such a channel has "
                             f"nothing to balance, s_j = 1 ({', '.join(f'{k}={v}' for k, v in hp.items())})")


@check(forbid=SMOOTH)
def check_smoothing_factors(fn, seed: int = 0, trials: int = 6) -> None:
    """`fn(act_absmax, weight_absmax, alpha) -> s` (C,): s_j = max|X_j|^alpha / max|W_j|^(1-alpha), and
    s_j = 1 where either max is 0. Odd channel counts, a few outlier channels 20-100x larger in X,
    one all-zero channel of X or of W, alpha at the ends and inside."""
    name, cs = "smoothing_factors", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials):
        C = rng.choice([3, 5, 7, 11, 13, 17])
        alpha = (0.0, 0.5, 1.0, rng.choice([0.25, 0.65, 0.8]))[t % 4]
        act = torch.rand(C, generator=gen) * 3 + 0.05
        act[torch.randperm(C, generator=gen)[:max(1, C // 5)]] *= rng.choice([20.0, 60.0, 100.0])
        w = torch.rand(C, generator=gen) * rng.choice([0.02, 1.0]) + 1e-3
        zero_act = t % 2 == 1 or t == 4  # a 0 in X meets alpha = 0 (0^0 = 1) and one in W alpha = 1
        (act if zero_act else w)[rng.randrange(C)] = 0.0  # nothing to balance in that channel
        hp = dict(channels=C, alpha=alpha, zero_in="act" if zero_act else "weight")
        s, want = fn(act.clone(), w.clone(), alpha), smoothquant.smoothing_factors(act, w, alpha)
        _name_the_slip(name, s, want, act, w, alpha, hp)
        assert_close(name, "s", s, want, hp, rtol=1e-4, atol=1e-6)
    ok(name, f"{trials} trials, seed={seed}")
