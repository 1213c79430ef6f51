"""dlo.inference.speculative: the acceptance rule keeps the target's distribution (chi-square over many
draws at a fixed seed; two wrong rules fail the same test), greedy speculative decoding is the target's
greedy decoding token for token, the speed-up formulas."""

import pytest
import torch

from dlo.errors import BadInput
from dlo.inference.kv_cache import generate, probabilities
from dlo.inference.speculative import (
    accept_draft,
    acceptance_rate,
    chi_square,
    chi_square_quantile,
    expected_speedup,
    expected_tokens_per_round,
    speculative_generate,
)
from dlo.models.llama import Llama, LlamaConfig
from tests.rank_pool import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

N = 20000
P = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15], dtype=torch.float64)  # the target's next-token distribution
Q = torch.tensor([0.30, 0.10, 0.35, 0.05, 0.20], dtype=torch.float64)  # a poor draft: alpha = 0.45


def first_tokens(rule, seed=0, k=2):
    """N rounds of k drafts from Q, verified against P at every position: the first token each emits."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q.expand(N * k, 5), 1, replacement=True, generator=gen).view(N, k)
    n, nxt = rule(P.expand(N, k + 1, 5), Q.expand(N, k, 5), drafts, gen)
    return torch.where(n > 0, drafts[:, 0], nxt)


def counts(tokens, V=5):
    return torch.bincount(tokens, minlength=V)


BOUND = chi_square_quantile(4)  # 99.9th percentile at 4 degrees of freedom (18.47)


def test_the_rule_keeps_the_targets_distribution():
    assert 18.47 < BOUND < 18.47 * 1.015  # the exact quantile, and Wilson-Hilferty's +1.4%
    assert chi_square(counts(first_tokens(accept_draft)), P) < BOUND


def wrong_accept_all(p, q, drafts, gen):  # no rejection at all: the draft's distribution comes out
    return torch.full((drafts.shape[0],), drafts.shape[1]), p[:, -1].multinomial(1, generator=gen)[:, 0]


def wrong_resample_from_p(p, q, drafts, gen):  # the right test, but a rejection resamples from p, not p - q
    r = torch.rand(drafts.shape, generator=gen, dtype=torch.float64)
    ok = r < p[:, :-1].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]
    n = ok.long().cumprod(1).sum(1)
    return n, p[torch.arange(len(n)), n].multinomial(1, generator=gen)[:, 0]


@pytest.mark.parametrize("wrong", [wrong_accept_all, wrong_resample_from_p])
def test_wrong_rules_fail_the_same_test(wrong):
    assert chi_square(counts(first_tokens(wrong)), P) > 10 * BOUND


def test_acceptance_rate_and_the_accepted_prefix():
    assert acceptance_rate(P, Q).item() == pytest.approx(0.45)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(Q.expand(N, 5), 1, generator=gen)  # k = 1
    n, _ = accept_draft(P.expand(N, 2, 5), Q.expand(N, 1, 5), drafts, gen)
    assert abs(n.double().mean().item() - 0.45) < 4 * (0.45 * 0.55 / N) ** 0.5


def test_formulas():
    assert expected_tokens_per_round(0.0, 4) == 1 and expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))


def tiny(seed, dtype=torch.float64, **overrides):
    model = Llama(LlamaConfig.from_name("tiny", **overrides))
    model.init_weights(seed=seed)
    return model.to(dtype).eval()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_is_the_targets_greedy_output(k):
    target = tiny(0)
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(k))
    want = generate(target, prompt, 17)
    # an untrained draft (another seed) is rejected almost always; the target as its own draft never is
    for draft, rate in ((tiny(1, n_layers=1), None), (target, 1.0)):
        got, c = speculative_generate(target, draft, prompt, 17, k)
        assert torch.equal(got, want)
        assert sum(c["emitted"]) == 17 and c["accepted"] <= c["drafted"]  # a round never overshoots
        if rate:
            assert c["accepted"] == c["drafted"] and c["rounds"] == -(-17 // (k + 1))


def test_sampled_first_token_follows_the_target():
    """End to end on a vocabulary of 8: the first token of 400 speculative runs (one draft token) against
    the target's own next-token distribution. Untied heads, logits scaled up (x 10 through the final norm):
    the target spreads over the vocabulary, the draft puts 0.88 on a token the target gives 0.05
    (alpha = 0.17), so a rule that kept the draft's tokens, or resampled from p, would be far off."""
    target, draft = tiny(0, vocab_size=8, tie_embeddings=False), tiny(5, vocab_size=8, n_layers=1, tie_embeddings=False)
    prompt = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        target.norm.weight.mul_(10)
        draft.norm.weight.mul_(10)
        p = probabilities(target(prompt)[0, -1], 1.0)
        assert 0.1 < acceptance_rate(p, probabilities(draft(prompt)[0, -1], 1.0)) < 0.25
    gen = torch.Generator().manual_seed(0)
    runs = [speculative_generate(target, draft, prompt, 2, 1, temperature=1.0, generator=gen)[0] for _ in range(400)]
    first = torch.tensor([int(tokens[0, 3]) for tokens in runs])
    assert chi_square(counts(first, 8), p) < chi_square_quantile(7)


def test_bad_input():
    target = tiny(0)
    with pytest.raises(BadInput, match="the draft's vocabulary"):
        speculative_generate(target, tiny(0, vocab_size=8), torch.tensor([[1]]), 2)
    with pytest.raises(BadInput, match="one sequence"):
        speculative_generate(target, target, torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(BadInput, match="k and max_new_tokens must be ints >= 1"):
        speculative_generate(target, target, torch.tensor([[1]]), 2, k=0)
    with pytest.raises(BadInput, match=r"p must be \(B, k\+1, V\)"):
        accept_draft(P.expand(1, 2, 5), Q.expand(1, 2, 5), torch.zeros(1, 2, dtype=torch.long))
