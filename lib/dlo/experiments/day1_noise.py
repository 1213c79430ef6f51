"""Day 1: the gradient noise scale of the SGD small-batch runs, and what it says about their large batch
(McCandlish et al. 2018; the estimator is `dlo.noise_scale`).

A `NoiseProbe` rides along a run of the grid (`day1.train_config(..., probe=...)`): at a few steps it
draws `reps` fresh batches of P.large_batch training images, measures the squared gradient norms of the
whole batch and of its P.small_batch chunks (no optimizer step, .grad and BatchNorm statistics left
alone), and keeps them. `noise_rows` turns the probes of several seeds into B_simple per training point
with a t-interval over the seeds, and what the model predicts for going from the small to the large
batch; `noise_claims` tests the paper's two statements that this run can check, the critical batch where the
paper quotes it: at the end of training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dlo import claims as C
from dlo import estimates as E
from dlo.noise_scale import grad_sq_norms, noise_scale, samples_ratio, steps_ratio

MCCANDLISH = "McCandlish et al. 2018"


def probe_steps(P) -> list[int]:
    """The measured points of a small-batch run: its start, half-way, and its end."""
    return sorted({0, P.max_steps // 2, P.max_steps})


class NoiseProbe:
    """probe(step, model): at the steps of `probe_steps(P)`, `reps` gradient-norm measurements at
    B_small = P.small_batch and B_big = P.large_batch on fresh training images (a generator seeded by
    `seed` and the step: the run's own data order and RNG are untouched). `small[step]`, `big[step]`:
    the squared norms; `loss[step]`: the mean training loss of the measured chunks (batch statistics)."""

    def __init__(self, P, train_ds, seed: int, device, reps: int = 2):
        self.P, self.ds, self.seed, self.device, self.reps = P, train_ds, seed, torch.device(device), reps
        self.at = probe_steps(P)
        self.small: dict[int, list[float]] = {}
        self.big: dict[int, list[float]] = {}
        self.loss: dict[int, float] = {}

    def __call__(self, step: int, model) -> None:
        if step not in self.at:
            return
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        idx = torch.randint(0, len(self.ds), (self.reps, self.P.large_batch), generator=gen)
        x_all, y_all = self.ds.tensors
        self.small[step], self.big[step], losses = [], [], []
        for rows in idx:
            x, y = x_all[rows].to(self.device), y_all[rows].to(self.device)
            m = grad_sq_norms(model, F.cross_entropy, x, y, self.P.small_batch)
            self.small[step] += m.small
            self.big[step].append(m.big)
            losses.append(m.loss)
        self.loss[step] = sum(losses) / len(losses)


def _over_seeds(values: list[float], how: str) -> E.Estimate:
    """Mean of the seeds' B_simple with a t-interval; a seed whose |G|^2 estimate was not positive (nan)
    is left out and named in `how`; none left: nan, "not measurable here"."""
    ok = [v for v in values if not math.isnan(v)]
    how += f" ({len(values) - len(ok)} of {len(values)} seeds: |G|^2 estimate <= 0, left out)" * (len(ok) < len(values))
    if not ok:
        return E.Estimate(math.nan, math.nan, math.nan, 0, how, E.REPEATS, "|G|^2 estimate <= 0 on every seed")
    return E.from_samples(ok, how=how, what="seeds")


def noise_rows(probes: dict[int, NoiseProbe], P) -> list[dict]:
    """One row per measured step: B_simple per seed and their mean with a t-interval over the seeds
    (`estimate`; no interval from fewer than 3 seeds), |G|^2 and tr(Sigma) (means over seeds), the loss,
    and at the mean B_simple what McCandlish et al.'s model predicts for going from P.small_batch to
    P.large_batch: `steps_x` (times fewer steps to the same loss; k = large/small if perfect) and
    `samples_x` (times the samples it needs; 1 if perfect). The norms of each seed are averaged over its
    measured batches before the ratio (A.1)."""
    S, L = P.small_batch, P.large_batch
    rows = []
    for step in next(iter(probes.values())).at:
        est = [noise_scale(p.small[step], p.big[step], S, L) for p in probes.values()]
        b = _over_seeds([e.b_simple for e in est], f"mean, t-interval over {len(est)} seeds")
        rows.append({"step": step, "loss": sum(p.loss[step] for p in probes.values()) / len(probes),
                     "g2": sum(e.g2 for e in est) / len(est), "tr_sigma": sum(e.tr_sigma for e in est) / len(est),
                     "b_simple_per_seed": [e.b_simple for e in est], "estimate": b,
                     "steps_x": steps_ratio(b.value, S, L), "samples_x": samples_ratio(b.value, S, L)})
    return rows


def noise_claims(rows: list[dict], P) -> list[C.Claim]:
    """Two rows: B_simple grows as the loss falls (last point over first, paired by seed), and the
    large batch lies past the critical batch (B_crit ~ B_simple) at the end of training, where critical
    batches are quoted (McCandlish et al. 2018, Sec. 3: B_crit grows as the loss falls, so a batch
    judged over the whole run would be judged mostly on its early points): the last measured point's
    B_simple with its interval over the seeds."""
    first, last = rows[0], rows[-1]
    L = P.large_batch
    # B_simple is a ratio of two noisy variance estimates: its error is multiplicative (seeds at the end of
    # the tiny run read 230 to 403 where the start reads 47 to 63), so growth is judged as a ratio, on logs
    # (McCandlish et al. plot B on log axes); a difference would be judged by its noisiest seed alone
    pairs = [(a, b) for a, b in zip(last["b_simple_per_seed"], first["b_simple_per_seed"]) if a > 0 and b > 0]
    how = f"step {last['step']} / step {first['step']}, geometric mean over {len(pairs)} seeds" + \
        f" ({len(first['b_simple_per_seed']) - len(pairs)} without a positive estimate left out)" * \
        (len(pairs) < len(first["b_simple_per_seed"]))
    grows = E.paired_log_ratio(*zip(*pairs), how=how) if pairs else E.Estimate(
        math.nan, math.nan, math.nan, 0, how, E.REPEATS, "no seed with a positive estimate at both steps")
    at_end = _over_seeds(last["b_simple_per_seed"], f"at step {last['step']} (the end of training), "
                         f"t over {len(last['b_simple_per_seed'])} seeds")
    return [
        C.Claim("the gradient noise scale grows as the loss falls", MCCANDLISH, "B_noise grows during training",
                C.at_least(1.0, "ratio > 1"), grows),
        C.Claim(f"b{L} is past the critical batch at the end of training (B_crit ~ B_simple < {L})", MCCANDLISH,
                "above B_crit, a larger batch needs more samples (epochs) to the same loss",
                C.at_most(float(L), f"B_simple < {L}"), at_end),
    ]
