"""Autograder checks for Day 11 (learning faster: successive halving, a search space as a config, freezing
and discriminative learning rates).

Each `check_<exercise>(fn, seed=0, trials=...)` draws its cases from `case_seed(seed)` (a secret seed when
graded), runs the student's function and the library reference (`dlo.tuning.search.promotable`,
`dlo.tuning.space.Space`, `dlo.tuning.transfer`), and raises AssertionError naming the mistake: the wrong
answers a plausible slip gives are computed here too, and a result equal to one of them is named as that slip.
While the student's code runs, the library references of the exercise are off limits. The freezing and
parameter-group checks live in `dlo.checks.day11_transfer`, the early-stopping one in `dlo.checks.day11_early`;
they are re-exported here.
"""

from __future__ import annotations

import math
import random

import numpy as np

from dlo.checks.day11_early import check_early_stop  # noqa: F401 (the notebook calls it from here)
from dlo.checks.day11_transfer import check_discriminative_groups, check_freeze  # noqa: F401 (the notebook's)
from dlo.errors import BadInput
from dlo.grading.api import case_seed, check
from dlo.grading.compare import ok
from dlo.tuning.search import promotable
from dlo.tuning.space import Space
from dlo.tuning.store import Result

# the whole module: its `rank_key` and `best` rank results too (a red team sorted with them, 2026-11-30)
SEARCH = ("dlo.tuning.search.*",)
SPACE = ("dlo.tuning.space.*",)


# ----------------------------------------------------------------------------- exercise 1: promotion

def _reference_promote(results: list[dict], rung: int, eta: int, promoted: set, mode: str) -> list[str]:
    sign = 1.0 if mode == "min" else -1.0   # promotable ranks lowest first: a maximised metric is negated
    here = [Result(r["trial"], {}, r["steps"], [], 0, sign * r["value"]) for r in results if r["steps"] == rung]
    return promotable(here, eta, set(promoted))


def _slips(results, rung, eta, promoted, mode) -> dict[str, list[list[str]]]:
    """What each plausible slip returns, named by the message that explains it."""
    sign = 1.0 if mode == "min" else -1.0
    here = [r for r in results if r["steps"] == rung]

    def top(rows, count, key, skip=promoted):
        ranked = sorted(rows, key=key)
        return [r["trial"] for r in ranked[:count] if r["trial"] not in skip]

    best_first = lambda r: (sign * r["value"], r["trial"])  # noqa: E731
    n = len(here)
    waiting = [r for r in here if r["trial"] not in promoted]
    return {   # each slip: the answers it gives (one, or one per way of making it)
        "ranked the results of every rung together: promote from the results at `rung` only (steps == rung)":
            [top(results, len(results) // eta, best_first)],
        "ignored `mode`: 'max' means the highest value is the best":
            [top(here, n // eta, lambda r: (r["value"], r["trial"]))],
        "kept the worst trials: in mode 'min' the lowest value is the best, in 'max' the highest":
            [top(here, n // eta, lambda r: (-sign * r["value"], r["trial"]))],
        "rounded the count up: promote floor(n / eta) of the n results (none while n < eta)":
            [top(here, math.ceil(n / eta), best_first)],
        "rounded the count to nearest: promote floor(n / eta) of the n results (none while n < eta)":
            [top(here, round(n / eta), best_first)],
        "promoted a trial already promoted: leave out the ids in `promoted` (also those with no result at the next "
        "rung yet: still running)": [top(here, n // eta, best_first, set())],
        "broke a tie the wrong way: equal values rank the smaller trial id first (as strings), whatever their order "
        "in `results`": [top(here, n // eta, lambda r: (sign * r["value"], [-ord(c) for c in r["trial"]])),
                         top(here, n // eta, lambda r: sign * r["value"])],   # here is in the order given
        "ranked only the not-yet-promoted trials: rank all n results first, keep floor(n / eta), then leave out the "
        "promoted ones": [top(waiting, count, best_first, set()) for count in (len(waiting) // eta, n // eta)],
    }


def _promotion_case(rng: random.Random, t: int) -> tuple[list[dict], int, int, set, str]:
    eta = rng.choice([2, 3, 4])
    r = rng.choice([1, 2, 3])
    rungs = [r * eta ** k for k in range(3)]  # r, r eta, r eta^2 (one r: rungs distinct and increasing)
    n0 = rng.choice([eta - 1, eta + 1, 2 * eta + 1, 3 * eta - 1, 4 * eta, 5 * eta + 2]) if t > 1 else 3 * eta + 1
    mode = ("min", "max")[t % 2]
    sign = 1.0 if mode == "min" else -1.0
    trials = [f"t{i:04d}" for i in rng.sample(range(100), n0)]
    results, alive = [], trials
    for k, steps in enumerate(rungs):
        for trial in alive:
            # more steps, better values: a rung pooled with the others would promote the later rungs' trials
            value = sign * (round(rng.uniform(0, 1), 2) - 0.5 * k)   # 2 decimals: ties happen, broken by trial id
            results.append({"trial": trial, "steps": steps, "value": value})
        ranked = sorted((r for r in results if r["steps"] == steps), key=lambda r: (sign * r["value"], r["trial"]))
        top = [r["trial"] for r in ranked[:len(ranked) // eta]]
        # asynchronous: some of the top are promoted already, and one from outside it was, when the rung had fewer
        alive = top[:rng.randint(0, len(top))] + [r["trial"] for r in ranked[len(top):len(top) + rng.randint(0, 1)]]
    k = rng.randrange(2) if t > 1 else 0  # trials 0 and 1 (min, max): the full bottom rung, a tie at its cut
    promoted = {r["trial"] for r in results if r["steps"] == rungs[k + 1]}
    rng.shuffle(results)
    here = sorted((r for r in results if r["steps"] == rungs[k]), key=lambda r: (sign * r["value"], r["trial"]))
    count = len(here) // eta
    if 0 < count < len(here):
        # a tie at the cut, the larger id first in `results`: only the trial id decides which of the two is in
        # the top, and with one of them not promoted yet the two orders promote different trials (a pair of
        # promoted trials would hide the order: both are left out either way)
        free = [m for m in range(count, len(here)) if here[m]["trial"] not in promoted]
        pairs = [j for j in range(count, 0, -1) if not {here[j - 1]["trial"], here[j]["trial"]} <= promoted]
        lo, hi = (count - 1, free[0]) if free else (pairs[0] - 1, pairs[0]) if pairs else (count - 1, count)
        here[hi]["value"] = here[lo]["value"]
        a, b = sorted((results.index(here[lo]), results.index(here[hi])))
        if results[a]["trial"] < results[b]["trial"]:
            results[a], results[b] = results[b], results[a]
        # a trial promoted and still running: no result at the next rung yet, only `promoted` says it went
        waiting = [r["trial"] for r in here[:lo] if r["trial"] not in promoted]
        if waiting:
            promoted.add(rng.choice(waiting))
        elif lo:  # every trial above the tie went on already: one of them has no result up there yet
            running = here[rng.randrange(lo)]["trial"]
            results = [r for r in results if r["trial"] != running or r["steps"] <= rungs[k]]
    return results, rungs[k], eta, promoted, mode


@check(forbid=SEARCH, hint="rank the rung's results yourself (sorted with a key)")
def check_promote(promote_fn, seed: int = 0, trials: int = 8) -> None:
    """`promote_fn(results, rung, eta, promoted, mode) -> [trial ids]` against `dlo.tuning.search.promotable`."""
    name, rng = "promote", random.Random(case_seed(seed))
    for t in range(trials):
        results, rung, eta, promoted, mode = _promotion_case(rng, t)
        case = (f"rung={rung}, eta={eta}, mode={mode!r}, {sum(r['steps'] == rung for r in results)} results at the "
                f"rung, {len(promoted)} already promoted")
        got = promote_fn([dict(r) for r in results], rung, eta, set(promoted), mode)
        want = _reference_promote(results, rung, eta, promoted, mode)
        if not isinstance(got, (list, tuple)) or not all(isinstance(x, str) for x in got):
            raise AssertionError(f"{name}: return a list of trial ids (str), best first; got {got!r} ({case})")
        got = list(got)
        if got == want:
            continue
        # every slip that gives this answer is named: on a small rung two slips can agree
        named = [m for m, wrong in _slips(results, rung, eta, promoted, mode).items() if any(got == w for w in wrong)]
        if named:
            raise AssertionError(f"{name}: {'; or: '.join(named)} ({case}): expected {want}, got {got}")
        if set(got) & promoted:
            raise AssertionError(f"{name}: promoted a trial already promoted: leave out the ids in `promoted`, also "
                                 f"those with no result at the next rung yet (still running) ({case}): expected "
                                 f"{want}, got {got}")
        if sorted(got) == sorted(want):
            raise AssertionError(f"{name}: the right trials in the wrong order: best first, ties by the smaller "
                                 f"trial id ({case}): expected {want}, got {got}")
        raise AssertionError(f"{name}: expected {want}, got {got} ({case})")
    ok(name, f"{trials} rungs, eta 2-4, min and max, ties and promoted trials")


# ----------------------------------------------------------------------------- exercise 3: a space as a config

NAMES = ("lr", "wd", "width", "depth", "dropout", "momentum", "warmup", "beta2", "heads", "act")


def _space_case(rng: random.Random) -> dict:
    """2-5 names drawn from NAMES, each of any kind: a name says nothing of its kind, nor a bad spec's of its fault
    (names c5-u9 for the bad ones let a red team refuse a spec by its name, 2026-11-30)."""
    spec = {}
    for k, name in enumerate(rng.sample(NAMES, rng.randint(2, 5))):
        kind = rng.choice(["choice", "uniform", "log_uniform", "int"]) if k >= 2 else ("log_uniform", "int")[k]
        if kind == "choice":
            spec[name] = {"choice": rng.sample([8, 16, 32, 64, "relu", "gelu", 0.5], rng.randint(1, 4))}
        elif kind == "int":
            low = rng.randint(-3, 5)
            spec[name] = {"int": [low, low + rng.randint(1, 4)]}
        elif kind == "uniform":
            low = rng.choice([-1.0, 0.0, 0.5])
            spec[name] = {"uniform": [low, low + rng.choice([0.25, 1.0, 3.0])]}
        else:
            low = rng.choice([1e-5, 1e-4, 3e-3])
            spec[name] = {"log_uniform": [low, low * rng.choice([10.0, 1e3, 1e5])]}
    return dict(rng.sample(list(spec.items()), len(spec)))   # any order: the draws follow the order written


def _space_slips(spec: dict, seed: int, i: int) -> dict[str, dict]:
    """What each plausible slip draws for trial i."""
    def draw(rng, log_as_uniform=False, int_exclusive=False, int_rounded=False):
        out = {}
        for name, ((kind, v),) in ((n, tuple(s.items())) for n, s in spec.items()):
            if kind == "choice":
                out[name] = v[rng.integers(len(v))]
            elif kind == "int":
                if int_rounded:
                    out[name] = int(round(v[0] + rng.random() * (v[1] - v[0])))
                else:
                    out[name] = int(rng.integers(v[0], v[1] + (not int_exclusive)))
            elif kind == "log_uniform" and not log_as_uniform:
                out[name] = math.exp(math.log(v[0]) + rng.random() * (math.log(v[1]) - math.log(v[0])))
            else:
                out[name] = v[0] + rng.random() * (v[1] - v[0])
        return out

    def rng():
        return np.random.default_rng([seed, i])

    return {"sampled log_uniform uniformly between low and high: draw u ~ U(0, 1), then "
            "exp(log low + u (log high - log low))": draw(rng(), log_as_uniform=True),
            "int's high bound is inclusive: rng.integers(low, high + 1)": draw(rng(), int_exclusive=True),
            "rounded a uniform draw for int (the two ends come half as often): rng.integers(low, high + 1)":
                draw(rng(), int_rounded=True),
            "seeded with seed + i: the generator is np.random.default_rng([seed, i])":
                draw(np.random.default_rng(seed + i)),
            "seeded with seed only: trial i's draws must come from np.random.default_rng([seed, i]), not from "
            "the stream of the trials before it": draw(np.random.default_rng(seed))}


def _same(got: dict, want: dict) -> bool:
    if not isinstance(got, dict) or list(got) != list(want):
        return False
    for k, w in want.items():
        g = got[k]
        if isinstance(w, float):
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isclose(g, w, rel_tol=1e-12):
                return False
        elif type(g) is not type(w) or g != w:    # an int must be an int, a choice the value itself
            return False
    return True


def _bad_spaces(rng: random.Random) -> list[tuple[dict, str]]:
    """One spec of each wrong kind, its fault at a random place among good names, the details drawn."""
    low, high = rng.choice([(0.1, 0.2), (1e-4, 1e-1), (1, 4)])
    flat = rng.choice(["uniform", "log_uniform", "int"])
    bads = [({rng.choice(["loguniform", "normal", "range", "Choice"]): [1e-4, 1e-1]}, "an unknown kind"),
            ({flat: [low, low] if flat != "int" else [2, 2]}, "low == high"),
            ({flat: [high, low] if flat != "int" else [4, 1]}, "low > high"),
            ({"log_uniform": [rng.choice([0.0, -1e-3]), 1.0]}, "log_uniform with low <= 0"),
            ({"int": rng.choice([[1, 4.5], [1.5, 4], [1.0, 4]])}, "int with a non-integer bound"),
            ({"choice": []}, "an empty choice"),
            ({rng.choice(["uniform", "log_uniform"]): rng.choice([[0.1], [0.1, 0.2, 0.3], ["0.1", "0.2"]])},
             "bounds that are not two numbers"),
            ({"uniform": [0.1, 0.2], "log_uniform": [1e-3, 1e-2]}, "two kinds for one name"),
            ([1e-3, 1e-2], "a bare list instead of {kind: values}")]
    out = []
    for bad, what in bads:
        items = list(_space_case(rng).items())
        name = rng.choice([n for n in NAMES if n not in dict(items)])
        items.insert(rng.randint(0, len(items)), (name, bad))
        out.append((dict(items), what))
    return out


@check(forbid=SPACE, hint="write the draws with numpy's Generator yourself")
def check_sample_config(sample_fn, seed: int = 0, trials: int = 6) -> None:
    """`sample_fn(spec, seed, i) -> config` equal to `dlo.tuning.space.Space(spec).config(seed, i)`; a bad
    spec raises ValueError."""
    name, rng = "sample_config", random.Random(case_seed(seed))
    for t in range(trials):
        # seed 0 among the good cases too: a bad spec is no (seed, i) of its own (`sample_fn(spec, 0, 0)` let a
        # red team refuse every call at seed 0, 2026-11-30)
        spec, s = _space_case(rng), 0 if t == 0 else rng.randrange(1000)
        for i in (0, rng.randint(1, 50), rng.randint(51, 5000)):
            case = f"spec={spec}, seed={s}, i={i}"
            try:
                got = sample_fn({k: {kk: list(vv) for kk, vv in v.items()} for k, v in spec.items()}, s, i)
            except ValueError as err:
                raise AssertionError(f"{name}: raised ValueError ({err}) for a valid spec: refuse a spec by its "
                                     f"kinds and values only ({case})") from None
            again = sample_fn({k: {kk: list(vv) for kk, vv in v.items()} for k, v in spec.items()}, s, i)
            if got != again:
                raise AssertionError(f"{name}: not reproducible: two calls with the same (seed, i) gave {got} and "
                                     f"{again} ({case}); draw from np.random.default_rng([seed, i]) only")
            want = Space(spec).config(s, i)
            if _same(got, want):
                continue
            if isinstance(got, dict) and list(got) != list(want):
                raise AssertionError(f"{name}: the config's keys are {list(got)}, expected {list(want)} (the "
                                     f"names in the order written) ({case})")
            for mistake, wrong in _space_slips(spec, s, i).items():
                if _same(got, wrong) and not _same(wrong, want):
                    raise AssertionError(f"{name}: {mistake} ({case}): expected {want}, got {got}")
            raise AssertionError(f"{name}: expected {want}, got {got} ({case})")
    bad_spaces = _bad_spaces(rng)
    for spec, what in bad_spaces:
        try:
            Space(spec)
            raise AssertionError(f"the reference accepts {spec}")  # a broken case: never reached
        except BadInput:
            pass
        try:
            sample_fn(spec, rng.randrange(1000), rng.randint(0, 5000))
        except ValueError:
            continue
        except Exception as err:  # noqa: BLE001 (what the student raised is the message)
            raise AssertionError(f"{name}: a spec with {what} ({spec}) must raise ValueError before any draw, "
                                 f"it raised {type(err).__name__}: {err}") from None
        raise AssertionError(f"{name}: a spec with {what} ({spec}) must raise ValueError, it returned a config")
    ok(name, f"{trials} spaces x 3 trials each against Space.config, {len(bad_spaces)} bad specs refused")
