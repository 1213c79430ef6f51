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



# ----------------------------------------------------------------------------- other honest forwards, red team

def query_and_key_blocks(q, k, v, *, causal=False, block_k=32, block_q=16):
    """Algorithm 1 as written: query blocks x key blocks (einsum), the key blocks past a causal row skipped."""
    dtype, (T, D) = q.dtype, q.shape[-2:]
    q, k, v = q.float() / math.sqrt(D), k.float(), v.float()
    outs, lses = [], []
    for i in range(0, T, block_q):
        q_i = q[..., i:i + block_q, :]
        rows = torch.arange(i, i + q_i.shape[-2])[:, None]
        m, ell, acc = torch.full(q_i.shape[:-1], -math.inf), torch.zeros(q_i.shape[:-1]), torch.zeros_like(q_i)
        for j in range(0, i + q_i.shape[-2] if causal else T, block_k):
            s = torch.einsum("bhqd,bhkd->bhqk", q_i, k[..., j:j + block_k, :])
            if causal:
                s = s.masked_fill(torch.arange(j, j + s.shape[-1]) > rows, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p, alpha = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            ell = alpha * ell + p.sum(-1)
            acc = alpha[..., None] * acc + torch.einsum("bhqk,bhkd->bhqd", p, v[..., j:j + block_k, :])
            m = m_new
        outs.append(acc / ell[..., None])
        lses.append(m + torch.log(ell))
    return torch.cat(outs, -2).to(dtype), torch.cat(lses, -1)


def per_head_matrices(q, k, v, *, causal=False, block_k=32):
    """One (T, D) head at a time with mm/addmm on K^T transposed once (a (D, T) tensor: not scores)."""
    B, H, T, D = q.shape
    o, lse = torch.empty(q.shape, dtype=q.dtype), torch.empty(B, H, T)
    for b in range(B):
        for h in range(H):
            q_bh, kt, v_bh = q[b, h].float(), k[b, h].float().t().contiguous(), v[b, h].float()
            m, ell, acc = torch.full((T,), -math.inf), torch.zeros(T), torch.zeros(T, D)
            for j in range(0, T, block_k):
                s = torch.mm(q_bh, kt[:, j:j + block_k]) * D ** -0.5
                if causal:
                    s = torch.where(torch.arange(T)[:, None] >= torch.arange(j, j + s.shape[1]), s, -math.inf)
                m_new = torch.max(m, s.max(dim=1).values)
                p, alpha = (s - m_new[:, None]).exp(), (m - m_new).exp()
                ell = ell * alpha + p.sum(1)
                acc = torch.addmm(acc * alpha[:, None], p, v_bh[j:j + block_k])
                m = m_new
            o[b, h], lse[b, h] = (acc / ell[:, None]).to(q.dtype), m + torch.log(ell)
    return o, lse


@pytest.mark.parametrize("honest", [query_and_key_blocks, per_head_matrices])
def test_accepts_other_block_wise_forwards(honest, capsys):
    for seed in range(3):
        day2.check_flash_attention(honest, seed=seed)
    assert ": ok (" in capsys.readouterr().out


def query_chunks(q, k, v, *, causal=False, block_k=32, rows=None):
    """Red team: the exact softmax over all T keys, a few query rows at a time (no tensor reaches T x T);
    no key blocks, no running maximum."""
    dtype, (B, H, T, D) = q.dtype, q.shape
    rows = rows or max(1, T // (2 * B * H))
    q, k, v = q.float(), k.float(), v.float()
    outs, lses = [], []
    for i in range(0, T, rows):
        s = q[..., i:i + rows, :] @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, rows, T)
        if causal:
            s = s.masked_fill(torch.arange(T) > torch.arange(i, i + s.shape[-2])[:, None], -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1) @ v)
    return torch.cat(outs, -2).to(dtype), torch.cat(lses, -1)


def naive_in_numpy(q, k, v, *, causal=False, block_k=32):
    """Red team: the (T, T) scores written out in numpy, where no dispatch mode sees them."""
    import numpy as np

    T, D = q.shape[-2:]
    qn, kn, vn = (x.float().numpy().astype(np.float64) for x in (q, k, v))
    s = qn @ kn.swapaxes(-1, -2) / math.sqrt(D)
    if causal:
        s = np.where(np.tri(T, dtype=bool), s, -np.inf)
    mx = s.max(-1, keepdims=True)
    p = np.exp(s - mx)
    ell = p.sum(-1, keepdims=True)
    return torch.from_numpy((p / ell) @ vn).to(q.dtype), torch.from_numpy(mx + np.log(ell))[..., 0].float()


def numpy_scores_beside(q, k, v, *, causal=False, block_k=32):
    """Red team: the block-wise forward for the watch, and the (T, T) scores in numpy beside it."""
    q.float().numpy() @ k.float().numpy().swapaxes(-1, -2)
    return forward(q, k, v, causal=causal, block_k=block_k)


def numpy_rows(q, k, v, *, causal=False, block_k=32, rows=4):
    """Red team (round 15): the exact softmax in numpy, a few query rows at a time: little memory, and no
    torch operator for the span rule to see."""
    import numpy as np

    T, D = q.shape[-2:]
    qn, kn, vn = (x.float().numpy() for x in (q, k, v))
    o, lse = np.empty(qn.shape, np.float32), np.empty(qn.shape[:-1], np.float32)
    for i in range(0, T, rows):
        s = qn[..., i:i + rows, :] @ kn.swapaxes(-1, -2) / math.sqrt(D)
        if causal:
            s = np.where(np.arange(T) <= np.arange(i, min(i + rows, T))[:, None], s, -np.inf)
        mx = s.max(-1, keepdims=True)
        p = np.exp(s - mx)
        ell = p.sum(-1, keepdims=True)
        o[..., i:i + rows, :], lse[..., i:i + rows] = (p / ell) @ vn, (mx + np.log(ell))[..., 0]
    return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse)


def modes_disabled(q, k, v, *, causal=False, block_k=32):
    """Red team (round 15): the (T, T) scores written out with every dispatch mode popped (the watch's too),
    the way a tensor's repr pops them."""
    with torch.utils._python_dispatch._disable_current_modes():
        return naive(q, k, v, causal=causal)


def stack_popped(q, k, v, *, causal=False, block_k=32):
    """Red team (round 15): the watch popped off torch's dispatch stack by hand, pushed back after."""
    modes = [torch._C._pop_torch_dispatch_stack(None) for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        return naive(q, k, v, causal=causal)
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_dispatch_stack(mode)


def dispatch_disabled(q, k, v, *, causal=False, block_k=32):
    """Red team (round 15): torch's Python dispatch switched off (no mode sees anything)."""
    with torch._C._DisableTorchDispatch():
        return naive(q, k, v, causal=causal)


OUTSIDE = r"multiply-adds, q k\^T and P V over the \(query, key\) pairs take \d+: the attention ran outside torch's"
RED_TEAM = [(query_chunks, r"aten\.logsumexp on \(1, [12], \d+, (\d+)\) combined \1 elements of one dimension at once"),
            (partial(query_chunks, rows=1), r"a softmax or P V over all T=\d+ keys is not FlashAttention"),
            (naive_in_numpy, OUTSIDE),
            (numpy_scores_beside, r"bytes allocated outside torch \(numpy arrays, Python lists\)"),
            (numpy_rows, OUTSIDE),
            (modes_disabled, OUTSIDE),
            (stack_popped, OUTSIDE),
            (dispatch_disabled, r"torch\._C\._DisableTorchDispatch is off limits")]


@pytest.mark.parametrize("cheat,match", RED_TEAM, ids=["query_chunks", "one_query_row", "naive_in_numpy",
                                                       "numpy_scores_beside", "numpy_rows", "modes_disabled",
                                                       "stack_popped", "dispatch_disabled"])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_red_team_fails(cheat, match, seed):
    """Red team (Day 2): each passed the check at every seed before the span and host-memory rules, or (round
    15: numpy a few rows at a time, the watch popped or switched off) before the work-seen rule and `MODES`."""
    with pytest.raises(AssertionError, match=match):
        day2.check_flash_attention(cheat, seed=seed)


def test_red_team_fails_sandboxed(sandbox):
    """The span, tracemalloc and the work seen are read where the student's code runs: in the jail too. There
    the kernel's count of the process (its ~4k-key case, `test_kernel_count`) may name the same fault first:
    scores kept beside the work, in numpy or in torch."""
    for cheat, match in RED_TEAM[::3]:
        with pytest.raises(AssertionError, match=f"{match}|resident memory grew by .* half a \\(T x T\\) fp32"):
            sandbox.run(day2.check_flash_attention, cheat, trials=1)
