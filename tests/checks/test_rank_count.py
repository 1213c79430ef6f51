"""Memory counted outside the rank (issue 33): Days 5 and 6's meters live in the rank, Day 10's ring check has none,
the kernel's count sees all three.

The ZeRO-2 check measures what a rank keeps during backward, and the 1F1B check what the first stage's forwards
saved, with meters in the rank's own process, which count tensors (`dlo.measure.held_bytes`, `live_bytes`,
`dlo.checks.saved`). A ZeRO-2 that also keeps every full gradient, or a 1F1B that also keeps each micro-batch's
activations, as bytes, passes them; Day 10's ring check sees what each hop carries, which a rank that keeps every
block it passed on and attends once at the end satisfies (a red team's). The notebook's check on the tests' reused
ranks shows each below. Where the ranks are launched for the check (a notebook's launch, the grader's sandbox) the
launcher reads each rank's memory from /proc on a large case, the course's own engine first
(`dlo.checks.rank_count`), and that count sees it. Honest work stays far under the allowance (Day 10, 2026-12-02,
in K/V blocks above the mark on rank 0: the course's ring 4.5, the solution 4.7, a double-buffered ring sending K
and V apart 4.6, a ring keeping every block and attending at the end 8.6, allowed 6.5).
"""

from __future__ import annotations

import pytest

from dlo.checks.day5 import check_zero2
from dlo.checks.day6 import check_one_f_one_b_step
from dlo.checks.day6_count import count_parts, count_worker, verify_count
from dlo.checks.day10 import check_ring_forward
from dlo.grading.api import check, on_ranks
from dlo.grading.jail import probe
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.trust
needs_bwrap = pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}")

# The student's cell, in a module nothing can import: its classes travel by value, as a notebook's do.
STUDENT = '''
def keeping_gradients_as_bytes(base):
    class KeepsGradients(base):
        """The instructors' ZeRO-2, and every full gradient kept as bytes from backward to the step: no tensor
        holds them, so no meter that counts tensors sees them."""

        kept = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for p in self.module.parameters():
                p.register_hook(lambda g: KeepsGradients.kept.append(bytearray(g.numpy().tobytes())) or g)

        def step(self):
            super().step()
            KeepsGradients.kept.clear()
    return KeepsGradients

def keeping_activations_as_bytes(step):
    def one_f_one_b_keeping(stage, microbatches, targets, loss_fn):
        """The instructors' 1F1B, and every activation of each micro-batch (each layer's output) kept as bytes
        until the step ends, as GPipe would hold them."""
        kept = []
        leaves = [m for m in stage.module.modules() if not list(m.children())]
        hooks = [m.register_forward_hook(lambda m, i, out: kept.append(out.detach().numpy().tobytes())) for m in leaves]
        try:
            return step(stage, microbatches, targets, loss_fn)
        finally:
            for h in hooks:
                h.remove()
    return one_f_one_b_keeping

def keeping_every_block(merge):
    import math

    import torch
    import torch.distributed as dist

    def attend_one(q, kv, r, j, causal):
        t = q.shape[2]
        s = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.arange(j * t, (j + 1) * t)[None, :] > torch.arange(r * t, (r + 1) * t)[:, None],
                              float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)) @ kv[1], lse

    def ring_keeping_all(q, k, v, causal):
        """A ring that passes the right block at each hop, keeps every block it received and attends to them one by
        one after the last hop, merged with the instructors' merge: right values, right messages."""
        n, r = dist.get_world_size(), dist.get_rank()
        kv = torch.stack([k, v])
        kept = [(r, kv)]
        for s in range(1, n):
            recv = torch.empty_like(kv)
            for op in [dist.isend(kv, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]:
                op.wait()
            kv = recv
            kept.append(((r - s) % n, kv))
        del kv, recv
        o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        while kept:
            j, block = kept.pop(0)
            o, lse = merge(o, lse, *attend_one(q, block, r, j, causal))
        return o, lse
    return ring_keeping_all
'''


COUNTED = r"as the kernel counts it outside your code"
MATCH = {"zero2": r"rank \d's resident memory rose by \d+ MiB, " + COUNTED,
         "1f1b": r"rank 0's resident memory rose by \d+ MiB during your step, " + COUNTED,
         "ring": r"rank \d's resident memory rose by \d+ MiB during your forward, " + COUNTED}
CHECK = {"zero2": check_zero2, "1f1b": check_one_f_one_b_step, "ring": check_ring_forward}
DAYS = list(CHECK)


@pytest.fixture(scope="module")
def student():
    """Per check: (the instructors' answer, the same keeping its state as bytes or every block); and the
    instructors' GPipe."""
    ns = {"__name__": "rank_count_student"}
    exec(compile(STUDENT, "student cell", "exec"), ns)
    zero2, pipeline = load_solution("day5_fsdp").ZeRO2, load_solution("day6_pipeline")
    ring = load_solution("day10_context_experts")
    return {"zero2": (zero2, ns["keeping_gradients_as_bytes"](zero2)),
            "1f1b": (pipeline.one_f_one_b_step, ns["keeping_activations_as_bytes"](pipeline.one_f_one_b_step)),
            "ring": (ring.ring_attention_forward, ns["keeping_every_block"](ring.merge_partials)),
            "gpipe": pipeline.gpipe_step}


@pytest.mark.parametrize("day", DAYS)
def test_state_kept_as_bytes_passes_the_meters_in_the_rank(student, ranks, day):
    """The hole: on ranks nobody reads from outside, the meters of the check see tensors only."""
    CHECK[day](student[day][1], seed=1)


@pytest.mark.parametrize("day", DAYS)
def test_the_launcher_counts_the_state_kept_as_bytes(student, day):
    with pytest.raises(AssertionError, match=MATCH[day]):
        CHECK[day](student[day][1], seed=1)


@pytest.mark.parametrize("day", DAYS)
def test_honest_work_passes_under_the_launcher_s_count(student, day):
    CHECK[day](student[day][0], seed=1)


@needs_bwrap
@pytest.mark.parametrize("day", DAYS)
def test_the_sandbox_counts_the_state_kept_as_bytes(student, jail, day):
    """In the grader's sandbox the launcher (its session child) may not reset a rank's high water mark (the
    ranks are not dumpable): the count runs from the reference's peak, and the verdict is the same."""
    with pytest.raises(AssertionError, match=MATCH[day]):
        jail.run(CHECK[day], student[day][1], seed=2)


@needs_bwrap
@pytest.mark.parametrize("day", DAYS)
@pytest.mark.parametrize("seed", [0, 2])
def test_honest_work_passes_under_the_sandbox_s_count(student, jail, day, seed):
    jail.run(CHECK[day], student[day][0], seed=seed)


@check(forbid=())
def count_only(fn, seed: int = 0):
    """The count of the 1F1B check alone, whatever the rank's own meters and message watch would say."""
    case = count_parts(seed, 2)
    on_ranks(count_worker, 2, fn, per_rank=case["parts"])
    verify_count("count_only", case, 2, {"seed": seed})


def test_gpipe_fails_the_count_whatever_the_rank_s_meters_say(student):
    """GPipe keeps all m micro-batches alive on the first stage: 7.8-8.0 of them against 1F1B's 1.6-1.9. A GPipe
    step that rewrote the meter and the message watch in its rank (as Days 1-3's rewritten watches do) to look
    like 1F1B would pass the check's in-rank rules and still fail here."""
    with pytest.raises(AssertionError, match=MATCH["1f1b"]):
        count_only(student["gpipe"], seed=3)
