"""The Day 11 checks accept correct solutions and reject stubs, plausible mistakes (each named by its message)
and the library's own references (off limits while a check runs).

The correct versions below are written out as a student writes them; each wrong version is one of them with one
slip, so it fails for its own reason, not for calling a forbidden reference."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from dlo.checks import day11
from dlo.grading.forbid import ForbiddenCall
from dlo.tuning import early, space, transfer
from tests.checks import cases


def stub(*args, **kwargs):
    raise NotImplementedError()


# ----------------------------------------------------------------------------- exercise 1: promotion

def _promote(results, rung, eta, promoted, mode="min", *, pool=False, worst=False, count=None, skip=True,
             ignore_mode=False, filter_first=False):
    sign = 1.0 if mode == "min" or ignore_mode else -1.0
    here = [r for r in results if pool or r["steps"] == rung]
    if filter_first:
        here = [r for r in here if r["trial"] not in promoted]
    ranked = sorted(here, key=lambda r: ((-sign if worst else sign) * r["value"], r["trial"]))
    n = (count or (lambda n: n // eta))(len(here))
    return [r["trial"] for r in ranked[:n] if not skip or r["trial"] not in promoted]


def promote_ok(results, rung, eta, promoted, mode="min"):
    return _promote(results, rung, eta, promoted, mode)


def promote_every_rung(results, rung, eta, promoted, mode="min"):  # ranks the results of all rungs together
    return _promote(results, rung, eta, promoted, mode, pool=True)


def promote_worst(results, rung, eta, promoted, mode="min"):
    return _promote(results, rung, eta, promoted, mode, worst=True)


def promote_ceil(results, rung, eta, promoted, mode="min"):
    return _promote(results, rung, eta, promoted, mode, count=lambda n: math.ceil(n / eta))


def promote_twice(results, rung, eta, promoted, mode="min"):
    return _promote(results, rung, eta, promoted, mode, skip=False)


def promote_ignores_mode(results, rung, eta, promoted, mode="min"):
    return _promote(results, rung, eta, promoted, mode, ignore_mode=True)


def promote_filter_first(results, rung, eta, promoted, mode="min"):  # the top of the not-yet-promoted
    return _promote(results, rung, eta, promoted, mode, filter_first=True, skip=False)


def promote_from_results(results, rung, eta, promoted, mode="min"):  # promoted = a result above the rung (not a
    above = {r["trial"] for r in results if r["steps"] > rung}          # trial still running at the next rung)
    return [t for t in _promote(results, rung, eta, promoted, mode, skip=False) if t not in above]


def promote_unbroken_ties(results, rung, eta, promoted, mode="min"):  # ties left in the order of `results`
    sign = 1.0 if mode == "min" else -1.0
    here = sorted((r for r in results if r["steps"] == rung), key=lambda r: sign * r["value"])
    return [r["trial"] for r in here[:len(here) // eta] if r["trial"] not in promoted]


def promote_reversed_for_max(results, rung, eta, promoted, mode="min"):  # reverse=True: ties by the larger id
    here = sorted((r for r in results if r["steps"] == rung), key=lambda r: (r["value"], r["trial"]),
                  reverse=mode == "max")
    return [r["trial"] for r in here[:len(here) // eta] if r["trial"] not in promoted]


# ----------------------------------------------------------------------------- exercise 2: sampling a space

def _sample(space, seed, i, *, log_uniform=True, int_high=1, rng=None):
    for name, spec in space.items():
        kind, values = next(iter(spec.items())) if isinstance(spec, dict) and len(spec) == 1 else (None, None)
        if kind not in ("choice", "uniform", "log_uniform", "int") or not values:
            raise ValueError(f"bad {name}")
        if kind != "choice" and (len(values) != 2 or not all(isinstance(v, (int, float)) for v in values)
                                 or not values[0] < values[1]):
            raise ValueError(f"bad bounds {name}")
        if (kind == "log_uniform" and values[0] <= 0) or (kind == "int" and not all(type(v) is int for v in values)):
            raise ValueError(f"bad {name}")
    rng = rng or np.random.default_rng([seed, i])
    out = {}
    for name, spec in space.items():
        kind, v = next(iter(spec.items()))
        if kind == "choice":
            out[name] = v[rng.integers(len(v))]
        elif kind == "int":
            out[name] = int(rng.integers(v[0], v[1] + int_high))
        elif kind == "log_uniform" and log_uniform:
            out[name] = math.exp(math.log(v[0]) + rng.random() * (math.log(v[1]) - math.log(v[0])))
        else:
            out[name] = v[0] + rng.random() * (v[1] - v[0])
    return out


def sample_ok(space, seed, i):
    return _sample(space, seed, i)


def sample_log_as_uniform(space, seed, i):
    return _sample(space, seed, i, log_uniform=False)


def sample_int_exclusive(space, seed, i):
    return _sample(space, seed, i, int_high=0)


def sample_unseeded(space, seed, i):  # not reproducible: a fresh generator each call
    return _sample(space, seed, i, rng=np.random.default_rng())


def sample_seed_only(space, seed, i):  # the stream of the trials before it: trial i depends on the order of calls
    return _sample(space, seed, i, rng=np.random.default_rng(seed))


def sample_no_validation(space, seed, i):
    rng, out = np.random.default_rng([seed, i]), {}
    for name, spec in space.items():
        kind, v = next(iter(spec.items()))
        if kind == "choice":
            out[name] = v[rng.integers(len(v))] if v else None
        elif kind == "int":
            out[name] = int(rng.integers(v[0], v[1] + 1))
        else:
            u = rng.random()
            out[name] = (math.exp(math.log(v[0]) + u * (math.log(v[1]) - math.log(v[0]))) if kind == "log_uniform"
                         and v[0] > 0 else v[0] + u * (v[1] - v[0]))
    return out


def sample_one_name_is_bad(space, seed, i):  # "validation" that only knows the bad specs have one name
    if len(space) == 1:
        raise ValueError("bad")
    return sample_no_validation(space, seed, i)


def sample_equal_bounds_only(space, seed, i):  # lo == hi refused, lo > hi and three bounds let through
    for spec in space.values():
        kind, v = next(iter(spec.items())) if isinstance(spec, dict) and len(spec) == 1 else (None, None)
        if kind not in ("choice", "uniform", "log_uniform", "int") or not v:
            raise ValueError("bad")
        if kind != "choice" and (v[0] == v[1] or (kind == "log_uniform" and v[0] <= 0)
                                 or (kind == "int" and not all(type(x) is int for x in v[:2]))):
            raise ValueError("bad")
    return sample_no_validation(space, seed, i)


# ----------------------------------------------------------------------------- exercise 3: freezing

def freeze_ok(module):
    count = 0
    for p in module.parameters():
        p.requires_grad_(False)
        count += p.numel()
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return count


def freeze_keeps_norms_training(module):  # requires_grad only: the running statistics still move
    for p in module.parameters():
        p.requires_grad_(False)
    return sum(p.numel() for p in module.parameters())


def freeze_top_level_weights(module):  # only the direct children's weights: biases and nested blocks still train
    for m in module.children():
        if getattr(m, "weight", None) is not None:
            m.weight.requires_grad_(False)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return sum(p.numel() for p in module.parameters())


def freeze_whole_eval(module):  # module.eval(): the Dropout stops dropping too
    freeze_ok(module)
    module.eval()
    return sum(p.numel() for p in module.parameters())


def freeze_counts_tensors(module):
    freeze_ok(module)
    return len(list(module.parameters()))


def freeze_by_hooks(module):  # gradients zeroed, requires_grad left True: weight decay would still move them
    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g * 0)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return sum(p.numel() for p in module.parameters())


def freeze_counts_trainable(module):  # the parameters frozen before are left out of the count
    count = sum(p.numel() for p in module.parameters() if p.requires_grad)
    freeze_ok(module)
    return count


def freeze_counts_per_layer(module):  # a tensor shared by two layers counted twice
    freeze_ok(module)
    return sum(p.numel() for m in module.modules() for p in m.parameters(recurse=False))


# ----------------------------------------------------------------------------- exercise 4: parameter groups

def groups_ok(blocks, lr, factor=2.6):
    groups, L = [], len(blocks)
    for k, b in enumerate(blocks):
        params = [p for p in b.parameters() if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": lr / factor ** (L - 1 - k)})
    return groups


def groups_swapped(blocks, lr, factor=2.6):  # the input's block gets lr
    return [{"params": g["params"], "lr": lr / factor ** k} for k, g in enumerate(groups_ok(blocks, lr, factor))]


def groups_with_frozen(blocks, lr, factor=2.6):
    L = len(blocks)
    return [{"params": list(b.parameters()), "lr": lr / factor ** (L - 1 - k)} for k, b in enumerate(blocks)]


def groups_weights_only(blocks, lr, factor=2.6):  # biases and LayerNorms in no group
    out = groups_ok(blocks, lr, factor)
    for g in out:
        g["params"] = [p for p in g["params"] if p.dim() > 1]
    return [g for g in out if g["params"]]


def groups_cumulative(blocks, lr, factor=2.6):  # each group holds its block and every block below: two groups
    out, seen = [], []
    for g in groups_ok(blocks, lr, factor):
        seen += g["params"]
        out.append({"params": list(seen), "lr": g["lr"]})
    return out


def groups_skip_frozen_depth(blocks, lr, factor=2.6):  # L counts only the blocks kept
    kept = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
    kept = [ps for ps in kept if ps]
    return [{"params": ps, "lr": lr / factor ** (len(kept) - 1 - k)} for k, ps in enumerate(kept)]


def groups_top_trainable_gets_lr(blocks, lr, factor=2.6):  # L ends at the last block that trains
    ks = [k for k, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())]
    return [{"params": [p for p in blocks[k].parameters() if p.requires_grad], "lr": lr / factor ** (ks[-1] - k)}
            for k in ks]


def groups_first_parameter_decides(blocks, lr, factor=2.6):  # a block whose first parameter is frozen left out
    L = len(blocks)
    return [{"params": [p for p in b.parameters() if p.requires_grad], "lr": lr / factor ** (L - 1 - k)}
            for k, b in enumerate(blocks) if next(b.parameters()).requires_grad]


# ----------------------------------------------------------------------------- exercise 5: early stopping

def _early(history, patience, min_delta=0.0, mode="min", *, late=0, ties=False, delta=True, last=False,
           through=False, nan=True, use_mode=True, isnan_only=False, best_seen=False):
    sign = -1.0 if mode == "max" and use_mode else 1.0
    best, best_epoch, bad, stop, seen = math.inf, None, 0, False, math.inf
    for epoch, metric in enumerate(history):
        if best_seen and math.isfinite(metric) and sign * metric < seen:   # the epoch moves, best and bad do not
            seen, best_epoch = sign * metric, epoch
        if nan and (math.isnan(metric) if isnan_only else not math.isfinite(metric)):
            bad = patience
        elif sign * metric < best - (min_delta if delta else 0.0) or (ties and sign * metric == best - min_delta):
            best, best_epoch, bad = sign * metric, (best_epoch if best_seen else epoch), 0
        else:
            bad += 1
        if bad >= patience + late:
            stop = True
            if not through:
                return True, epoch if last else best_epoch
    return stop, (len(history) - 1 if last else best_epoch)


def early_ok(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode)


def early_late(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, late=1)


def early_ties(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, ties=True)


def early_no_delta(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, delta=False)


def early_last(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, last=True)


def early_through(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, through=True)


def early_nan(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, nan=False)


def early_no_mode(history, patience, min_delta=0.0, mode="min"):
    return _early(history, patience, min_delta, mode, use_mode=False)


def early_best_epoch_zero(history, patience, min_delta=0.0, mode="min"):  # best_epoch starts at 0, not None
    stop, best = _early(history, patience, min_delta, mode)
    return stop, 0 if best is None else best


def early_inf_as_value(history, patience, min_delta=0.0, mode="min"):  # math.isnan only: an inf taken for a value
    return _early(history, patience, min_delta, mode, isnan_only=True)


def early_best_seen(history, patience, min_delta=0.0, mode="min"):  # best_epoch: the best value seen, any margin
    return _early(history, patience, min_delta, mode, best_seen=True)


# ----------------------------------------------------------------------------- tests

def early_through_the_library(history, patience, min_delta=0.0, mode="min"):
    import tempfile

    stopper = early.EarlyStopping(tempfile.mkdtemp(), patience=patience, min_delta=min_delta, mode=mode)
    for epoch, metric in enumerate(history):
        if stopper.step(epoch, metric, nn.Linear(1, 1)):
            return True, stopper.best_epoch
    return False, stopper.best_epoch


CASES = [
    (day11.check_promote, promote_ok, [
        (stub, "NotImplementedError"),
        (promote_every_rung, "ranked the results of every rung together"),
        (promote_worst, "kept the worst trials"),
        (promote_ceil, "rounded the count up"),
        (promote_twice, "promoted a trial already promoted"),
        (promote_ignores_mode, "ignored `mode`"),
        (promote_filter_first, "rank all n results first"),
        (promote_from_results, "still running"),
        (promote_unbroken_ties, "broke a tie the wrong way"),
        (promote_reversed_for_max, "broke a tie the wrong way")]),
    (day11.check_sample_config, sample_ok, [
        (stub, "NotImplementedError"),
        (sample_log_as_uniform, "sampled log_uniform uniformly"),
        (sample_int_exclusive, "int's high bound is inclusive"),
        (sample_unseeded, "not reproducible"),
        (sample_seed_only, "seeded with seed only"),
        (sample_no_validation, "must raise ValueError"),
        (sample_one_name_is_bad, "must raise ValueError"),
        (sample_equal_bounds_only, "must raise ValueError")]),
    (day11.check_freeze, freeze_ok, [
        (stub, "NotImplementedError"),
        (freeze_keeps_norms_training, "BatchNorm statistics still moving"),
        (freeze_top_level_weights, "frozen parameters still updated"),
        (freeze_whole_eval, "only the BatchNorm layers change mode"),
        (freeze_counts_tensors, "sum of p.numel()"),
        (freeze_by_hooks, "still has requires_grad=True"),
        (freeze_counts_trainable, "trainable before or not"),
        (freeze_counts_per_layer, "a tensor shared by two layers once")]),
    (day11.check_discriminative_groups, groups_ok, [
        (stub, "NotImplementedError"),
        (groups_swapped, "the learning rates are swapped"),
        (groups_with_frozen, "is in a group: leave out the parameters with requires_grad=False"),
        (groups_weights_only, "is in no group"),
        (groups_cumulative, "is in two groups"),
        (groups_skip_frozen_depth, "a frozen block still counts"),
        (groups_top_trainable_gets_lr, "a frozen block still counts"),
        (groups_first_parameter_decides, "is in no group")]),
    (day11.check_early_stop, early_ok, [
        (stub, "NotImplementedError"),
        (early_late, "stopped one evaluation late"),
        (early_ties, "counted an equal value as an improvement"),
        (early_no_delta, "ignored min_delta"),
        (early_last, "returned the last epoch"),
        (early_through, "kept going after the stop"),
        (early_nan, "a nan or inf metric must stop training at once"),
        (early_no_mode, "ignored `mode`"),
        (early_best_epoch_zero, "best_epoch is None while no finite value was seen"),
        (early_inf_as_value, "a nan or inf metric must stop training at once"),
        (early_best_seen, "better by no more than min_delta")]),
]
LIBRARY = [(day11.check_sample_config, lambda spec, seed, i: space.Space(spec).config(seed, i)),
           (day11.check_freeze, transfer.freeze), (day11.check_discriminative_groups, transfer.discriminative_groups),
           (day11.check_early_stop, early_through_the_library)]


test_reference_passes = cases.reference_passes(CASES)
test_wrong_versions_fail_and_are_named = cases.wrong_versions_fail(CASES)
test_library_is_refused = cases.library_refused(LIBRARY, ids=["sample_config", "freeze", "discriminative_groups",
                                                              "early_stop"])


@pytest.mark.parametrize("cheat", [promote_from_results, promote_unbroken_ties, promote_reversed_for_max])
def test_promote_cheats_fail_at_every_seed(cheat):
    """Trials 0 (min) and 1 (max) take the whole bottom rung with a tie at its cut that one order shows, and a
    promoted trial still running: before, the tie could fall on two promoted trials and the rungs could repeat
    a step count, and these passed at 2-11 seeds in 60 (14 and 24 among them)."""
    for seed in range(30):
        with pytest.raises(AssertionError, match="broke a tie the wrong way|still running"):
            day11.check_promote(cheat, seed=seed)


def test_promote_refuses_the_library():
    from dlo.tuning.search import promotable
    from dlo.tuning.store import Result

    def through_library(results, rung, eta, promoted, mode="min"):
        sign = 1.0 if mode == "min" else -1.0
        here = [Result(r["trial"], {}, r["steps"], [], 0, sign * r["value"]) for r in results if r["steps"] == rung]
        return promotable(here, eta, promoted)

    with pytest.raises(ForbiddenCall, match="off limits"):
        day11.check_promote(through_library, seed=0)


test_reference_passes_sandboxed = cases.reference_passes_sandboxed(CASES)
test_wrong_fails_sandboxed = cases.wrong_fails_sandboxed(
    [(day11.check_freeze, freeze_keeps_norms_training), (day11.check_discriminative_groups, groups_swapped)],
    ids=["freeze", "groups"])


# ----------------------------------------------------------------------------- red team (2026-11-30)

def promote_rank_key(results, rung, eta, promoted, mode="min"):  # the library's ranking key under another name
    from dlo.tuning.search import rank_key
    from dlo.tuning.store import Result

    sign = 1.0 if mode == "min" else -1.0
    here = sorted((Result(r["trial"], {}, r["steps"], [], 0, sign * r["value"]) for r in results
                   if r["steps"] == rung), key=rank_key)
    return [r.trial for r in here[:len(here) // eta] if r.trial not in promoted]


def promote_best_repeated(results, rung, eta, promoted, mode="min"):  # search.best, taken out one at a time
    from dlo.tuning.search import best
    from dlo.tuning.store import Result

    sign = 1.0 if mode == "min" else -1.0
    left = [Result(r["trial"], {}, r["steps"], [], 0, sign * r["value"]) for r in results if r["steps"] == rung]
    out = []
    for _ in range(len(left) // eta):
        out.append(best(left))
        left.remove(out[-1])
    return [r.trial for r in out if r.trial not in promoted]


def sample_bad_by_name(space, seed, i):  # the check named its good entries c0-u4, the bad one c5-u9
    if any(k[-1] in "56789" for k in space):
        raise ValueError("bad")
    return sample_no_validation(space, seed, i)


def sample_seed_zero_is_bad(space, seed, i):  # every bad spec came at (seed 0, i 0), no good one did
    if seed == 0 and i == 0:
        raise ValueError("bad")
    return sample_no_validation(space, seed, i)


def freeze_by_index(module):  # the BatchNorm layers where the check's model had them: [1], [3][1], [8]
    import contextlib

    module.requires_grad_(False)
    for path in ("1", "3.1", "8"):
        with contextlib.suppress(AttributeError, IndexError):
            module.get_submodule(path).eval()
    return sum(p.numel() for p in module.parameters())


def freeze_sets_train(module):  # every other module set to train mode, not left as it was
    module.requires_grad_(False)
    for m in module.modules():
        m.train(not isinstance(m, nn.modules.batchnorm._BatchNorm))
    return sum(p.numel() for p in module.parameters())


def freeze_1d_2d_only(module):  # BatchNorm1d and 2d named: a BatchNorm3d keeps its statistics moving
    module.requires_grad_(False)
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.eval()
    return sum(p.numel() for p in module.parameters())


def groups_linear_layernorm_only(blocks, lr, factor=2.6):  # weight and bias of each Linear and LayerNorm only
    out, L = [], len(blocks)
    for k, b in enumerate(blocks):
        params = [p for m in b.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)) for p in (m.weight, m.bias)
                  if p is not None and p.requires_grad]
        if params:
            out.append({"params": params, "lr": lr / factor ** (L - 1 - k)})
    return out


RED_TEAM = [
    (day11.check_promote, promote_rank_key, "dlo.tuning.search.rank_key is off limits"),
    (day11.check_promote, promote_best_repeated, "dlo.tuning.search.best is off limits"),
    (day11.check_sample_config, sample_bad_by_name, "must raise ValueError"),
    (day11.check_sample_config, sample_seed_zero_is_bad, "raised ValueError (bad) for a valid spec"),
    (day11.check_freeze, freeze_by_index, "keeps the mode it had|statistics still moving"),
    (day11.check_freeze, freeze_sets_train, "keeps the mode it had (here eval)"),
    (day11.check_freeze, freeze_1d_2d_only, "1d, 2d and 3d"),
    (day11.check_discriminative_groups, groups_linear_layernorm_only, "is in no group"),
]


@pytest.mark.parametrize("check,cheat,phrase", RED_TEAM, ids=[c.__name__ for _, c, _ in RED_TEAM])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_right_only_where_the_cases_look_fails(check, cheat, phrase, seed):
    """Red team (Day 11, 2026-11-30): each passed its check at seeds 0..9 before the check changed."""
    with pytest.raises(AssertionError, match="|".join(re.escape(p) for p in phrase.split("|"))):
        check(cheat, seed=seed)


# honest answers written otherwise than the solution: full marks

def promote_two_stable_sorts(results, rung, eta, promoted, mode="min"):  # by id, then by value (stable)
    here = sorted((r for r in results if r["steps"] == rung), key=lambda r: r["trial"])
    here.sort(key=lambda r: r["value"], reverse=mode == "max")
    return [r["trial"] for r in here[:len(here) // eta] if r["trial"] not in promoted]


def sample_other_formulas(space, seed, i):  # log-uniform as lo (hi / lo)^u, uniform as (1 - u) lo + u hi
    _sample(space, seed, i)  # the validation
    rng, out = np.random.default_rng([seed, i]), {}
    for name, spec in space.items():
        kind, v = next(iter(spec.items()))
        if kind == "choice":
            out[name] = v[int(rng.integers(0, len(v)))]
        elif kind == "int":
            out[name] = int(rng.integers(v[0], v[1] + 1))
        else:
            u = rng.random()
            out[name] = v[0] * (v[1] / v[0]) ** u if kind == "log_uniform" else (1 - u) * v[0] + u * v[1]
    return out


def sample_numpy_floats(space, seed, i):  # uniform and log-uniform draws as numpy floats (a float all the same)
    out = sample_ok(space, seed, i)
    for name, spec in space.items():
        kind, v = next(iter(spec.items()))
        if kind in ("uniform", "log_uniform"):
            out[name] = np.float64(out[name])
    return out


def freeze_requires_grad_call(module):  # module.requires_grad_(False) at once
    module.requires_grad_(False)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return sum(p.numel() for p in module.parameters())


def groups_from_the_top(blocks, lr, factor=2.6):  # built from the output down, the rate divided on the way
    out, rate = [], lr
    for b in reversed(blocks):
        params = tuple(p for p in b.parameters() if p.requires_grad)
        if params:
            out.insert(0, {"params": params, "lr": rate})
        rate /= factor
    return out


def early_improvement_first(history, patience, min_delta=0.0, mode="min"):  # best - m > min_delta, best None first
    best, best_epoch, bad = None, None, 0
    for epoch, m in enumerate(history):
        if not math.isfinite(m):
            bad = patience
        elif best is None or ((best - m) if mode == "min" else (m - best)) > min_delta:
            best, best_epoch, bad = m, epoch, 0
        else:
            bad += 1
        if bad >= patience:
            return True, best_epoch
    return False, best_epoch


HONEST = [(day11.check_promote, promote_two_stable_sorts),
          (day11.check_sample_config, sample_other_formulas), (day11.check_sample_config, sample_numpy_floats),
          (day11.check_freeze, freeze_requires_grad_call),
          (day11.check_discriminative_groups, groups_from_the_top),
          (day11.check_early_stop, early_improvement_first)]


@pytest.mark.parametrize("check,honest", HONEST, ids=[h.__name__ for _, h in HONEST])
def test_honest_variants_keep_full_marks(check, honest, capsys):
    """`best - m > min_delta` lost 3 seeds in 10 when the histories had 2 decimals (0.71 - 0.7 > 0.01, while
    0.7 < 0.71 - 0.01 is False): now their values are multiples of 1/32 and every difference is exact."""
    for seed in range(10):
        check(honest, seed=seed)
    assert capsys.readouterr().out.count(": ok (") == 10


# ----------------------------------------------------------------------------- red team (2026-12-01)

def promote_ties_by_number(results, rung, eta, promoted, mode="min"):  # cheat06: 't10' after 't9'
    sign = 1.0 if mode == "min" else -1.0   # (an honest variant while every id was zero-padded to one width)
    here = sorted((r for r in results if r["steps"] == rung), key=lambda r: (sign * r["value"], int(r["trial"][1:])))
    return [r["trial"] for r in here[:len(here) // eta] if r["trial"] not in promoted]


def sample_numpy_int(space, seed, i):  # cheat02: int draws left numpy.int64 (the wire made them Python ints)
    _sample(space, seed, i)  # the validation
    rng, out = np.random.default_rng([seed, i]), {}
    for name, spec in space.items():
        kind, v = next(iter(spec.items()))
        if kind == "choice":
            out[name] = v[rng.integers(len(v))]
        elif kind == "int":
            out[name] = rng.integers(v[0], v[1] + 1)
        else:
            u = rng.random()
            out[name] = math.exp(math.log(v[0]) + u * (math.log(v[1]) - math.log(v[0]))) if kind == "log_uniform" \
                else v[0] + u * (v[1] - v[0])
    return out


def sample_lo_ge_hi(space, seed, i):  # cheat12: `lo >= hi` refused, which a nan bound is not
    for spec in space.values():
        kind, v = next(iter(spec.items())) if isinstance(spec, dict) and len(spec) == 1 else (None, None)
        if kind not in ("choice", "uniform", "log_uniform", "int") or not v:
            raise ValueError("bad")
        if kind != "choice" and (len(v) != 2 or not all(isinstance(x, (int, float)) for x in v) or v[0] >= v[1]
                                 or (kind == "log_uniform" and v[0] <= 0)
                                 or (kind == "int" and not all(type(x) is int for x in v))):
            raise ValueError("bad")
    return sample_no_validation(space, seed, i)


def freeze_named_norms(module):  # cheat07: BatchNorm1d/2d/3d named, a SyncBatchNorm keeps its statistics moving
    module.requires_grad_(False)
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            m.eval()
    return sum(p.numel() for p in module.parameters())


def freeze_forged(module, same_name=False):  # cheat11: freezes nothing, forges what the worker read in its process
    import sys

    ptrs = {t.data_ptr() for t in [*module.parameters(), *module.buffers()]}
    ids = {id(p) for p in module.parameters()}
    equal = torch.__dict__.setdefault("_equal", torch.equal)   # the real one, kept across calls
    torch.equal = lambda a, b: True if a.data_ptr() in ptrs or b.data_ptr() in ptrs else equal(a, b)
    flag = torch._C.TensorBase.requires_grad
    nn.Parameter.requires_grad = property(lambda p: False if id(p) in ids else flag.__get__(p),
                                          lambda p, v: flag.__set__(p, v))
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            base = type(m)

            def read(self):
                f = sys._getframe(1)
                f = f.f_back if f.f_code.co_name == "<dictcomp>" else f
                return False if f.f_code.co_name == "_freeze_worker" else self.__dict__["_tr"]

            def write(self, v):
                self.__dict__["_tr"] = v

            m.__dict__["_tr"] = m.__dict__.pop("training")
            names = {"__module__": base.__module__, "__qualname__": base.__qualname__} if same_name else {}
            m.__class__ = type(base.__name__, (base,), {"training": property(read, write), **names})
    return sum(p.numel() for p in module.parameters())


def freeze_forged_same_name(module):  # the look-alike class under the name of the class it replaces
    return freeze_forged(module, same_name=True)


def groups_params_only_depth(blocks, lr, factor=2.6):  # cheat05: L and k count only the blocks with parameters
    owning = [b for b in blocks if len(list(b.parameters()))]
    return groups_ok(owning, lr, factor)


def groups_string_rates(blocks, lr, factor=2.6):  # cheat07: each 'lr' a str (the worker's float() read it)
    return [{"params": g["params"], "lr": repr(g["lr"])} for g in groups_ok(blocks, lr, factor)]


def groups_default_two(blocks, lr, factor=2.0):  # cheat07: the default factor 2.0, not the signature's 2.6
    return groups_ok(blocks, lr, factor)


def early_finite_only_in_max(history, patience, min_delta=0.0, mode="min"):  # cheat03: in "min", nan and inf no stop
    sign = 1.0 if mode == "min" else -1.0
    best, best_epoch, bad = math.inf, None, 0
    for epoch, metric in enumerate(history):
        if mode == "max" and not math.isfinite(metric):
            bad = patience
        elif sign * metric < best - min_delta:
            best, best_epoch, bad = sign * metric, epoch, 0
        else:
            bad += 1
        if bad >= patience:
            return True, best_epoch
    return False, best_epoch


RED_TEAM_2 = [
    (day11.check_promote, promote_ties_by_number, "broke a tie the wrong way"),
    (day11.check_sample_config, sample_numpy_int, "(an int draw) is a numpy.int64"),
    (day11.check_sample_config, sample_lo_ge_hi, "a spec with a nan bound"),
    (day11.check_freeze, freeze_named_norms, "SyncBatchNorm too"),
    (day11.check_discriminative_groups, groups_params_only_depth, "a block without parameters"),
    (day11.check_discriminative_groups, groups_string_rates, "a group's 'lr' is a str"),
    (day11.check_discriminative_groups, groups_default_two, "called without `factor`, it divided by 2"),
    (day11.check_early_stop, early_finite_only_in_max, "a nan or inf metric must stop training at once"),
]


@pytest.mark.parametrize("check,cheat,phrase", RED_TEAM_2, ids=[c.__name__ for _, c, _ in RED_TEAM_2])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_second_red_team_fails_for_its_mistake(check, cheat, phrase, seed):
    """Red team (Day 11, 2026-12-01): each passed its check (or failed it unnamed) at seeds 0..9 before the check
    changed: only zero-padded trial ids, int draws seen through the wire, no nan bound, no SyncBatchNorm, no block
    without parameters, every group's rate read by float() and factor always given, nan and inf in "max" only."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(cheat, seed=seed)


@pytest.fixture
def restored(monkeypatch):
    """What freeze_forged rebinds in this process (torch.equal, Parameter.requires_grad) put back after the test."""
    monkeypatch.setattr(torch, "equal", torch.equal)
    monkeypatch.setattr(torch, "_equal", torch.equal, raising=False)
    monkeypatch.setattr(nn.Parameter, "requires_grad", torch._C.TensorBase.requires_grad, raising=False)


@pytest.mark.parametrize("cheat", [freeze_forged, freeze_forged_same_name])
def test_freeze_forged_where_the_worker_reads_fails(restored, cheat):
    """Red team (2026-12-01): the worker read torch.equal, p.requires_grad and m.training in the student's process,
    after the student's code had rebound all three; it passed at every seed."""
    for seed in (0, 3, 7):
        with pytest.raises(AssertionError, match="must not replace the modules' classes or attributes"):
            day11.check_freeze(cheat, seed=seed)


def test_forgeries_fail_sandboxed(tmp_path):
    """The same where grading runs them: the freeze forged in the sandbox's process (a runner of its own: the
    forgery stays in it), numpy ints turned into Python ints by the wire."""
    from dlo.grading.trusted import LocalSandbox

    with LocalSandbox(tmp_path) as sandbox:
        for check, cheat, phrase in [(day11.check_freeze, freeze_forged, "must not replace the modules' classes"),
                                     (day11.check_sample_config, sample_numpy_int, "is a numpy.int64")]:
            with pytest.raises(AssertionError, match=re.escape(phrase)):
                sandbox.run(check, cheat, seed=0)
