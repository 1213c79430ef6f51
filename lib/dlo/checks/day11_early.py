"""Day 11's early-stopping check: the patience rule and the best epoch, against `dlo.tuning.early.EarlyStopping`
stepped through the same validation history (its checkpoints written to a temporary folder, then removed)."""

from __future__ import annotations

import math
import random
import tempfile

from torch import nn

from dlo.grading.api import case_seed, check
from dlo.grading.compare import ok
from dlo.tuning.early import EarlyStopping

# torch's ReduceLROnPlateau counts the evaluations without improvement (patience - 1, threshold=min_delta,
# threshold_mode="abs": its lr drops where the rule stops; a red team, 2026-12-03); its methods go with the class
EARLY = ("dlo.tuning.early.*", "torch.optim.lr_scheduler.ReduceLROnPlateau")


def _reference(history: list[float], patience: int, min_delta: float, mode: str) -> tuple[bool, int | None]:
    model = nn.Linear(1, 1)
    with tempfile.TemporaryDirectory() as folder:
        stopper = EarlyStopping(folder, patience=patience, min_delta=min_delta, mode=mode)
        for epoch, metric in enumerate(history):
            if stopper.step(epoch, metric, model):
                return True, stopper.best_epoch
        return False, stopper.best_epoch


def _rule(history, patience, min_delta, mode, *, strict=True, delta=True, off_by_one=False, last=False,
          whole=False, nan=True, use_mode=True, argbest=False) -> tuple[bool, int | None]:
    """The patience rule with one slip switched on (the reference's rule with every switch at its default)."""
    sign = -1.0 if mode == "max" and use_mode else 1.0
    best, best_epoch, bad, stopped = math.inf, None, 0, False
    seen, seen_epoch = math.inf, None   # argbest: the epoch of the best value seen, improvement or not
    for epoch, metric in enumerate(history):
        if argbest and math.isfinite(metric) and sign * metric < seen:
            seen, seen_epoch = sign * metric, epoch
        if nan and not math.isfinite(metric):
            bad = patience
        elif (sign * metric < best - (min_delta if delta else 0.0)) if strict else (sign * metric <= best - min_delta):
            best, best_epoch, bad = sign * metric, epoch, 0
        else:
            bad += 1
        if (bad > patience) if off_by_one else (bad >= patience):
            stopped = True
            if not whole:
                return True, epoch if last else seen_epoch if argbest else best_epoch
    return stopped, (len(history) - 1 if last and history else seen_epoch if argbest else best_epoch)


SLIPS = {"stopped one evaluation late: stop when `patience` evaluations in a row did not improve, not patience + 1":
         {"off_by_one": True},
         "counted an equal value as an improvement: it must be better by more than min_delta (strictly)":
         {"strict": False},
         "ignored min_delta: an improvement is a value better than the best by more than min_delta": {"delta": False},
         "returned the last epoch: return the epoch of the best value, whose weights are the ones kept": {"last": True},
         "kept going after the stop: the first epoch at which the rule says stop ends it; later values are never "
         "seen": {"whole": True},
         "a nan or inf metric must stop training at once (a diverged run does not come back)": {"nan": False},
         "ignored `mode`: in 'max' mode the highest value is the best": {"use_mode": False},
         "moved best_epoch to a value better by no more than min_delta: only an improvement (better than best by "
         "more than min_delta) moves best and best_epoch": {"argbest": True}}


def _history(rng: random.Random, t: int) -> tuple[list[float], int, float, str]:
    mode = ("min", "max")[t % 2]
    # multiples of 1/32: every difference and sum is exact in binary, so a value better by exactly min_delta is
    # a tie whichever way it is written (m < best - min_delta, best - m > min_delta); with 2 decimals, 0.71 - 0.7
    # > 0.01 and 0.7 < 0.71 - 0.01 disagreed, and an honest `best - m > min_delta` failed 3 seeds in 10 (2026-11-30)
    patience, min_delta = rng.choice([1, 2, 3, 4]), rng.choice([0.0, 0.0, 0.03125, 0.0625])
    value, out = 1.0, []
    for _ in range(rng.randint(4, 14)):
        step = rng.choice([-0.25, -0.125, -0.0625, -0.03125, 0.0, 0.0, 0.0625, 0.125])  # mostly falling, plateaus
        value += step
        out.append(value if mode == "min" else -value)
    if t == 4:       # no evaluation yet: nothing stopped, no best epoch
        return [], patience, min_delta, mode
    if t == 2:       # a value better than the best by no more than min_delta, then a plateau until the stop
        min_delta, steps = 0.125, rng.randint(1, 4)
        out = [1.0 - 0.25 * k for k in range(steps)]
        out += [out[-1] - 0.0625] + [out[-1] + 0.125] * patience
    if t % 4 == 3 or t in (6, 10):   # diverged early: nan or inf before patience could stop it, in both modes
        # (non-finite values only in "max" let a red team ignore them in "min", 2026-12-01): case 3 (max) a nan
        # first, no best epoch; 7 (max) and 10 (min) the inf that, taken for a value, would be the best one; 6 (min)
        # a nan or the other inf; 11 (max) any of the three
        better = math.inf if mode == "max" else -math.inf
        out[0 if t == 3 else rng.randrange(3)] = (math.nan if t == 3 else better if t in (7, 10) else
                                                  rng.choice([math.nan, -better]) if t == 6 else
                                                  rng.choice([math.nan, math.inf, -math.inf]))
        patience = max(patience, 2)
    return out, patience, min_delta, mode


# _rule with every switch at its default is the exercise's rule, and every checks module is loaded where the
# student's code runs (the runner imports dlo.checks; reachable through gc): off limits there
# (_reference is dlo's EarlyStopping stepped through the history: the answer)
@check(forbid=EARLY + ("dlo.checks.day11_early._rule", "dlo.checks.day11_early._reference"),
       hint="count the evaluations without improvement yourself")
def check_early_stop(early_stop_fn, seed: int = 0, trials: int = 12) -> None:
    """`early_stop_fn(history, patience, min_delta, mode) -> (stop, best_epoch)` against dlo's EarlyStopping."""
    name, rng = "early_stop", random.Random(case_seed(seed))
    for t in range(trials):
        history, patience, min_delta, mode = _history(rng, t)
        case = f"history={history}, patience={patience}, min_delta={min_delta}, mode={mode!r}"
        got = early_stop_fn(list(history), patience, min_delta, mode)
        want = _reference(history, patience, min_delta, mode)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"{name}: return a pair (stop, best_epoch), got {got!r} ({case})")
        got = (bool(got[0]), None if got[1] is None else int(got[1]))
        if got == want:
            continue
        # every slip that gives this answer is named: on a short history two slips can agree
        named = [m for m, switches in SLIPS.items() if got == _rule(history, patience, min_delta, mode, **switches)]
        if want[1] is None and got[1] is not None:   # also where a slip gives the same answer (a nan first)
            named.append("best_epoch is None while no finite value was seen (an empty history, or a nan or inf first)")
        if named:
            raise AssertionError(f"{name}: {'; or: '.join(named)} ({case}): expected {want}, got {got}")
        raise AssertionError(f"{name}: expected (stop, best_epoch) = {want}, got {got} ({case})")
    ok(name, f"{trials} histories, min and max, min_delta, ties, nan")
