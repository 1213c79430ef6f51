"""The kernel's count of 1F1B's first stage (Day 6), read outside the rank.

1F1B's point is memory: the first stage keeps at most p micro-batches of activations alive, GPipe all m. The
step check counts what each forward saved with a meter in the rank's own process (`dlo.checks.saved`), which
a step that keeps its activations elsewhere (tensors as `ctx` attributes of a Function of its own, bytes)
or finds the meter passes. Here the process that launched the ranks reads each rank's memory from /proc
(`dlo.checks.rank_count`) on a case where activations dominate the first stage (`count_parts`: CoAtNet
"tiny" at 64 x 64 in float64, 4p micro-batches of 4 images, 11.3 MiB of activations each on stage 0, cut
after block 4 of 14 so that stage 0 holds the stem and the first convolution stage): the course's 1F1B runs it
first on a copy of the rank's stage (`reference_one_f_one_b`, before any student object exists), then the
student's step on the stage itself. The student's peak above the mark may exceed the reference's by one
micro-batch's activations and 8 MiB (`slack`: 1.7 micro-batches here). Measured (2026-12-01, 2 ranks, m = 8,
seeds 0-2, then in float32), in micro-batches' activations on rank 0: the reference 1.6-1.9 (p = 2), the solution's
1F1B 1.7-1.9 (within 0.2 of the reference on the same rank), the solution's GPipe 7.8-8.0 (m = 8), a 1F1B keeping
each layer's output as bytes until the step ends 8.4-8.6. In float64 (2026-12-02, seeds 0-2): the reference
2.0-2.1, the solution's 1F1B 2.1, the solution's GPipe 7.5-8.3. The count costs one more launch (5 s a check on 2
loaded cores) and the grader's own whole-batch step to compare with (2-2.6 s).

The count backs the memory rule only if the counted run does the work: a red team's step recognised the counted
case (then float32, the step cases float64) and returned None there, so that the rank's high water mark stayed at
the reference's, while its GPipe rewrote the watch in the step cases (2026-12-02). So the counted case is float64
as the step cases are, and checked like them (`verify_count`): each rank returns its stage's gradients as a digest
(`digest`: a random projection and the squared norm per parameter; the gradients themselves sent back would count
against the rank) and the last its loss, compared here with one process on the whole batch; and each rank's sockets,
read by the launcher, must have sent the activations (or gradients) of every micro-batch twice, the reference's
and the student's step's.
"""

from __future__ import annotations

import copy
import gc
import math

import torch
import torch.nn.functional as F

from dlo.checks.rank_count import counted_peaks, every_rank
from dlo.distributed.pipeline import build_stages, make_stage_modules
from dlo.grading.api import wire_sent
from dlo.grading.compare import DTYPE, assert_close
from dlo.measure import SavedTensorMeter
from dlo.models.coatnet import coatnet

IMAGE, PER_MICRO, CUT = 64, 4, 4  # image side, samples per micro-batch, blocks on stage 0 (of 2)
WIRE_SHARE = 0.99  # of the micro-batches' bytes each rank's sockets must have sent (gloo adds headers only)


def count_parts(seed: int, p: int) -> dict:
    """The counted case on p ranks: each rank's part (its `Stage`, the micro-batches on the first, the targets
    on the last, the digest's seed) and one micro-batch's bytes saved for backward on stage 0 (`one`), measured
    here. In float64, as the step cases (`dlo.checks.day6._case`): a step cannot tell the counted case by its dtype.
    The model, its cut and the batch stay here for `verify_count`."""
    torch.manual_seed(3000 + seed)
    model = coatnet("tiny", image_size=IMAGE).to(DTYPE).eval()  # eval: BatchNorm per sample, as the step checks
    n, m = len(model.blocks), 4 * p
    rest = (n - CUT) // max(1, p - 1)  # the other blocks, evenly on the other stages
    bounds = [0] + [CUT + i * rest for i in range(p - 1)] + [n] if p > 1 else [0, n]
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(PER_MICRO, 3, IMAGE, IMAGE, generator=gen, dtype=DTYPE) for _ in range(m)]
    ys = [torch.randint(0, model.cfg.num_classes, (PER_MICRO,), generator=gen) for _ in range(m)]
    probe = int(torch.randint(0, 2 ** 40, (1,), generator=gen))
    mods = make_stage_modules(list(model.blocks), bounds)
    with SavedTensorMeter(exclude=[*mods[0].parameters(), *mods[0].buffers()]) as meter:
        mods[0](xs[0])
    parts, stages = [], []
    for r in range(p):
        stage = build_stages(mods, p, [PER_MICRO] * m, (3, IMAGE, IMAGE), dtype=DTYPE, rank=r)[0]
        stages.append(stage)
        parts.append({"stage": stage, "xs": xs if stage.is_first else None, "ys": ys if stage.is_last else None,
                      "probe": probe})
    # the bytes of one step's messages each rank sends: activations to the next stage, gradients to the previous
    item = torch.empty((), dtype=DTYPE).element_size()
    sends = [sum(math.prod(s) for s in (st.out_shapes if not st.is_last else [])) * item
             + sum(math.prod(s) for s in (st.in_shapes if not st.is_first else [])) * item for st in stages]
    return {"parts": parts, "one": meter.peak, "m": m, "model": model, "bounds": bounds, "xs": xs, "ys": ys,
            "probe": probe, "sends": sends}


def step_on(fn, part: dict, stage):
    return fn(stage, part["xs"], part["ys"], F.cross_entropy)


def reference_one_f_one_b(part: dict) -> bool:
    """On each rank, before the student's objects exist (`dlo.grading.ranks.run_on_rank`): the course's 1F1B
    on a copy of the rank's stage, then let go of (`steady_malloc` is set: the rank's memory falls back)."""
    from dlo.distributed.pipeline import one_f_one_b_step

    stage = copy.deepcopy(part["stage"])
    step_on(one_f_one_b_step, part, stage)
    del stage
    gc.collect()
    return True


def digest(grads: list, seed: int) -> list:
    """[w . g, g . g] for each gradient g (None where there is none), w drawn from `seed` (one tensor's worth at
    a time): what a rank returns of its stage's gradients; a gradient the step got wrong moves w . g."""
    out = []
    with torch.no_grad():
        for i, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                out.append(None)
                continue
            w = torch.randn(g.numel(), generator=torch.Generator().manual_seed(seed + i), dtype=DTYPE)
            flat = g.detach().reshape(-1).to(DTYPE)
            out.append([float(flat @ w), float(flat @ flat)])
    return out


def count_worker(part: dict, fn, *, counted: bool = False):
    """The student's step on the counted case (only where the launcher counts: `counted`; else False): its
    stage's gradients as a digest and, on the last stage, the loss it returned."""
    if not counted:
        return False
    stage = part["stage"]
    loss = step_on(fn, part, stage)
    loss = float(loss) if isinstance(loss, (int, float, torch.Tensor)) and not isinstance(loss, bool) \
        and torch.as_tensor(loss).numel() == 1 else None
    return {"grads": digest([q.grad for q in stage.module.parameters()], part["probe"]),
            "loss": loss if stage.is_last else None}


count_worker.counted_prelude = reference_one_f_one_b


def slack(one: int) -> int:
    """What the student's step may reach beyond the reference's: one micro-batch's activations (a forward's
    output held until its send completes, a gradient received early) and 8 MiB."""
    return one + 8 * 2 ** 20


def _reference(case: dict) -> tuple[float, list[list]]:
    """One process on the whole batch, one micro-batch at a time (their losses weighed by their share, equal
    here): the mean loss and each stage's gradients as digests."""
    model, m = case["model"], case["m"]
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for x, y in zip(case["xs"], case["ys"]):
        part = F.cross_entropy(model(x), y) / m
        part.backward()
        loss += part.item()
    stages = make_stage_modules(list(model.blocks), case["bounds"])
    return loss, [digest([q.grad for q in s.parameters()], case["probe"]) for s in stages]


def verify_count(name: str, case: dict, p: int, where: dict, res: list | None = None) -> str:
    """Rank 0's peak in the last `on_ranks(count_worker, ...)` against the reference's, and a line for `ok`;
    with `res` (the ranks' replies: the check always passes them) also the counted run's loss and gradients
    against one process on the whole batch and each rank's bytes sent (`wire_sent`, read by the launcher)."""
    peaks = counted_peaks(name, str(where))
    one, m = case["one"], case["m"]
    large = f"the large case (m = {m} micro-batches of {PER_MICRO} images, {one / 2 ** 20:.1f} MiB of activations " \
            f"each on the first stage)"
    if res is not None:
        _verify_result(name, case, every_rank(name, res, p, str(where)), large, where)
    ref, got = peaks[0]
    if got > ref + slack(one):
        raise AssertionError(f"{name}: on {large} rank 0's resident "
                             f"memory rose by {got / 2 ** 20:.0f} MiB during your step, as the kernel counts it "
                             f"outside your code, {(got - ref) / one:.1f} micro-batches' worth more than the course's "
                             f"1F1B ({ref / 2 ** 20:.0f} MiB; one micro-batch and 8 MiB more allowed): 1F1B keeps at "
                             f"most p = {p} micro-batches of activations alive on the first stage, in whatever form "
                             f"({where})")
    return f"rank 0 rose by {got / one:.1f} micro-batches' activations on the large case, the course's 1F1B by " \
           f"{ref / one:.1f}"


def _verify_result(name: str, case: dict, res: list[dict], large: str, where: dict) -> None:
    """The counted run did the step: the loss and every stage's gradients of one process, the messages sent."""
    loss, want = _reference(case)
    p = len(res)
    for r, got in enumerate(res):
        grads = got.get("grads")
        if not isinstance(grads, list) or len(grads) != len(want[r]):
            raise AssertionError(f"{name}: on {large} rank {r} returned no gradients of its stage: the large case is "
                                 f"checked like the small ones, whatever its size ({where})")
        for k, (g, w) in enumerate(zip(grads, want[r])):
            assert_close(name, f"gradient of parameter {k} of stage {r} on {large} (its projection on a random "
                               f"vector, its squared norm; one process on the whole batch as reference)", g, w,
                         where)
    assert_close(name, f"the loss returned by the last stage on {large}", res[-1].get("loss"), loss, where)
    sent = wire_sent()
    if sent is None:
        return
    for r in range(p):
        need = 2 * case["sends"][r]  # the reference's step, then the student's
        if sent[r] < WIRE_SHARE * need:
            raise AssertionError(f"{name}: on {large} rank {r}'s sockets sent {sent[r] / 2 ** 20:.1f} MiB, as the "
                                 f"kernel counts them outside your code, the course's 1F1B and your step together "
                                 f"send {need / 2 ** 20:.1f} MiB: every micro-batch's activation and gradient goes "
                                 f"between the stages ({where})")
