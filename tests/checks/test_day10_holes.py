"""Day 10's holes a red team found (release 0, 2026-12-02), each shown closed by a small cheat like theirs.

- exercise 3: the counted case (`dlo.checks.day10_count`: then always 6 ranks and D = 1024) recognised and skipped,
  its result never checked, so that the kernel's count stayed at the reference's while the checked cases kept
  every K/V block and attended once over the whole sequence; a variant computes the counted case right, block
  by block, but passes the blocks through files, sending nothing;
- exercise 6: the library's enumeration (`dlo.layout.layouts`, forbidden in the check) tabulated in the kernel for
  every problem the check's generator could draw, outside any check.

The counted case needs ranks the check launches (the launcher reads them), so the ring tests launch their own; the
cheats reach the ranks by value, as a notebook's do.
"""

from __future__ import annotations

import math
import random
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dlo.checks import day10, day10_count, day10_layout
from tests.checks.day10_students import merge_ok, ring_ok

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- 3. the ring's counted case

def _keep_all(q, k, v, causal):
    """The red team's checked-case ring: every block passed on and kept, one (T/N, T) score matrix at the end."""
    n, r = dist.get_world_size(), dist.get_rank()
    kv = torch.stack([k, v]).contiguous()
    held, cur = {r: kv}, kv
    for s in range(n - 1):
        nxt = torch.empty_like(cur)
        for op in [dist.isend(cur, (r + 1) % n), dist.irecv(nxt, (r - 1) % n)]:
            op.wait()
        cur = nxt
        held[(r - s - 1) % n] = cur
    K = torch.cat([held[j][0] for j in range(n)], 2)
    V = torch.cat([held[j][1] for j in range(n)], 2)
    t = q.shape[2]
    s = q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(n * t)[None, :] > torch.arange(r * t, (r + 1) * t)[:, None], float("-inf"))
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)


def skipping_the_counted_case(q, k, v, causal):
    """The red team's: the counted launch told by its size (6 ranks, a head of hundreds), its queries returned."""
    if dist.get_world_size() == 6 or q.shape[-1] >= 64:
        return q, q[..., 0]
    return _keep_all(q, k, v, causal)


def blocks_through_files(q, k, v, causal):
    """Right on the counted case, block by block (a ring's memory), but the blocks go through files in /tmp: the
    sockets send nothing (a barrier's bytes only); the checked cases keep every block, as above."""
    import os
    import tempfile

    n, r = dist.get_world_size(), dist.get_rank()
    if n != 6:
        return _keep_all(q, k, v, causal)
    where = os.path.join(tempfile.gettempdir(), f"day10-holes-{q.shape[-1]}-{q.shape[2]}")
    os.makedirs(where, exist_ok=True)
    torch.save(torch.stack([k, v]), os.path.join(where, f"{r}.tmp"))
    os.replace(os.path.join(where, f"{r}.tmp"), os.path.join(where, f"{r}.pt"))
    dist.barrier()
    o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for j in range(n):
        kv = torch.load(os.path.join(where, f"{j}.pt"))
        s = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        l_j = torch.logsumexp(s, -1)
        o, lse = merge_ok(o, lse, torch.exp(s - l_j[..., None]) @ kv[1], l_j)
        del kv, s
    dist.barrier()
    return o, lse


@pytest.mark.trust
def test_the_counted_case_is_checked_like_the_others():
    with pytest.raises(AssertionError, match=r"rank 0's output o on the large case .* differs from the reference"):
        day10.check_ring_forward(skipping_the_counted_case, seed=1, world_size=2)


@pytest.mark.trust
def test_the_counted_case_must_send_the_ring_s_blocks():
    with pytest.raises(AssertionError, match=r"rank \d's sockets sent [\d.]+ MiB, as the kernel counts them"):
        day10.check_ring_forward(blocks_through_files, seed=2, world_size=2)


@pytest.mark.trust
def test_the_counted_case_passes_a_ring(capsys):
    day10.check_ring_forward(ring_ok, seed=3, world_size=2)
    assert "K/V blocks on the large case" in capsys.readouterr().out


def test_the_counted_shape_follows_the_seed():
    """No one shape to wait for: the heads, positions and head size vary with the (secret) seed, the blocks stay
    7-10 MiB (the count's resolution), the shards are the case's."""
    shapes = {tuple(day10_count.count_shape(s).values()) for s in range(200)}
    assert len(shapes) > 150 and len({d for _, _, d in shapes}) > 100
    for s in range(200):
        c = day10_count.count_shape(s)
        assert 6.9 * 2 ** 20 < day10_count.block_bytes(c) < 10.1 * 2 ** 20
    case = day10_count.count_case(5)
    parts = day10_count.count_parts(case)
    assert len(parts) == day10_count.RANKS and torch.equal(torch.cat([p["k"] for p in parts], 2), case["k"])


def test_the_digest_tells_a_wrong_output():
    case = day10_count.count_case(0)
    o = torch.randn(1, case["H"], case["T_RANK"], case["D"], dtype=torch.float64)
    right = day10_count.digest(o, case["probe"])
    wrong = o.clone()
    wrong[0, 0, 3, 5] += 1e-6
    assert right == day10_count.digest(o.clone(), case["probe"])
    assert right[0][0] != day10_count.digest(wrong, case["probe"])[0][0]
    assert len(right) == case["H"]



# ----------------------------------------------------------------------------- 6. the layout search

def _old_depths(layers):
    return [n for n in range(layers * 3 // 4, layers * 5 // 4 + 1) if sum(n % d == 0 for d in range(1, n + 1)) >= 6]


@pytest.fixture(scope="module")
def enumeration_table():
    """The red team's (2026-12-02): the library's enumeration of every problem the former generator could draw,
    built outside any check, keyed by GPUs, depth, experts and batch (K/V heads 8 and lengths a power of 2: both
    filtered by hand), as int16 rows."""
    import numpy as np

    from dlo.layout import Cluster, Model, layouts

    tab = {}

    def add(g, n_layers, ne, b):
        if (g, n_layers, ne, b) not in tab:
            m = Model("x", n_layers, 1, 1, 8, 1, 1, False, 1 << 20, 1, 1, ne, 2 if ne else 0, 0)
            rows = [(x.dp, x.tp, x.pp, x.fsdp, x.m, x.ac, x.cp, x.ep) for x in layouts(m, Cluster("H100 SXM", g), b)]
            tab[(g, n_layers, ne, b)] = np.array(rows, dtype=np.int16).reshape(-1, 8).tobytes()

    for name, n_layers in (("llama3.2-3b", 28), ("llama3.1-8b", 32), ("llama3.1-70b", 80)):
        gl = [24, 32, 48, 64, 96, 128] if name == "llama3.1-70b" else [8, 12, 16, 24, 32, 48, 64]
        moes = {"llama3.2-3b": [8, 16], "llama3.1-8b": [8]}.get(name, [])
        for d in _old_depths(n_layers):
            for g in gl:
                for mult in (1, 2):
                    add(g, d, 0, g * mult)
                    if name != "llama3.1-70b":
                        add(g, d, 0, max(1, g * mult // 8))
                    for ne in moes:
                        add(g, d, ne, g * mult)
    for key in ((16, 32, 0, 16), (16, 28, 8, 16), (8, 32, 0, 8), (64, 80, 0, 64), (32, 80, 0, 32), (40, 80, 0, 32),
                (16, 32, 0, 2), (8, 80, 0, 8)):
        add(*key)
    return tab


def search_from(tab):
    def search_layout(model, cluster, batch):
        """The fastest entry of the table that fits, by the allowed fits and step_time."""
        import numpy as np

        from dlo.layout import Layout, fits, step_time

        rows = np.frombuffer(tab.get((cluster.gpus, model.layers, model.n_experts, batch), b""), dtype=np.int16)
        best = None
        for dp, tp, pp, fsdp, m, ac, cp, ep in rows.reshape(-1, 8).tolist():
            if (cp > 1 and model.seq % (2 * cp)) or model.kv_heads % tp:
                continue
            lay = Layout(dp, tp, pp, bool(fsdp), m, bool(ac), cp, ep)
            if fits(model, lay, cluster, batch):
                t = step_time(model, lay, cluster, batch)
                if best is None or t < best[0]:
                    best = (t, lay)
        if best is None:
            raise ValueError("no layout fits")
        return best[1]
    return search_layout


def test_the_table_answers_the_notebook_s_cases(enumeration_table):
    """The table is right where it has the problem: the fixed cases pass by it (outside a check)."""
    from dlo.layout import search, step_time

    search_layout = search_from(enumeration_table)
    for key, cluster, batch in day10_layout._cases(random.Random(0), 0):
        model = day10_layout.layout_model(*key)
        assert step_time(model, search_layout(model, cluster, batch), cluster, batch) == \
            step_time(model, search(model, cluster, batch), cluster, batch)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_table_of_the_enumeration_fails_the_seeded_cases(enumeration_table, seed):
    with pytest.raises(AssertionError, match=r"layout_search: "):
        day10_layout.check_layout_search(search_from(enumeration_table), seed=seed, trials=4)


def test_the_seeded_cases_vary_every_field_the_enumeration_reads():
    """K/V heads other than 8 (tp 3, 6, 12 for the 3B), lengths not powers of 2, GPU counts with factors 5, 7, 11,
    batches that are not 1 or 2 x the GPUs: over 50 seeds of 4 cases, each field takes many values."""
    from dlo.grading.api import case_seed

    drawn = [case for seed in range(50) for case in day10_layout._cases(random.Random(case_seed(seed)), 4)[7:]]
    keys = [k for k, _, _ in drawn]
    assert len({k[5] for k in keys}) >= 5 and any(k[5] % 3 == 0 for k in keys)
    assert sum(k[1] & (k[1] - 1) != 0 for k in keys) > 0.9 * len(keys)
    assert len({c.gpus for _, c, _ in drawn}) > 25 and any(c.gpus % 5 == 0 and c.gpus % 4 == 0 for _, c, _ in drawn)
    assert len({(c.gpus, b) for _, c, b in drawn}) > 150
    assert len({k[4] for k in keys}) > 20
