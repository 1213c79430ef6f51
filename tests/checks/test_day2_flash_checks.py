"""Day 2's FlashAttention check accepts the notebook's solution and rejects the stub and plausible
mistakes, each for its own reason (the mistakes are one written-out forward with one thing wrong)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from dlo.checks import day2
from dlo.grading.forbid import ForbiddenCall
from tests.checks.conftest import load_solution


@pytest.fixture(scope="module")
def solution():
    return load_solution("day2_mixed_precision").flash_attention_forward


def stub(q, k, v, *, causal=False, block_k=32):
    raise NotImplementedError()


def forward(q, k, v, *, causal=False, block_k=32, rescale_out=True, rescale_sum=True, diagonal=0, local_max=False,
            upcast=True):
    """A block-wise forward (what a student writes), with one thing wrong where asked: no rescale of the
    output or of the sum, the causal mask shifted off the diagonal by `diagonal`, FlashAttention-1's
    block-local maximum exp(S - rowmax S_j) (nan where a block is masked entirely), or the scores taken
    in the input dtype (bf16: 3 digits)."""
    dtype, q_in, k_in = q.dtype, q, k
    q, k, v = (x.float() for x in (q, k, v))
    if not upcast:
        q, k = q_in, k_in
    T = q.shape[-2]
    m = torch.full(q.shape[:-1], -math.inf)
    ell, acc = torch.zeros(q.shape[:-1]), torch.zeros_like(q)
    for j in range(0, T, block_k):
        s = (q @ k[..., j:j + block_k, :].transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.arange(j, j + s.shape[-1]) > torch.arange(T)[:, None] + diagonal, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        if local_max:
            m_j = s.amax(-1)
            p = torch.exp(s - m_j[..., None]) * torch.exp(m_j - m_new)[..., None]
        else:
            p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(m - m_new)
        ell = (alpha if rescale_sum else 1.0) * ell + p.sum(-1)
        acc = (alpha[..., None] if rescale_out else 1.0) * acc + p @ v[..., j:j + block_k, :]
        m = m_new
    return (acc / ell[..., None]).to(dtype), m + torch.log(ell)


def naive(q, k, v, *, causal=False, block_k=32):
    """Correct numbers from the (T, T) scores written out: the memory check's case."""
    T = q.shape[-2]
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), torch.logsumexp(s, -1)


def fused(q, k, v, *, causal=False, block_k=32):
    o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal)[0]
    return o, forward(q, k, v, causal=causal, block_k=block_k)[1]


def test_accepts_solution(solution, capsys):
    day2.check_flash_attention(solution)
    day2.check_flash_attention(solution, seed=1, trials=6)
    day2.check_flash_attention(partial(forward), seed=2)  # the written-out forward above, nothing wrong
    assert ": ok (" in capsys.readouterr().out


def test_stub_scores_nothing():
    with pytest.raises(NotImplementedError):
        day2.check_flash_attention(stub)


@pytest.mark.parametrize("wrong,match", [
    (partial(forward, rescale_out=False), r"^flash_attention: O \(rescale the unnormalised output"),
    (partial(forward, rescale_sum=False), r"^flash_attention: L \(m \+ log l"),
    (partial(forward, diagonal=-1), r"nan at 1 of \d+ query positions, the first 0: query 0 has no key left"),
    (partial(forward, diagonal=1), r"^flash_attention: L .*causal=True"),
    (partial(forward, local_max=True), r"nan at \d+ of \d+ query positions, .*: exp\(-inf - \(-inf\)\) is nan"),
    (naive, r"materialised a \(T x T\) matrix: aten\.\w+ made a float32 tensor of shape \(.*\b(\d+), \1\), T=\1;"),
    (fused, r"the torch operator aten::_scaled_dot_product_flash_attention_for_cpu is off limits"),  # at dispatch
    (partial(forward, upcast=False), r"^flash_attention: L .*compute in fp32 \(q\.float\(\)\).*dtype=bfloat16")])
def test_rejects(wrong, match):
    with pytest.raises(AssertionError, match=match):
        day2.check_flash_attention(wrong)


def test_rejects_a_full_causal_mask():
    def blocks_with_full_mask(q, k, v, *, causal=False, block_k=32):
        torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()  # the whole mask, then sliced per block
        return forward(q, k, v, causal=causal, block_k=block_k)

    with pytest.raises(AssertionError, match=r"materialised a \(T x T\) matrix: aten\.\w+ made a bool tensor"):
        day2.check_flash_attention(blocks_with_full_mask, trials=1)


def test_rejects_wrong_returns():
    with pytest.raises(AssertionError, match=r"return \(O, L\), two tensors; got a Tensor "):
        day2.check_flash_attention(lambda q, k, v, *, causal, block_k: forward(q, k, v, causal=causal)[0])
    with pytest.raises(AssertionError, match=r"O must be q's shape .* and dtype bfloat16, got .* float32"):
        day2.check_flash_attention(lambda q, k, v, *, causal, block_k: (lambda o, lse: (o.float(), lse))(
            *forward(q, k, v, causal=causal, block_k=block_k)))


def test_references_are_refused():
    from dlo.kernels.flash_attention import flash_attention_blocked_ref

    with pytest.raises(ForbiddenCall, match="off limits"):
        day2.check_flash_attention(lambda q, k, v, *, causal, block_k: flash_attention_blocked_ref(q, k, v, causal))
    with pytest.raises(ForbiddenCall, match="off limits"):
        day2.check_flash_attention(lambda q, k, v, *, causal, block_k: (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), None))


def test_sandboxed(sandbox, solution, capsys):
    sandbox.run(day2.check_flash_attention, solution, trials=1)
    assert ": ok (" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"materialised a \(T x T\) matrix"):
        sandbox.run(day2.check_flash_attention, naive, trials=1)

