"""Day 9's check of speculative decoding's acceptance rule (Leviathan et al. 2023, Algorithm 1), re-exported by
`dlo.checks.day9`.

The rule is run on 20,000 rounds at once and judged by the distributions it must keep (module docstring of
`dlo.checks.day9`): every emitted token's, position by position up to the bonus token, and the number of
accepted drafts, whose distribution the rule fixes (`_accepted`): a lossless rule that accepts less (a
scaled ratio, "sample from p and keep the drafts it matches") or a rule that stops looking after a few
drafts keeps the first tokens' distributions, not this one.
"""

from __future__ import annotations

import math
import random

import torch

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import fmt, ok
from dlo.inference.speculative import chi_square, chi_square_quantile

SPECULATIVE = ("dlo.inference.speculative.accept_draft", "dlo.inference.speculative.speculative_generate")
N_ROUNDS = 20_000
GROUPS = 4  # the distinct relabellings of the vocabulary over the rounds (`_relabel`)
Z = 4.265  # the standard normal's 1 - 1e-5 quantile: a right rule fails a test once in 100,000 cases
# The per-value tests (`_band`): a count X ~ Binomial(N, pi) leaves N pi +- t with probability <= 2 exp(-t^2 /
# (2 (N pi (1 - pi) + t / 3))) (Bernstein's inequality, exact whatever N and pi: no normal approximation in the
# tails of small counts); t is set so that this is DELTA, about 6.5 standard deviations when N pi (1 - pi) is large.
# A check tests at most 2 trials x (5 values of n + 3 positions x 7 values) = 52 counts: a right rule fails one
# of them with probability <= 52 DELTA ~ 5e-8.
DELTA = 1e-9


def _accept_worker(fn, p, q, drafts, seed: int):
    """(n, token) or what came back instead, and whether the call drew from torch's global generator (its state
    moved: the text asks for every random number from `generator`, which makes a server's sampling reproducible)."""
    state = torch.get_rng_state()
    out = fn(p, q, drafts, torch.Generator().manual_seed(seed))
    drew = not torch.equal(state, torch.get_rng_state())
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        return f"a {type(out).__name__}", drew
    return [x.detach() for x in out], drew


def _relabel(gen: torch.Generator, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each round's vocabulary under one of GROUPS random relabellings, (N_ROUNDS, V) and the round's group:
    the rounds' p and q differ row by row (a rule that reads round 0's for all is wrong on the others), while
    the tokens, labelled back, keep the one distribution the statistics test."""
    perms = torch.stack([torch.randperm(V, generator=gen) for _ in range(GROUPS)])
    group = torch.randint(GROUPS, (N_ROUNDS,), generator=gen)
    return perms[group], group


def _distribution(rng: random.Random, gen: torch.Generator, V: int) -> torch.Tensor:
    x = torch.rand(V, generator=gen, dtype=torch.float64) + rng.choice([0.05, 0.2])
    return x / x.sum()


def _wrong_first(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first emitted token's distribution under the usual wrong rules (p (k+1, V), q (k, V))."""
    p1, q1 = p[0], q[0]
    alpha = torch.minimum(p[:-1], q).sum(-1)  # (k,) each position's acceptance rate
    residual = (p1 - q1).clamp(min=0) / (p1 - q1).clamp(min=0).sum()
    kept_by_q_over_p = q1 * torch.minimum(torch.ones_like(q1), q1 / p1)
    kept = torch.minimum(p1, q1) / q1  # a draft x at the first position is accepted with this probability
    later = 1 - torch.prod(1 - alpha[1:])  # some later draft accepted: n > 0 when n counts every acceptance
    return {"accepted every draft: accept x with probability min(1, p(x) / q(x)), not always": q1,
            "on a rejection you sampled from p: sample from the residual norm(max(0, p - q))":
            torch.minimum(p1, q1) + (1 - alpha[0]) * p1,
            "the ratio is upside down: accept with probability min(1, p(x) / q(x)), p the target's":
            kept_by_q_over_p + (1 - kept_by_q_over_p.sum()) * residual,
            "n counted every accepted draft: n is the accepted prefix, it stops at the first rejection":
            q1 * (kept + (1 - kept) * later) + (1 - alpha[0]) * (1 - later) * residual}


def _fit(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    return chi_square(counts, probs) < chi_square_quantile(len(probs) - 1, Z)


@check(forbid=SPECULATIVE)
def check_accept_draft(fn, seed: int = 0, trials: int = 2) -> None:
    """`fn(p, q, drafts, generator) -> (n, token)` on 20,000 rounds at once: p (B, k+1, V), q (B, k, V),
    drafts (B, k) drawn from q. The first token emitted must follow p_1 and the second p_2 (chi-square), the
    number accepted the rule's distribution and every later token its position's p_j, the bonus p_{k+1}
    (`_later`); with q = p every draft is accepted and the bonus token follows p_{k+1}. A trial after the
    first has k >= 3 drafts."""
    name, rng = "accept_draft", random.Random(case_seed(seed))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for t in range(trials):
        k, V = rng.choice([2, 3] if t == 0 else [3, 4]), rng.choice([5, 6, 7])
        p = torch.stack([_distribution(rng, gen, V) for _ in range(k + 1)])  # (k+1, V)
        for same in (False, True):
            q = p[:k].clone() if same else torch.stack([_distribution(rng, gen, V) for _ in range(k)])
            drafts = torch.multinomial(q, N_ROUNDS, replacement=True, generator=gen).t().contiguous()  # (B, k)
            label, group = _relabel(gen, V)  # round b's token x is token label[b, x] in what the student gets
            back = torch.argsort(label, dim=1)
            P, Q = p[:, back].transpose(0, 1).contiguous(), q[:, back].transpose(0, 1).contiguous()
            got, drew = run_student(_accept_worker, fn, P, Q, label.gather(1, drafts), rng.randrange(1 << 30))
            where = dict(k=k, V=V, rounds=N_ROUNDS, q_equals_p=same)
            if drew:
                raise AssertionError(f"{name}: your call drew from torch's global random generator (its state "
                                     f"changed): draw every random number from `generator` (torch.rand(..., "
                                     f"generator=generator), torch.multinomial(..., generator=generator)) "
                                     f"({fmt(where)})")
            if isinstance(got, str):
                raise AssertionError(f"{name}: return a tuple (n, token) of two tensors, got {got} ({fmt(where)})")
            n, token = (x.long().flatten() for x in got)
            if n.shape != (N_ROUNDS,) or token.shape != (N_ROUNDS,) or n.min() < 0 or n.max() > k or \
                    token.min() < 0 or token.max() >= V:
                raise AssertionError(f"{name}: n and token must be (B,) = ({N_ROUNDS},), n in [0, k={k}] and tokens in "
                                     f"[0, V={V}); got shapes "
                                     f"{tuple(got[0].shape)}, {tuple(got[1].shape)} ({fmt(where)})")
            token = back.gather(1, token[:, None])[:, 0]  # labelled back: every round's token in p's vocabulary
            if same:
                _check_all_accepted(name, n, token, p, k, where)
                continue
            first = torch.where(n > 0, drafts[:, 0], token)
            counts = torch.bincount(first, minlength=V)
            if not _fit(counts, p[0]):
                fits = {slip: chi_square(counts, probs) for slip, probs in _wrong_first(p, q).items()
                        if _fit(counts, probs)}
                if fits:  # the wrong rule whose distribution the counts fit best
                    raise AssertionError(f"{name}: {min(fits, key=fits.get)} ({fmt(where)})")
                if _fit(torch.bincount(first[group == group[0]], minlength=V), p[0]):
                    raise AssertionError(f"{name}: the first token follows p_1 only in the rounds whose distributions "
                                         f"are round 0's: each round b has its own p[b], q[b] (the check's rounds "
                                         f"differ); read them row by row ({fmt(where)})")
                raise AssertionError(f"{name}: the first token emitted does not follow the target's p_1 (chi-square "
                                     f"{chi_square(counts, p[0]):.1f} > {chi_square_quantile(V - 1, Z):.1f} at {V - 1} "
                                     f"degrees of freedom): the rule must keep the target's distribution "
                                     f"({fmt(where)})")
            second = torch.where(n > 1, drafts[:, 1], token)[n > 0]
            if not _fit(torch.bincount(second, minlength=V), p[1]):
                raise AssertionError(f"{name}: after an accepted first draft, the second token does not follow p_2: n "
                                     f"is the accepted prefix, stop at the first rejection (the drafts after it are "
                                     f"dropped, however they would fare) ({fmt(where)})")
            _later(name, n, token, drafts, p, q, where)
    ok(name, f"{trials} trials of {N_ROUNDS:,} rounds, seed={seed}")


def _check_all_accepted(name: str, n, token, p, k: int, where: dict) -> None:
    if not bool((n == k).all()):
        raise AssertionError(f"{name}: with q = p every draft must be accepted (min(1, p/q) = 1), but n < k in "
                             f"{int((n < k).sum())} rounds ({fmt(where)})")
    counts = torch.bincount(token, minlength=p.shape[1])
    if not _fit(counts, p[k]):
        said = "drawn from p_k, the last draft's position" if _fit(counts, p[k - 1]) else "not drawn from p_{k+1}"
        raise AssertionError(f"{name}: no +1 bonus token: when all k drafts are accepted the token emitted after them "
                             f"is drawn from p_{{k+1}}, the target's distribution after the last draft; yours is "
                             f"{said} ({fmt(where)})")


def _band(N: int, prob: float) -> tuple[float, float]:
    """Where Binomial(N, prob) falls but with probability DELTA (Bernstein's inequality, module constants)."""
    L, var = math.log(2 / DELTA), N * prob * (1 - prob)
    t = L / 3 + math.sqrt(L * L / 9 + 2 * L * var)
    return N * prob - t, N * prob + t


def _off(counts: torch.Tensor, probs: torch.Tensor) -> int | None:
    """The first value whose count leaves its band, or None."""
    N = int(counts.sum())
    for x, (c, pr) in enumerate(zip(counts.tolist(), probs.tolist())):
        lo, hi = _band(N, pr)
        if not lo <= c <= hi:
            return x
    return None


def _accepted(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(n = j), j = 0..k: draft i (drawn from q_i, independently) is accepted with probability alpha_i =
    sum_x min(p_i(x), q_i(x)), so n = j with probability alpha_1 .. alpha_j (1 - alpha_{j+1})."""
    alpha = torch.minimum(p[:-1], q).sum(-1)  # (k,)
    reach = torch.cat([torch.ones(1, dtype=alpha.dtype), torch.cumprod(alpha, 0)])  # P(n >= j)
    return reach - torch.cat([reach[1:], torch.zeros(1, dtype=alpha.dtype)])


def _later(name: str, n, token, drafts, p, q, where: dict) -> None:
    """q != p: the number accepted, then the token emitted at each position j >= 3 (the draft x_j when accepted,
    else the token after a rejection there; the bonus at j = k + 1) over the rounds that reach it, value by value
    within Bernstein's band (`_band`)."""
    k, V = q.shape
    probs = _accepted(p, q)
    counts = torch.bincount(n, minlength=k + 1)
    if (j := _off(counts, probs)) is not None:
        raise AssertionError(f"{name}: the number of accepted drafts n does not follow the rule: draft i is accepted "
                             f"with probability min(1, p_i(x_i) / q_i(x_i)), at every position, so P(n >= j) = "
                             f"alpha_1 .. alpha_j with alpha_i = sum_x min(p_i(x), q_i(x)); n = {j} in "
                             f"{int(counts[j])} of the rounds, expected {float(probs[j]) * len(n):.0f} "
                             f"({fmt(where)})")
    for j in range(3, k + 2):  # 1-based positions; j = k + 1 is the bonus token
        reached = n >= j - 1
        emitted = (torch.where(n >= j, drafts[:, j - 1], token) if j <= k else token)[reached]
        counts = torch.bincount(emitted, minlength=V)
        if (x := _off(counts, p[j - 1])) is None:
            continue
        seen = f"token {x} in {int(counts[x])} of the {int(reached.sum())} rounds that reach it, expected " \
               f"{float(p[j - 1, x]) * int(reached.sum()):.0f}"
        if j == k + 1:
            raise AssertionError(f"{name}: no +1 bonus token: when all k drafts are accepted the token emitted after "
                                 f"them is drawn from p_{{k+1}}, the target's distribution after the last draft "
                                 f"({seen}; {fmt(where)})")
        raise AssertionError(f"{name}: the token emitted at position {j} (the draft x_{j} if accepted, else the token "
                             f"after a rejection there) does not follow p_{j}: the rule (accept with probability "
                             f"min(1, p/q), else the residual norm(max(0, p_j - q_j))) holds at every position, not "
                             f"only the first two ({seen}; {fmt(where)})")
