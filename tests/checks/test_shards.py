"""Each rank only its own shard, drawn from a secret seed (issue 26).

The vocabulary-parallel cross-entropy (Day 7) and the ZeRO checks (Day 5) used to hand every rank
the seed and the whole problem (the full logits, the global batch): a student's function found the
full logits in its caller's frame, or redrew the case from the seed with a copy of the test bench,
and computed the answer without a byte of communication. Now the grader draws the case (from a
secret seed when it grades) and each rank receives its own part only, deleted before any student
code runs on any rank.
"""

from __future__ import annotations

import inspect
import os
import random

import pytest
import torch
import torch.nn.functional as F

from dlo.checks import day7
from dlo.grading.api import DirectSession, case_seed

pytestmark = pytest.mark.usefixtures("one_thread")


def peek_at_the_full_logits(logits, target, group=None):
    """Cross-entropy of the whole logits found on the stack: right, and not a byte sent."""
    import torch.distributed as dist
    for info in inspect.stack():
        for value in info.frame.f_locals.values():
            full = value.get("logits") if isinstance(value, dict) else None
            if isinstance(full, torch.Tensor) and full.shape[-1] > logits.shape[-1]:
                r, v = dist.get_rank(), logits.shape[-1]
                whole = torch.cat([full[:, :r * v], logits, full[:, (r + 1) * v:]], -1)
                return F.cross_entropy(whole, target)
    raise RuntimeError("no full logits on the stack")


def redraw_the_case(logits, target, group=None):
    """The test bench's case drawing, copied from its source (readable on disk), with the test cell's
    seed: the whole logits recomputed on the rank."""
    import torch.distributed as dist
    t, r, v = dist.get_world_size(), dist.get_rank(), logits.shape[-1]
    for seed in (0, 1, 2):
        for trial in range(3):
            rng, gen = random.Random(seed * 10 + trial), torch.Generator().manual_seed(1000 * seed + 50 + trial)
            n, vocab = rng.choice([1, 7, 13]), t * rng.choice([3, 5, 11])
            shift = 800.0 if trial == 1 else 0.0
            full = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * rng.choice([0.5, 3.0]) + shift
            if full.shape == (logits.shape[0], t * v) and torch.equal(full[:, r * v:(r + 1) * v], logits.detach()):
                whole = torch.cat([full[:, :r * v], logits, full[:, (r + 1) * v:]], -1)
                return F.cross_entropy(whole, target)
    raise RuntimeError("the case could not be redrawn")


def test_the_full_logits_are_on_no_rank(ranks):
    with pytest.raises(AssertionError, match="no full logits on the stack"):
        day7.check_vocab_parallel_cross_entropy(peek_at_the_full_logits)


def test_a_graded_case_cannot_be_redrawn(tmp_path, ranks):
    """In a notebook (direct checks) the case comes from the test cell's seed: copying the bench's
    drawing works there, and only there; the grader draws it from a secret seed."""
    from dlo.grading.trusted import LocalSandbox  # here: the ranks import this module (sealed) for its functions

    assert case_seed(3) == 3  # the direct backend: reproducible feedback
    day7.check_vocab_parallel_cross_entropy(redraw_the_case)  # the cheat works where the seed is known
    with LocalSandbox(tmp_path) as sandbox:
        with pytest.raises(AssertionError, match="the case could not be redrawn"):
            sandbox.run(day7.check_vocab_parallel_cross_entropy, redraw_the_case)


def _what_a_rank_holds(mine, tag):
    """A worker: this rank's part, and what is left in the folder the parts came through."""
    folder = next(f.frame.f_locals["shards"] for f in inspect.stack() if "shards" in f.frame.f_locals)
    return {"mine": mine, "tag": tag, "left": sorted(os.listdir(folder))}


def test_each_rank_gets_its_part_and_sees_no_other():
    parts = [{"rank": r, "secret": torch.full((2,), float(r))} for r in range(2)]
    got = DirectSession("shards", ()).on_ranks(_what_a_rank_holds, 2, ("x",), {}, 120, "gloo", per_rank=parts)
    for r, res in enumerate(got):
        assert res["mine"]["rank"] == r and res["mine"]["secret"].tolist() == [float(r)] * 2 and res["tag"] == "x"
        assert res["left"] == []  # every part was taken and deleted before the worker ran
