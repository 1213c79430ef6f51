"""Day 11's BO and PBT at toy sizes: BO reuses random search's first trials instead of running them again, PBT
costs the same steps as its members trained alone, a member never exploited ends exactly where its own training
ends, and the claims rows say so."""

from __future__ import annotations

from dataclasses import replace

import torch

from dlo import claims as C
from dlo.experiments import day11_adaptive, day11_claims, day11_search
from dlo.presets import DAY11
from dlo.tuning.search import random_search
from dlo.tuning.space import Space
from dlo.tuning.store import Study

TOY = replace(DAY11["tiny"], width=2, batch_size=16, n_search_train=64, n_search_test=32, trials=4, trial_steps=4,
              min_steps=1, eta=2, bayes_trials=4, bayes_init=2, pbt_population=4, pbt_interval=2)


def test_bo_and_pbt_against_random_search_trials_of_the_same_seed(tmp_path):
    torch.set_num_threads(1)
    TOY.validate()
    seeds = [0, 1, 2]
    found = {s: {"random": {"results": random_search(
        Study(tmp_path / f"random{s}", metric=day11_search.METRIC, durable=False), day11_search.trial_for(TOY, "", s),
        Space(day11_search.SPACE), TOY.trial_steps, TOY.trials, seed=s)}} for s in seeds}
    out = day11_adaptive.runs(TOY, "", found, seeds, tmp_path / "adaptive")
    for s in seeds:
        o = out[s]
        assert [r.trial for r in o["bayes"][:2]] == ["r0000", "r0001"] and len(o["bayes"]) == 4
        assert o["steps"] == {"bayes": 2 * TOY.trial_steps, "pbt": 4 * TOY.trial_steps}
        assert o["never exploited"], "some member is never in the bottom quarter"
        for pbt_result, alone in o["never exploited"]:
            assert pbt_result.config == alone.config and pbt_result.value == alone.value
    rows = {c.claim: c for c in day11_claims.adaptive_claims(TOY, out)}
    exactly = next(c for name, c in rows.items() if "never exploited" in name)
    assert exactly.verdict == C.AGREES and exactly.measured.value == 0.0
    assert all(c.measured is None or c.measured.n in (1, 3) for c in rows.values())
    assert len(day11_adaptive.summary_rows(TOY, out)) == 3
