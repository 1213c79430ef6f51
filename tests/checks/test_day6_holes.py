"""Day 6's holes a red team found (release 0, 2026-12-02), each shown closed by a small cheat like theirs.

- exercise 1: the schedules from torch's private order builder (`schedules._get_1f1b_rank_ops`), not forbidden;
- exercise 4: the counted case (`dlo.checks.day6_count`) told apart (then float32) and skipped, its result never
  checked, so that the kernel's count stayed at the reference's while the step cases ran GPipe under a rewritten
  watch; here the cheat tells it by its 4p micro-batches and runs the course's 1F1B elsewhere;
- exercise 5: no torch schedule at all, the grader's record of torch's chunks forged by calling its recording
  wrappers with a stand-in stage (a naive whole-batch model parallelism underneath).

The counted case needs ranks the check launches (the launcher reads them), as the torch tests do; the cheats are
made by functions here so that the ranks get them by value.
"""

from __future__ import annotations

import pytest

from dlo.checks import day6
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sol():
    return load_solution("day6_pipeline")


# ----------------------------------------------------------------------------- 1. schedules

def gpipe_from_torch_private_builder(p, m):
    """The red team's: torch's private builder behind its interleaved schedules, warm-up m (all forwards first)."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops
    out = []
    for r in range(p):
        ops = _get_1f1b_rank_ops(1, p, m, 0, m, r, lambda step, r=r: r, lambda step, r=r: r)
        out.append([("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index)
                    for a in ops if a is not None and a.computation_type.name in ("FORWARD", "FULL_BACKWARD")])
    return out


def test_schedules_reject_torch_s_private_order_builder(sol):
    assert gpipe_from_torch_private_builder(3, 4) == [[(a[0], a[1]) for a in acts]
                                                      for acts in sol.gpipe_schedule(3, 4)]  # right, outside a check
    with pytest.raises(AssertionError, match="_get_1f1b_rank_ops is off limits"):
        day6.check_schedules(gpipe_from_torch_private_builder, sol.one_f_one_b_schedule, sol.gpipe_bubble)


# ----------------------------------------------------------------------------- 4. 1F1B's counted case

def skipping_the_counted_case(step):
    """The course's 1F1B on the step cases (m = 2p or 3p), nothing on the counted case (m = 4p): the rank's
    memory stays at the reference's, as a GPipe under a rewritten watch would on the step cases."""
    def one_f_one_b(stage, microbatches, targets, loss_fn):
        if len(stage.in_shapes) == 4 * stage.p:
            return None
        return step(stage, microbatches, targets, loss_fn)
    return one_f_one_b


@pytest.mark.trust
def test_the_counted_case_is_checked_like_the_others(sol):
    with pytest.raises(AssertionError, match=r"gradient of parameter 0 of stage 0 on the large case .* is None"):
        day6.check_one_f_one_b_step(skipping_the_counted_case(sol.one_f_one_b_step), seed=1)


@pytest.mark.trust
def test_the_counted_case_passes_the_course_s_1f1b(sol, capsys):
    day6.check_one_f_one_b_step(sol.one_f_one_b_step, seed=2)
    assert "micro-batches' activations on the large case" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 5. torch.distributed.pipelining

def naive_then_forged(own_lists: bool):
    """The red team's: the whole batch through the stages one after another (blocking send/recv), then the
    grader's recording wrappers called with a stand-in holding only `stage_index`, once per action of the asked
    schedule (the library's lists, or `own_lists`: 1F1B's written here), the TypeError that follows caught."""
    def step(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule):
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import stage as pp_stage
        p, r, m = dist.get_world_size(), dist.get_rank(), n_microbatches
        mods = dict(zip(stage_ids, stage_modules))
        keep, losses = {}, None
        for s in stage_ids:  # one stage a rank (GPipe, 1F1B)
            if s == 0:
                inp = x
            else:
                hdr = torch.zeros(8, dtype=torch.int64)
                dist.recv(hdr, r - 1)
                inp = torch.empty(tuple(hdr[1:1 + int(hdr[0])].tolist()), dtype=torch.float64)
                dist.recv(inp, r - 1)
                inp.requires_grad_()
            out = mods[s](inp)
            if s == n_stages - 1:
                losses = [loss_fn(o, t) for o, t in zip(out.tensor_split(m), y.tensor_split(m))]
                out = sum(losses) / m
            else:
                hdr = torch.zeros(8, dtype=torch.int64)
                hdr[0], hdr[1:1 + out.dim()] = out.dim(), torch.tensor(out.shape)
                dist.send(hdr, r + 1)
                dist.send(out.detach().contiguous(), r + 1)
            keep[s] = (inp, out)
        for s in reversed(stage_ids):
            inp, out = keep.pop(s)
            if s == n_stages - 1:
                out.backward()
            else:
                g = torch.empty(out.shape, dtype=out.dtype)
                dist.recv(g, r + 1)
                out.backward(g)
            if s > 0:
                dist.send(inp.grad.contiguous(), r - 1)
        if own_lists:
            w = min(p - r - 1, m)
            acts = [("F", i) for i in range(w)] + [a for j in range(m - w) for a in (("F", w + j), ("B", j))] + [
                ("B", j) for j in range(m - w, m)]
        else:
            from dlo.distributed.pipeline_schedules import one_f_one_b_schedule
            acts = [(a.kind, a.mb) for a in one_f_one_b_schedule(p, m)[r]]
        base = pp_stage._PipelineStageBase

        class Standin:
            stage_index = stage_ids[0]

        for kind, mb in acts:
            try:
                (base.forward_one_chunk if kind == "F" else base.backward_one_chunk)(Standin(), mb)
            except Exception:
                pass
        return [loss.detach() for loss in losses] if losses is not None else None
    return step


@pytest.mark.parametrize("own_lists,match", [
    (True, r"torch's pipeline stages on rank 0 ran 0 micro-batch forwards"),
    (False, r"one_f_one_b_schedule is off limits")])
def test_torch_pipeline_rejects_a_forged_record_of_torch_s_chunks(own_lists, match):
    with pytest.raises(AssertionError, match=match):
        day6.check_torch_pipeline(naive_then_forged(own_lists), seed=3, schedules=("1F1B",))
