"""The kernel's count of a ZeRO-2 rank's memory during backward (Day 5), read outside the rank.

The worker's meters (`dlo.measure.held_bytes`, `live_bytes`) count tensors, in the rank's own process: an
engine that keeps every full gradient as something else (bytes, a NumPy array, native memory) or finds the
meters and changes what they report passes them. Here the process that launched the ranks reads each
rank's memory from /proc (`dlo.checks.rank_count`), on a case large enough that the
gradient dominates the rank (`count_part`: 4.1 million float64 parameters, 31-32 MiB of gradient, no tensor
over 2.1 MiB, so that a correct ZeRO-2 holds little beyond the parameters, its shard and its buckets).

Each rank first runs the course's ZeRO-2 (`reference_backward`: trusted code, before any student object
exists) through build, forward and backward, lets it go and marks; then the student's engine does the
same (`count_worker`). Both are measured from the rank's memory at the mark, after the reference let go
(what the first backward of a rank leaves for good, 0.6-0.7 x the gradient, is in that baseline for both):
the reference's peak (the high water mark at the mark) and the student's (the highest one read after it).
The student's may exceed the reference's by `slack`, a quarter of the full gradient and two buckets (0.5 x
the gradient here). Measured (2026-12-01, 2 ranks, seeds 0-2, float64, 4 MiB buckets): the reference
1.86-1.96 x the gradient, the solution's engine 1.88-1.98 (within 0.03 of the reference on the same rank), an
engine that also keeps every full gradient as bytes until the step 2.87-3.04, one keeping half of them
2.41-2.49. The count costs a launch of the ranks: 0.9 s a check on 2 cores.

The count backs a memory rule only if the counted run does the work: an engine that recognised the counted case
(its size, its optimizer) and there dropped every gradient passed it (a red team's, 2026-12-02; elsewhere it kept
the whole gradient in NumPy). So the counted case is checked like the others (`verify_count`): each rank gets its
own sequence (never another rank's, the seed nor the global batch), the course's SGD step follows the backward, at
a learning rate drawn as the check's own cases draw theirs, and each rank's parameters after it are compared here
with one process on the whole batch; the reduce-scatters launched in that backward's own graph task must carry the
whole gradient, asynchronously, several buckets of it.
"""

from __future__ import annotations

import gc
import random

import torch

from dlo.checks.day5_zero import BYTES_TOL, TiedLM, lm_loss
from dlo.checks.rank_count import counted_peaks, every_rank
from dlo.grading.compare import DTYPE, assert_close
from dlo.measure import CommCounter
from dlo.measure.comm import graph_task

CAP_MB = 4.0  # the buckets of both engines: a sixteenth of the gradient
TOKENS = 8  # one sequence per rank


def count_part(seed: int, world_size: int) -> dict:
    """The counted case: odd sizes drawn from the seed (Psi = 4.1-4.2 million), an SGD learning rate drawn as
    `day5_zero.case` draws its own, one sequence of 8 tokens per rank. `parts`: what each rank is given (the sizes,
    the learning rate, a seed for the initial weights drawn from the case's, its own sequence)."""
    rng = random.Random(seed)
    sizes = {"vocab": rng.choice([59, 61]), "dim": rng.choice([249, 251, 253]), "hidden": rng.choice([1019, 1021]),
             "n_blocks": 8}
    lr, init, probe = rng.uniform(0.2, 0.5), rng.getrandbits(62), rng.getrandbits(40)
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    x, y = (torch.randint(0, sizes["vocab"], (world_size, TOKENS), generator=g) for _ in range(2))
    parts = [{"sizes": sizes, "init": init, "lr": lr, "probe": probe, "x": x[r:r + 1].clone(), "y": y[r:r + 1].clone()}
             for r in range(world_size)]
    return {"parts": parts, "x": x, "y": y}


def counted_model(part: dict) -> TiedLM:
    torch.manual_seed(part["init"])
    s = part["sizes"]
    return TiedLM(s["vocab"], s["dim"], s["hidden"], s["n_blocks"]).to(DTYPE)


def reference_backward(part: dict) -> bool:
    """On each rank, before the student's objects exist (`dlo.grading.ranks.run_on_rank`): the course's ZeRO-2
    on the counted case, through build, forward, backward and the step; then let go of, so that the rank's
    resident memory falls back (`steady_malloc` is set) and the student's engine starts from where the reference
    did."""
    from dlo.distributed.zero import ZeRO2

    engine = ZeRO2(counted_model(part), torch.optim.SGD, bucket_cap_mb=CAP_MB, lr=part["lr"])
    lm_loss(engine, part["x"], part["y"]).backward()
    engine.step()
    del engine
    gc.collect()
    return True


def count_worker(part: dict, cls, *, counted: bool = False):
    """The student's ZeRO-2 on the counted case, as the reference ran it (only where the launcher counts:
    `counted`; else False): its collectives (and the graph task of the step's backward) and the model's
    parameters after the step, as they are (a copy would count against the rank)."""
    if not counted:
        return False
    model = counted_model(part)
    with CommCounter() as comm:
        comm.phase = "init"
        engine = cls(model, torch.optim.SGD, bucket_cap_mb=CAP_MB, lr=part["lr"])
        comm.phase = "forward"
        loss, task = lm_loss(engine, part["x"], part["y"]), []
        loss.grad_fn.register_prehook(lambda _: task.append(graph_task()))  # this backward's, at its start
        comm.phase = "backward"
        loss.backward()
        comm.phase = "step"
        engine.step()
    return {"params": digest(model, part["probe"]), "comm": comm.records(),
            "backward_task": task[0] if len(task) == 1 else None}


def digest(model, seed: int) -> dict:
    """{name: [w . p, p . p]} for each parameter p, w drawn from `seed` (one tensor's worth at a time): what a rank
    returns of its parameters. The rank's memory is read until its reply has gone, and 32 MiB of parameters sent
    back raised it by 400 MiB; a value the engine got wrong moves w . p (w is Gaussian)."""
    out = {}
    with torch.no_grad():
        for i, (k, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed + i)
            w = torch.randn(p.numel(), generator=g, dtype=DTYPE)
            flat = p.detach().reshape(-1).to(DTYPE)
            out[k] = [float(flat @ w), float(flat @ flat)]
    return out


count_worker.counted_prelude = reference_backward


def slack(psi: int) -> int:
    """What the student's engine may reach beyond the reference's: a quarter of the full gradient (autograd's
    gradients and a bucket's copies held a moment longer, in another order) and two buckets."""
    return 8 * psi // 4 + 2 * round(CAP_MB * 2 ** 20)


def verify_count(name: str, case: dict, res, world_size: int, where: str) -> str:
    """The ranks' peaks in the last `on_ranks(count_worker, ...)` against the reference's (`rank_count`), their
    reduce-scatters during backward and their parameters after the step (`digest`) against one process on the
    whole batch (`res`: the ranks' replies); a line for the check's `ok`."""
    every_rank(name, res, world_size, where)
    peaks = counted_peaks(name, where)
    part = case["parts"][0]
    model = counted_model(part)
    psi = sum(p.numel() for p in model.parameters())
    full, allowed = 8 * psi, slack(psi)
    large = f"the large case (Psi = {psi:,}, a full gradient of {full / 2 ** 20:.0f} MiB)"
    for r, (ref, got) in enumerate(peaks):
        if got > ref + allowed:
            raise AssertionError(f"{name}: during backward on {large} rank {r}'s resident memory rose by "
                                 f"{got / 2 ** 20:.0f} MiB, as the kernel counts it outside your code; the course's "
                                 f"ZeRO-2 rose by {ref / 2 ** 20:.0f} MiB on the same case ({allowed / 2 ** 20:.0f} "
                                 f"MiB more allowed): a rank keeps its 1/N gradient shard and the buckets in flight, "
                                 f"in whatever form - reduce-scatter each bucket as it fills and keep no full "
                                 f"gradient ({where})")
    for r, got in enumerate(res):
        _reduced_in_backward(name, r, got, psi, large, where)
    init = digest(model, part["probe"])
    lm_loss(model, case["x"], case["y"]).backward()
    torch.optim.SGD(model.parameters(), lr=part["lr"]).step()
    want = digest(model, part["probe"])
    for r, got in enumerate(res):
        params = got.get("params") if isinstance(got.get("params"), dict) else {}
        for key, w in want.items():
            mine = params.get(key)
            if mine == init[key]:
                raise AssertionError(f"{name}: after one SGD step on {large} parameter {key} on rank {r} did not "
                                     f"move: the gradients never reached the optimizer. The large case is checked "
                                     f"like the small ones: every gradient is reduce-scattered, whatever the model's "
                                     f"size ({where})")
            assert_close(name, f"parameter {key} after one SGD step on {large} (its projection on a random "
                               f"vector, its squared norm)", mine, w, f"{where}, rank {r}")
    ref, got = peaks[0]
    return (f"rank 0 rose by {got / full:.2f} x the gradient during backward on the large case, the course's "
            f"ZeRO-2 by {ref / full:.2f}")


def _reduced_in_backward(name: str, r: int, got: dict, psi: int, large: str, where: str) -> None:
    """The counted run's reduce-scatters launched in the step's own backward pass (its graph task, not a phase
    label): asynchronous, several buckets, the whole gradient (each bucket padded by N - 1 elements at most)."""
    task = got.get("backward_task")
    comm = got.get("comm") if isinstance(got.get("comm"), list) else []
    rs = [x for x in comm if isinstance(x, dict) and x.get("kind") == "reduce_scatter" and task is not None
          and x.get("graph_task") == task]
    reduced = sum(x["bytes"] for x in rs)
    if len(rs) < 2 or not all(x["async"] for x in rs) or abs(reduced - 8 * psi) > BYTES_TOL * 8 * psi:
        raise AssertionError(f"{name}: during backward on {large} rank {r} launched {len(rs)} reduce-scatter(s) "
                             f"carrying {reduced / (8 * psi):.3f} Psi (async: {[x['async'] for x in rs]}); expected "
                             f"one per {CAP_MB:g} MiB bucket, each launched with async_op=True from a gradient hook as "
                             f"the bucket fills, the whole gradient in all ({where})")
