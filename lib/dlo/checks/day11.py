"""Autograder checks for Day 11 (learning faster: successive halving, a search space as a config, freezing
and discriminative learning rates).

Each `check_<exercise>(fn, seed=0, trials=...)` draws its cases from `case_seed(seed)` (a secret seed when
graded), runs the student's function and the library reference (`dlo.tuning.search.promotable`,
`dlo.tuning.space.Space`, `dlo.tuning.transfer`), and raises AssertionError naming the mistake: the wrong
answers a plausible slip gives are computed here too, and a result equal to one of them is named as that slip.
While the student's code runs, the library references of the exercise are off limits. The freezing and
parameter-group checks live in `dlo.checks.day11_transfer` and `day11_groups`, the search space's in
`day11_space`, the early-stopping one in `day11_early`; they are re-exported here.
"""

from __future__ import annotations

import math
import random

from dlo.checks.day11_early import check_early_stop  # noqa: F401 (the notebook calls it from here)
from dlo.checks.day11_groups import check_discriminative_groups  # noqa: F401 (the notebook calls it from here)
from dlo.checks.day11_space import check_sample_config  # noqa: F401 (the notebook calls it from here)
from dlo.checks.day11_transfer import check_freeze  # noqa: F401 (the notebook calls it from here)
from dlo.grading.api import case_seed, check
from dlo.grading.compare import ok
from dlo.tuning.search import promotable
from dlo.tuning.store import Result

# the whole module: its `rank_key` and `best` rank results too (a red team sorted with them, 2026-11-30)
SEARCH = ("dlo.tuning.search.*",)


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
    numbered = all(r["trial"][:1] == "t" and r["trial"][1:].isdigit() for r in here)   # ties by the number
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
        "broke a tie the wrong way: equal values rank the smaller trial id first (as strings: 't10' before 't9'), "
        "whatever their order in `results`":
            [top(here, n // eta, lambda r: (sign * r["value"], [-ord(c) for c in r["trial"]])),
             top(here, n // eta, lambda r: sign * r["value"])]   # here is in the order given
            + [top(here, n // eta, lambda r: (sign * r["value"], int(r["trial"][1:])))] * numbered,
        "ranked only the not-yet-promoted trials: rank all n results first, keep floor(n / eta), then leave out the "
        "promoted ones": [top(waiting, count, best_first, set()) for count in (len(waiting) // eta, n // eta)],
    }


def _rename_tied(rng: random.Random, results: list[dict], promoted: set, x: str, y: str) -> None:
    """Rename trials x and y (every result of theirs, and in `promoted`) t<d> and t<q>, d one digit and q two
    digits below d * 10: "t<q>" < "t<d>" as strings while q > d as numbers, so ties broken by the number in the id
    promote the other one of the two."""
    used = {r["trial"] for r in results}
    free = {d: [q for q in range(10, 10 * d) if f"t{q}" not in used] for d in range(2, 10)}
    d = rng.choice([d for d, qs in free.items() if qs])
    q = rng.choice(free[d])
    names = dict(zip((x, y), rng.sample([f"t{d}", f"t{q}"], 2)))
    for r in results:
        r["trial"] = names.get(r["trial"], r["trial"])
    for old in names.keys() & promoted:
        promoted.remove(old)
        promoted.add(names[old])


def _promotion_case(rng: random.Random, t: int) -> tuple[list[dict], int, int, set, str]:
    eta = rng.choice([2, 3, 4])
    r = rng.choice([1, 2, 3])
    rungs = [r * eta ** k for k in range(3)]  # r, r eta, r eta^2 (one r: rungs distinct and increasing)
    n0 = rng.choice([eta - 1, eta + 1, 2 * eta + 1, 3 * eta - 1, 4 * eta, 5 * eta + 2]) if t > 1 else 3 * eta + 1
    mode = ("min", "max")[t % 2]
    sign = 1.0 if mode == "min" else -1.0
    # ids of 2 and 3 digits, not padded: "t100" < "t99" as strings (zero-padded ids let a red team break ties by
    # the number in the id, 2026-12-01); the one-digit ids are kept for the tie at the cut
    trials = [f"t{i}" for i in rng.sample(range(10, 1000), n0)]
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
        _rename_tied(rng, results, promoted, here[lo]["trial"], here[hi]["trial"])
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


# _slips: its "promoted a trial already promoted" entry is the right ranking with the promoted ids still in, and
# _reference_promote is the answer; every checks module is loaded where the student's code runs (the runner's
# session reaches the real one through its frames: a red team called _slips so, 2026-12-03): off limits there
@check(forbid=SEARCH + ("dlo.checks.day11._slips", "dlo.checks.day11._reference_promote"),
       hint="rank the rung's results yourself (sorted with a key)")
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
