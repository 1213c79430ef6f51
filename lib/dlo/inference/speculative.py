"""Speculative decoding: a small draft model guesses k tokens, the target checks them in one forward
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", ICML; Chen et al.
2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

Decoding is bound by reading the target's weights once per token; a forward over k + 1 tokens reads
them once too. So: the draft samples x_1..x_k from its distributions q_1..q_k; the target computes
p_1..p_{k+1} in one pass; then, for i = 1..k (Leviathan et al., Algorithm 1; Chen et al., Algorithm 2):

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection stop, and emit
    a token from the residual norm(max(0, p_i - q_i)); if all k are accepted, emit one from p_{k+1}.

Each emitted token is distributed exactly as the target alone would sample it (Leviathan et al.,
Appendix A.1; Chen et al., Theorem 1), whatever the draft: a bad draft only costs speed. Greedy decoding is the
case of one-hot distributions: x_i is kept iff it is the target's argmax, and the residual is the
target's argmax, so the output is the target's greedy output token for token.

With acceptance rate alpha = E[sum_x min(p(x), q(x))] (their beta, and alpha its expectation, Sec. 3) and a draft
forward costing c target forwards, a round emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average
(Eq. 1) and the expected speed-up is (1 - alpha^(k+1)) / ((1 - alpha)(c k + 1)) (Theorem 3.8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dlo.errors import BadInput
from dlo.inference.kv_cache import KVCache, forward_cached, probabilities
from dlo.models.llama import Llama


def distribution(logits: Tensor, temperature: float) -> Tensor:
    """What a sampler draws from: softmax(logits / T), or at T = 0 the one-hot of the argmax (greedy)."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    return probabilities(logits, temperature)


def accept_draft(p: Tensor, q: Tensor, drafts: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The modified rejection rule, batched: p (B, k+1, V) the target's distributions at the k drafted
    positions and the one after, q (B, k, V) the draft's, drafts (B, k) the tokens drawn from q.

    Returns (n, token): n (B,) the accepted prefix of the drafts, token (B,) the one emitted after it, drawn
    from norm(max(0, p_n - q_n)) (p_{k+1} itself when all k are accepted)."""
    B, k = drafts.shape
    if p.shape[:2] != (B, k + 1) or q.shape != (B, k, p.shape[2]):
        raise BadInput(f"p must be (B, k+1, V) and q (B, k, V) for drafts (B={B}, k={k}), got {tuple(p.shape)} and "
                       f"{tuple(q.shape)}")
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # (B, k) target probability of each draft
    q_x = q.gather(-1, drafts[..., None])[..., 0]  # > 0: each draft was drawn from q
    r = torch.rand(B, k, generator=generator, dtype=torch.float64, device=p.device)
    accepted = r < p_x / q_x  # r ~ U[0, 1): true with probability min(1, p/q)
    n = accepted.long().cumprod(dim=1).sum(dim=1)  # the accepted prefix stops at the first rejection
    q_after = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # after k accepted: q = 0, residual = p
    rows = torch.arange(B, device=p.device)
    residual = (p[rows, n] - q_after[rows, n]).clamp(min=0)  # (B, V)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), p[rows, n])
    return n, torch.multinomial(residual, 1, generator=generator)[:, 0]


def acceptance_rate(p: Tensor, q: Tensor) -> Tensor:
    """alpha = sum_x min(p(x), q(x)) over the last dim: the probability that a draft from q is accepted."""
    return torch.minimum(p, q).sum(-1)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens one target pass emits on average (k + 1 at alpha = 1)."""
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(c k + 1)): walltime improvement over the target alone, c = a draft
    forward's cost in target forwards (Leviathan et al., Theorem 3.8)."""
    return expected_tokens_per_round(alpha, k) / (c * k + 1)


def _catch_up(model: Llama, cache: KVCache, tokens: list[int]) -> Tensor:
    """Feed the tokens `cache` does not hold yet (at least the last one); the logits after the last (V,)."""
    new = torch.tensor([tokens[cache.lengths[0]:]], device=cache.k.device)
    return forward_cached(model, new, cache)[0, -1]


@torch.no_grad()
def speculative_generate(target: Llama, draft: Llama, prompt: Tensor, max_new_tokens: int, k: int = 4, *,
                         temperature: float = 0.0, generator: torch.Generator | None = None) -> tuple[Tensor, dict]:
    """One sequence: prompt (1, T0) -> ((1, T0 + max_new_tokens) tokens, counts). Each round the draft
    proposes min(k, tokens left - 1) tokens and the target verifies them in one forward; both caches
    keep every emitted token but the last (rejected drafts are truncated away).

    Counts: rounds (target passes after the prefill), drafted, accepted, tokens emitted per round.
    `generator`: on the models' device (its draws are the drafts, the acceptance tests and the residuals)."""
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise BadInput(f"prompt must be (1, T0) with T0 >= 1 (one sequence), got {tuple(prompt.shape)}")
    if not isinstance(k, int) or k < 1 or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BadInput(f"k and max_new_tokens must be ints >= 1, got {k!r} and {max_new_tokens!r}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise BadInput(f"the draft's vocabulary ({draft.config.vocab_size}) is not the target's "
                       f"({target.config.vocab_size})")
    tokens, T0 = prompt[0].tolist(), prompt.shape[1]
    length = T0 + max_new_tokens
    t_cache, d_cache = KVCache.for_model(target, 1, length), KVCache.for_model(draft, 1, length)
    if T0 > 1:  # the target's prefill: every token but the last, which each round's pass starts with
        forward_cached(target, prompt[:, :-1], t_cache)
    counts = dict(rounds=0, drafted=0, accepted=0, emitted=[])
    while len(tokens) < length:
        gamma = min(k, length - len(tokens) - 1)  # every token a round can emit is still wanted
        qs, drafts = [], []
        logits = _catch_up(draft, d_cache, tokens) if gamma else None
        for i in range(gamma):
            qs.append(distribution(logits, temperature))
            drafts.append(int(torch.multinomial(qs[-1], 1, generator=generator)))
            if i < gamma - 1:
                logits = forward_cached(draft, torch.tensor([[drafts[-1]]], device=d_cache.k.device), d_cache)[0, -1]
        pending = torch.tensor([tokens[-1:] + drafts], device=t_cache.k.device)  # (1, gamma + 1)
        p = distribution(forward_cached(target, pending, t_cache)[0], temperature)  # (gamma + 1, V)
        q = torch.stack(qs).to(p.dtype) if qs else p[:0]
        n, nxt = accept_draft(p[None], q[None], torch.tensor([drafts], dtype=torch.long, device=p.device), generator)
        n = int(n)
        tokens += drafts[:n] + [int(nxt)]
        t_cache.truncate(0, len(tokens) - 1)  # keep the accepted drafts, drop the rejected ones
        d_cache.truncate(0, min(d_cache.lengths[0], len(tokens) - 1))
        counts["rounds"] += 1
        counts["drafted"] += gamma
        counts["accepted"] += n
        counts["emitted"].append(n + 1)
    return torch.tensor([tokens], device=prompt.device), counts


def chi_square(counts: Tensor, probs: Tensor) -> float:
    """Pearson's statistic sum (O - E)^2 / E of observed counts against probabilities (E = N p)."""
    expected = counts.sum() * probs.detach().double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def chi_square_quantile(df: int, z: float = 3.090) -> float:
    """The chi-square quantile with df degrees of freedom at the standard normal quantile z (3.090: the
    99.9th percentile), by Wilson & Hilferty's cube-root approximation (1931): slightly above the exact
    value at few degrees of freedom (18.72 for 18.47 at df = 4, +1.4%; +0.8% at 7, +0.2% at 30)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


__all__ = ["accept_draft", "acceptance_rate", "chi_square", "chi_square_quantile", "distribution",
           "expected_speedup", "expected_tokens_per_round", "speculative_generate"]
