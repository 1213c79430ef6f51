"""A red team on Day 11's checks (2026-12-03, four holes, 9 of 11 points with release 0): each cheat now fails,
in the notebook's own check and sandboxed as `dlo grade` runs it, and the solution still passes (the day's own test
file). The promotion called the check module's slip table, reached through the runner's frames; the freeze did
nothing and rewrote its worker's reply on the wire; the sampler refused every call after the good specs' last one;
the early stop let torch's ReduceLROnPlateau count the evaluations without improvement."""

from __future__ import annotations

import math

import pytest
import torch

import dlo.checks.day11_transfer as day11_transfer
from dlo.checks import day11
from dlo.grading.forbid import ForbiddenCall
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell


@pytest.fixture(scope="module")
def solution():
    return load_solution("day11_learning_faster")


# ----------------------------------------------------------------------------- A. promotion: the checks' helpers

PROMOTE_BY_SLIPS = '''
import dlo.checks.day11 as checks

def promote(results, rung, eta, promoted, mode="min"):
    """The slip "promoted a trial already promoted" is the right ranking with the promoted ids still in."""
    slips = checks._slips(results, rung, eta, set(promoted), mode)
    key = next(k for k in slips if k.startswith("promoted a trial already promoted"))
    return [t for t in slips[key][0] if t not in promoted]

def promote_by_reference(results, rung, eta, promoted, mode="min"):
    return checks._reference_promote(results, rung, eta, promoted, mode)
'''

PROMOTE_THROUGH_FRAMES = '''
def promote(results, rung, eta, promoted, mode="min"):
    """The red team's: the real checks module from the session's sealing, reached through the frames."""
    import sys
    f, real = sys._getframe(1), None
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and hasattr(s, "sealing"):
            real = s.sealing.real
            break
        f = f.f_back
    m = real["dlo.checks.day11"] if real is not None else sys.modules["dlo.checks.day11"]
    slips = m._slips(results, rung, eta, set(promoted), mode)
    key = next(k for k in slips if k.startswith("promoted a trial already promoted"))
    return [t for t in slips[key][0] if t not in promoted]
'''


@pytest.mark.parametrize("fn,helper", [("promote", "_slips"), ("promote_by_reference", "_reference_promote")])
def test_promote_by_the_checks_helpers_is_refused(fn, helper):
    cheat = getattr(student_cell(PROMOTE_BY_SLIPS, "day11_promote_slips"), fn)
    assert f"dlo.checks.day11.{helper}" in day11.check_promote.forbid
    day11.check_promote.__wrapped__(cheat)   # unguarded, the helper ranks the rung: full marks
    with pytest.raises(ForbiddenCall, match=rf"dlo\.checks\.day11\.{helper} is off limits"):
        day11.check_promote(cheat)


def test_promote_through_the_frames_is_refused_sandboxed(sandbox):
    cheat = student_cell(PROMOTE_THROUGH_FRAMES, "day11_promote_frames").promote
    with pytest.raises(AssertionError, match=r"dlo\.checks\.day11\._slips is off limits"):
        sandbox.run(day11.check_promote, cheat, seed=0)


def test_the_answer_helpers_of_day_11_are_off_limits():
    """Every helper of the Day 11 checks that computes an answer from a case's inputs (or one step from it), none
    of which a worker on the student's side needs."""
    assert {"dlo.checks.day11._slips", "dlo.checks.day11._reference_promote"} <= set(day11.check_promote.forbid)
    assert {"dlo.checks.day11_early._rule", "dlo.checks.day11_early._reference"} <= set(day11.check_early_stop.forbid)
    assert "dlo.checks.day11_space._space_slips" in day11.check_sample_config.forbid


# ----------------------------------------------------------------------------- B. freeze: the reply forged

FREEZE_FORGE = '''
def freeze(module, _state={}):
    """The red team's: freezes nothing; rewrites the worker's reply on its way out so that it looks frozen."""
    import sys
    from torch import nn
    _state["bns"] = {"0." + n if n else "0" for n, m in module.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if "orig" not in _state:
        wire = sys.modules["dlo.grading.wire"]
        orig = _state["orig"] = wire.encode

        def encode(msg, *a, **k):
            v = msg.get("value") if isinstance(msg, dict) else None
            if isinstance(v, dict) and {"before", "after", "grad", "modes"} <= set(v):
                for key in v["grad"]:
                    if key.startswith("0."):
                        v["grad"][key] = False
                for key in v["before"]:
                    if key.startswith("0."):
                        v["after"][key] = v["before"][key]
                for n in v["modes"]:
                    if n in _state["bns"]:
                        v["modes"][n] = False
            return orig(msg, *a, **k)
        wire.encode = encode
    return sum(p.numel() for p in module.parameters())
'''

FREEZE_STILL = '''
def freeze(module, _state={}):
    """Freezes nothing; whatever the reply says of tensors that moved or kept still in this process, says none
    moved (the flags and modes as the call left them: all trainable, all in train mode)."""
    import sys
    if "orig" not in _state:
        wire = sys.modules["dlo.grading.wire"]
        orig = _state["orig"] = wire.encode

        def encode(msg, *a, **k):
            v = msg.get("value") if isinstance(msg, dict) else None
            if isinstance(v, dict) and "grad" in v:
                if "before" in v and "after" in v:
                    v["after"] = dict(v["before"])
                if "stilled" in v:
                    v["stilled"] = sorted(v["grad"])
            return orig(msg, *a, **k)
        wire.encode = encode
    return sum(p.numel() for p in module.parameters())
'''


@pytest.mark.parametrize("source,match", [
    (FREEZE_FORGE, "frozen parameters still updated by the optimizer"),
    (FREEZE_STILL, "BatchNorm statistics still moving|still has requires_grad=True")])
def test_freeze_whose_reply_is_rewritten_on_the_wire_fails_sandboxed(sandbox, source, match):
    """What moved is trained on the check's side, on its own copy with the flags and modes the call left: the red
    team's forgery (tensors after = before, flags and BatchNorm modes rewritten) had full marks at every seed."""
    cheat = student_cell(source, "day11_freeze_forge").freeze
    with pytest.raises(AssertionError, match=match):
        sandbox.run(day11.check_freeze, cheat, seed=0)


def test_freeze_motion_is_not_read_from_the_reply(solution, monkeypatch):
    """A freeze that puts the BatchNorm layers in eval mode and leaves every flag, whose reply says every parameter
    kept still where it ran: the check's own training moves them."""
    real = day11_transfer.run_student

    def forged(*args):
        got = real(*args)
        return {**got, "stilled": sorted(got["grad"])}

    monkeypatch.setattr(day11_transfer, "run_student", forged)

    def freeze_nothing(module):
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
        return sum(p.numel() for p in module.parameters())

    with pytest.raises(AssertionError, match="still has requires_grad=True"):
        day11.check_freeze(freeze_nothing, seed=0)


@pytest.mark.parametrize("how,match", [
    (lambda got: {**got, "grad": {k: "no" if k.startswith("0.") else v for k, v in got["grad"].items()}},
     "not a bool"),
    (lambda got: {**got, "modes": {k: 0 for k in got["modes"]}}, "not a bool"),
    (lambda got: {k: v for k, v in got.items() if k != "stilled"}, "no record of the model"),
    (lambda got: None, "no record of the model")])
def test_freeze_reply_malformed_fails(solution, monkeypatch, how, match):
    real = day11_transfer.run_student
    monkeypatch.setattr(day11_transfer, "run_student", lambda *a: how(real(*a)))
    with pytest.raises(AssertionError, match=match):
        day11.check_freeze(solution.freeze, seed=0)


def test_freeze_two_flags_for_one_tensor_fail():
    """The case's two BatchNorms share one weight: a reply cannot give it two flags."""
    import random

    model = day11_transfer._model(random.Random(0), 0)
    norms = [m for m in model[0].modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    norms[1].weight = norms[0].weight
    params = day11_transfer._tensors(model, ("_parameters",))
    shared = [k for k, p in params.items() if p is norms[0].weight]
    assert len(shared) == 2
    grad = {k: k != shared[1] for k in params}
    modes = {n: m.training for n, m in model.named_modules()}
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, model[1].out_features, (6,))
    with pytest.raises(AssertionError, match="two requires_grad flags for one tensor"):
        day11_transfer._trained(model, grad, modes, x, y, 0)


def test_freeze_solution_passes_sandboxed(sandbox, solution, capsys):
    sandbox.run(day11.check_freeze, solution.freeze, seed=4)
    assert ": ok (" in capsys.readouterr().out


# ----------------------------------------------------------------------------- C. sample_config: the calls' order

SAMPLE_BY_PHASE = '''
import math
import numpy as np

def _draw(space, seed, i):
    rng, out = np.random.default_rng([seed, i]), {}
    for name, spec in space.items():
        (kind, v), = spec.items()
        if kind == "choice":
            out[name] = v[rng.integers(len(v))]
        elif kind == "int":
            out[name] = int(rng.integers(v[0], v[1] + 1))
        elif kind == "log_uniform":
            out[name] = float(math.exp(math.log(v[0]) + rng.random() * (math.log(v[1]) - math.log(v[0]))))
        else:
            out[name] = float(v[0] + rng.random() * (v[1] - v[0]))
    return out

def sample_by_phase(space, seed, i, _s={"last": None, "bad": False}):
    """The red team's: a new (seed, i) with i != 0 right after an i > 50 is a bad spec, and every call after it."""
    key = (seed, i)
    if _s["bad"] or (key != _s["last"] and _s["last"] is not None and _s["last"][1] > 50 and i != 0):
        _s["bad"] = True
        raise ValueError("bad search space")
    _s["last"] = key
    return _draw(space, seed, i)

def sample_new_spec_not_at_zero(space, seed, i, _seen=[]):
    """A spec never seen before, called at i != 0, is a bad one (every good spec's first call was at i = 0)."""
    key = repr(space)
    if key not in _seen and i != 0:
        raise ValueError("bad search space")
    _seen.append(key)
    return _draw(space, seed, i)

def sample_after_the_good_ones(space, seed, i, _seen=[]):
    """The bad specs come once the six good spaces were seen, each at three i: refuse after eighteen."""
    if (repr(space), seed, i) not in _seen:
        _seen.append((repr(space), seed, i))
    if len(_seen) > 18:
        raise ValueError("bad search space")
    return _draw(space, seed, i)
'''


@pytest.mark.parametrize("fn", ["sample_by_phase", "sample_new_spec_not_at_zero", "sample_after_the_good_ones"])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_sample_config_by_the_order_of_calls_fails(fn, seed):
    """The bad specs were all called after the last good call, and each good spec's i rose in fixed bands (0, then
    1-50, then 51-5000): a function that kept state refused the bad ones unvalidated. Each cheat is a fresh cell
    (its state starts empty), as in a notebook graded once."""
    cheat = getattr(student_cell(SAMPLE_BY_PHASE, f"day11_sample_{fn}"), fn)
    with pytest.raises(AssertionError, match="must raise ValueError|for a valid spec"):
        day11.check_sample_config(cheat, seed=seed)


def test_sample_config_bad_calls_look_like_good_ones():
    """Across seeds the bad specs come at any place (not only last), a good spec's first call at any of its three
    i, and the bad ones' i in every band."""
    import random

    from dlo.checks.day11_space import _calls

    first_bad, first_i, bad_i = [], set(), set()
    for seed in range(20):
        calls = _calls(random.Random(seed), 6)
        kinds = [c[0] for c in calls]
        first_bad.append(kinds.index("bad"))
        assert kinds.count("good") == 18 and kinds.count("bad") == 10
        seen = set()
        for c in calls:
            if c[0] == "good" and repr(c[1]) not in seen:
                seen.add(repr(c[1]))
                first_i.add(0 if c[3] == 0 else 1 if c[3] <= 50 else 2)
            elif c[0] == "bad":
                bad_i.add(0 if c[4] == 0 else 1 if c[4] <= 50 else 2)
        last_good = max(k for k, c in enumerate(kinds) if c == "good")
        assert any(k < last_good for k, c in enumerate(kinds) if c == "bad")
    assert min(first_bad) < 5 and first_i == {0, 1, 2} and bad_i == {0, 1, 2}


def test_sample_config_solution_passes_sandboxed(sandbox, solution, capsys):
    sandbox.run(day11.check_sample_config, solution.sample_config, seed=5)
    assert ": ok (" in capsys.readouterr().out


# ----------------------------------------------------------------------------- D. early stop: torch's plateau count

def early_by_plateau(history, patience, min_delta=0.0, mode="min"):
    """The red team's: ReduceLROnPlateau's lr drops where the rule stops."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode, factor=0.5, patience=patience - 1,
                                                       threshold=min_delta, threshold_mode="abs", cooldown=0)
    best_epoch = None
    for epoch, m in enumerate(history):
        if not math.isfinite(m):
            return True, best_epoch
        lr0 = opt.param_groups[0]["lr"]
        sched.step(m)
        if opt.param_groups[0]["lr"] < lr0:
            return True, best_epoch
        if sched.num_bad_epochs == 0:
            best_epoch = epoch
    return False, best_epoch


_IS_BETTER = torch.optim.lr_scheduler.ReduceLROnPlateau._is_better   # taken before the check, as a notebook may


def early_by_is_better(history, patience, min_delta=0.0, mode="min"):
    """Its comparison alone (`_is_better`, held since before the check), on an object of the student's."""
    class Rule:
        threshold_mode, threshold = "abs", min_delta

    rule = Rule()
    rule.mode = mode
    best, best_epoch, bad = math.inf if mode == "min" else -math.inf, None, 0
    for epoch, m in enumerate(history):
        if not math.isfinite(m):
            return True, best_epoch
        if _IS_BETTER(rule, m, best):
            best, best_epoch, bad = m, epoch, 0
        else:
            bad += 1
        if bad >= patience:
            return True, best_epoch
    return False, best_epoch


@pytest.mark.parametrize("cheat,name", [(early_by_plateau, "ReduceLROnPlateau"),
                                        (early_by_is_better, "ReduceLROnPlateau._is_better")])
def test_early_stop_by_reduce_lr_on_plateau_is_refused(cheat, name):
    day11.check_early_stop.__wrapped__(cheat)   # unguarded: full marks
    with pytest.raises(ForbiddenCall, match=rf"torch\.optim\.lr_scheduler\.{name}\S* is off limits"):
        day11.check_early_stop(cheat)


def test_early_stop_by_reduce_lr_on_plateau_is_refused_sandboxed(sandbox):
    with pytest.raises(AssertionError, match=r"ReduceLROnPlateau\S* is off limits"):
        sandbox.run(day11.check_early_stop, early_by_plateau, seed=0)
