"""The kernel's count of 1F1B's first stage (Day 6), read outside the rank.

1F1B's point is memory: the first stage keeps at most p micro-batches of activations alive, GPipe all m. The
step check counts what each forward saved with a meter in the rank's own process (`dlo.checks.saved`), which
a step that keeps its activations elsewhere (tensors as `ctx` attributes of a Function of its own, bytes)
or finds the meter passes. Here the process that launched the ranks reads each rank's memory from /proc
(`dlo.checks.rank_count`) on a case where activations dominate the first stage (`count_parts`: CoAtNet
"tiny" at 64 x 64 in float32, 4p micro-batches of 4 images, 5.7 MiB of activations each on stage 0, cut
after block 4 of 14 so that stage 0 holds the stem and the first convolution stage): the course's 1F1B runs it
first on a copy of the rank's stage (`reference_one_f_one_b`, before any student object exists), then the
student's step on the stage itself. The student's peak above the mark may exceed the reference's by one
micro-batch's activations and 8 MiB (`slack`: 2.4 micro-batches here). Measured (2026-12-01, 2 ranks, m = 8,
seeds 0-2), in micro-batches' activations on rank 0: the reference 1.6-1.9 (p = 2), the solution's 1F1B
1.7-1.9 (within 0.2 of the reference on the same rank), the solution's GPipe 7.8-8.0 (m = 8), a 1F1B keeping each
layer's output as bytes until the step ends 8.4-8.6. The count costs one more launch: 1.1 s a check on 2 cores.
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn.functional as F

from dlo.checks.rank_count import counted_peaks
from dlo.distributed.pipeline import build_stages, make_stage_modules
from dlo.measure import SavedTensorMeter
from dlo.models.coatnet import coatnet

IMAGE, PER_MICRO, CUT = 64, 4, 4  # image side, samples per micro-batch, blocks on stage 0 (of 2)


def count_parts(seed: int, p: int) -> dict:
    """The counted case on p ranks: each rank's part (its `Stage`, the micro-batches on the first, the targets
    on the last) and one micro-batch's bytes saved for backward on stage 0 (`one`), measured here."""
    torch.manual_seed(3000 + seed)
    model = coatnet("tiny", image_size=IMAGE).eval()  # eval: BatchNorm per sample, as the step checks
    n, m = len(model.blocks), 4 * p
    rest = (n - CUT) // max(1, p - 1)  # the other blocks, evenly on the other stages
    bounds = [0] + [CUT + i * rest for i in range(p - 1)] + [n] if p > 1 else [0, n]
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(PER_MICRO, 3, IMAGE, IMAGE, generator=gen) for _ in range(m)]
    ys = [torch.randint(0, model.cfg.num_classes, (PER_MICRO,), generator=gen) for _ in range(m)]
    mods = make_stage_modules(list(model.blocks), bounds)
    with SavedTensorMeter(exclude=[*mods[0].parameters(), *mods[0].buffers()]) as meter:
        mods[0](xs[0])
    parts = []
    for r in range(p):
        stage = build_stages(mods, p, [PER_MICRO] * m, (3, IMAGE, IMAGE), rank=r)[0]
        parts.append({"stage": stage, "xs": xs if stage.is_first else None, "ys": ys if stage.is_last else None})
    return {"parts": parts, "one": meter.peak, "m": m}


def step_on(fn, part: dict, stage) -> None:
    fn(stage, part["xs"], part["ys"], F.cross_entropy)


def reference_one_f_one_b(part: dict) -> bool:
    """On each rank, before the student's objects exist (`dlo.grading.ranks.run_on_rank`): the course's 1F1B
    on a copy of the rank's stage, then let go of (`steady_malloc` is set: the rank's memory falls back)."""
    from dlo.distributed.pipeline import one_f_one_b_step

    stage = copy.deepcopy(part["stage"])
    step_on(one_f_one_b_step, part, stage)
    del stage
    gc.collect()
    return True


def count_worker(part: dict, fn, *, counted: bool = False) -> bool:
    """The student's step on the counted case (only where the launcher counts: `counted`)."""
    if not counted:
        return False
    step_on(fn, part, part["stage"])
    return True


count_worker.counted_prelude = reference_one_f_one_b


def slack(one: int) -> int:
    """What the student's step may reach beyond the reference's: one micro-batch's activations (a forward's
    output held until its send completes, a gradient received early) and 8 MiB."""
    return one + 8 * 2 ** 20


def verify_count(name: str, case: dict, p: int, where: dict) -> str:
    """Rank 0's peak in the last `on_ranks(count_worker, ...)` against the reference's, and a line for `ok`."""
    peaks = counted_peaks(name, str(where))
    one, m = case["one"], case["m"]
    ref, got = peaks[0]
    if got > ref + slack(one):
        raise AssertionError(f"{name}: on the large case (m = {m} micro-batches of {PER_MICRO} images, "
                             f"{one / 2 ** 20:.1f} MiB of activations each on the first stage) rank 0's resident "
                             f"memory rose by {got / 2 ** 20:.0f} MiB during your step, as the kernel counts it "
                             f"outside your code, {(got - ref) / one:.1f} micro-batches' worth more than the course's "
                             f"1F1B ({ref / 2 ** 20:.0f} MiB; one micro-batch and 8 MiB more allowed): 1F1B keeps at "
                             f"most p = {p} micro-batches of activations alive on the first stage, in whatever form "
                             f"({where})")
    return f"rank 0 rose by {got / one:.1f} micro-batches' activations on the large case, the course's 1F1B by " \
           f"{ref / one:.1f}"
