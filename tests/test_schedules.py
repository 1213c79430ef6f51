"""dlo.schedules vs torch's own LR schedulers, step by step."""

import math

import pytest
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, OneCycleLR, SequentialLR

from dlo.schedules import lr_at_steps, one_cycle, torch_scheduler_lrs, warmup_cosine


@pytest.mark.parametrize("base_lr,warmup,total,min_lr,start_factor", [
    (0.1, 10, 100, 0.0, 0.01), (3e-3, 7, 53, 1e-4, 0.1), (1.0, 1, 9, 0.05, 0.5), (0.4, 0, 31, 0.0, 0.01)])
def test_warmup_cosine_matches_torch_sequential(base_lr, warmup, total, min_lr, start_factor):
    def make(opt):
        cosine = CosineAnnealingLR(opt, T_max=total - warmup, eta_min=min_lr)
        if warmup == 0:
            return cosine
        linear = LinearLR(opt, start_factor=start_factor, end_factor=1.0, total_iters=warmup)
        return SequentialLR(opt, [linear, cosine], milestones=[warmup])

    want = torch_scheduler_lrs(make, base_lr, total + 1)
    got = lr_at_steps(warmup_cosine, total + 1, base_lr=base_lr, warmup_steps=warmup, total_steps=total,
                      min_lr=min_lr, start_factor=start_factor)
    # torch updates the lr recursively (chainable form), which drifts by float rounding only.
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_warmup_cosine_endpoints_and_hold():
    kw = dict(base_lr=0.5, warmup_steps=4, total_steps=20, min_lr=0.01, start_factor=0.1)
    assert warmup_cosine(0, **kw) == pytest.approx(0.05)
    assert warmup_cosine(4, **kw) == pytest.approx(0.5)
    assert warmup_cosine(12, **kw) == pytest.approx(0.01 + 0.49 / 2)  # half way down the cosine
    assert warmup_cosine(20, **kw) == pytest.approx(0.01)
    assert warmup_cosine(500, **kw) == pytest.approx(0.01)  # held at min_lr, no restart


@pytest.mark.parametrize("max_lr,total,pct_start,div_factor,final_div_factor", [
    (0.1, 100, 0.3, 25.0, 1e4), (2e-3, 97, 0.25, 10.0, 100.0), (1.0, 41, 0.5, 5.0, 1e3), (0.3, 13, 0.2, 25.0, 1e4)])
def test_one_cycle_matches_torch(max_lr, total, pct_start, div_factor, final_div_factor):
    def make(opt):
        return OneCycleLR(opt, max_lr=max_lr, total_steps=total, pct_start=pct_start, anneal_strategy="cos",
                          div_factor=div_factor, final_div_factor=final_div_factor, three_phase=False,
                          cycle_momentum=False)

    want = torch_scheduler_lrs(make, max_lr, total)
    got = lr_at_steps(one_cycle, range(total), max_lr=max_lr, total_steps=total, pct_start=pct_start,
                      div_factor=div_factor, final_div_factor=final_div_factor)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    # The peak sits at the (possibly fractional) step pct_start * total - 1, so max_lr is reached only on a grid point.
    assert 0.95 * max_lr < max(got) <= max_lr * (1 + 1e-12)
    assert got[-1] == pytest.approx(max_lr / div_factor / final_div_factor)


def test_lr_at_steps_accepts_int_or_iterable():
    kw = dict(max_lr=1.0, total_steps=10)
    assert lr_at_steps(one_cycle, 3, **kw) == lr_at_steps(one_cycle, [0, 1, 2], **kw)
    assert all(isinstance(v, float) and math.isfinite(v) for v in lr_at_steps(one_cycle, 10, **kw))


def test_schedules_reject_bad_input():
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine(0, base_lr=0.1, warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="step"):
        warmup_cosine(-1, base_lr=0.1, warmup_steps=1, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        one_cycle(11, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match="pct_start"):
        one_cycle(0, max_lr=0.1, total_steps=3, pct_start=0.3)
