"""Day 11's exercise 3 (a search space written as a config): `check_sample_config`, re-exported by
`dlo.checks.day11`. The reference is `dlo.tuning.space.Space`; the student's draws are compared with it, their
Python types read in a worker (the sandbox's wire turns NumPy scalars into Python ones), and bad specs must be
refused with the library's one-line error.
"""

from __future__ import annotations

import copy
import math
import random

import numpy as np

from dlo.errors import BadInput
from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok
from dlo.grading.forbid import ForbiddenCall
from dlo.tuning.space import Space

SPACE = ("dlo.tuning.space.*",)



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


def _types_worker(sample_fn, spec: dict, seed: int, i: int) -> list[str] | str:
    """The class of each value of the student's config, in its order, as the student's code made it: on its way
    to the check the wire turns a numpy scalar into a Python number (a red team's int draws were numpy.int64 and
    passed, 2026-12-01)."""
    config = sample_fn(spec, seed, i)
    if not isinstance(config, dict):
        return type(config).__name__
    return [f"{type(v).__module__}.{type(v).__qualname__}" for v in config.values()]


def _wrong_type(spec: dict, want: dict, types: list[str], values: dict) -> str | None:
    """What the text says of a value's type and the student's broke: an int draw is a Python int, a choice the
    value itself (a float draw is any float: the text says no more). Only where the value is the right one
    (`values`: the config as it came): another value is a wrong draw, named as such."""
    for (key, w), ((kind, _),), got in zip(want.items(), (s.items() for s in spec.values()), types):
        try:
            right = bool(values.get(key) == w)
        except Exception:  # noqa: BLE001 (a value of the student's that does not compare: no right value)
            right = False
        if not right:
            continue
        if kind == "int" and got != "builtins.int":
            return (f"{key!r} (an int draw) is a {got}: return a Python int, int(rng.integers(lo, hi + 1)), as the "
                    f"table says")
        if kind == "choice" and got != f"{type(w).__module__}.{type(w).__qualname__}":
            return (f"{key!r} (a choice) is a {got}, not the {type(w).__name__} in the list: return values[k], the "
                    f"value itself")
    return None


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
            ([1e-3, 1e-2], "a bare list instead of {kind: values}"),
            # `lo >= hi` lets a nan through; `not lo < hi`, as the text writes it, does not (a red team, 2026-12-01)
            ({rng.choice(["uniform", "log_uniform"]): rng.choice([[math.nan, 1.0], [0.5, math.nan]])},
             "a nan bound (bounds must satisfy lo < hi, which a nan never does: test `not lo < hi`, not `lo >= hi`)")]
    out = []
    for bad, what in bads:
        items = list(_space_case(rng).items())
        name = rng.choice([n for n in NAMES if n not in dict(items)])
        items.insert(rng.randint(0, len(items)), (name, bad))
        out.append((dict(items), what))
    return out


# _space_slips: each slip is the right draw but in one kind (no log_uniform: the int slip's; no int: the log slip's),
# and this module is loaded where the student's code runs (the types' worker; reachable through gc): off limits there
def _calls(rng: random.Random, trials: int) -> list[tuple]:
    """The check's calls in the order made: ("good", spec, seed, i) for each of the `trials` spaces at three i (one
    0, one in 1-50, one in 51-5000, in any order), ("bad", spec, what, seed, i) for each bad spec, every bad one at
    a random place among the good ones with its (seed, i) drawn as a good call's. All the bad specs after the last
    good call, the good ones' i in rising bands, let a red team's stateful function refuse every new (seed, i)
    after a large i (2026-12-03): now neither the order nor i nor seed tells a bad spec's call from a good one's."""
    good = []
    for t in range(trials):
        # seed 0 among the good cases too: a bad spec is no (seed, i) of its own (`sample_fn(spec, 0, 0)` let a
        # red team refuse every call at seed 0, 2026-11-30)
        spec, s = _space_case(rng), 0 if t == 0 else rng.randrange(1000)
        good += [("good", spec, s, i) for i in rng.sample([0, rng.randint(1, 50), rng.randint(51, 5000)], 3)]
    # a good space's three calls stay apart as well as together: the whole list shuffled, the bad ones in it
    bad = [("bad", spec, what, rng.randrange(1000), rng.choice([0, rng.randint(1, 50), rng.randint(51, 5000)]))
           for spec, what in _bad_spaces(rng)]
    calls = good + bad
    rng.shuffle(calls)
    return calls


def _good_call(name: str, sample_fn, spec: dict, s: int, i: int) -> None:
    """One valid spec at (seed s, trial i): the config equal to Space(spec).config(s, i), twice the same, its values'
    types as the student's code made them."""
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
    if isinstance(got, dict) and list(got) != list(want):
        raise AssertionError(f"{name}: the config's keys are {list(got)}, expected {list(want)} (the "
                             f"names in the order written) ({case})")
    if isinstance(got, dict):   # the types as made, not as the wire delivers them
        types = run_student(_types_worker, sample_fn, copy.deepcopy(spec), s, i)
        if not isinstance(types, list) or len(types) != len(want):
            n = len(types) if isinstance(types, list) else 0
            raise AssertionError(f"{name}: the grader got the types of {n} of the config's {len(want)} values "
                                 f"as your code made them (a second call returned "
                                 f"{types if isinstance(types, str) else 'a list'}): return the same dict of "
                                 f"Python values every time ({case})")
        wrong = _wrong_type(spec, want, types, got)
        if wrong:
            raise AssertionError(f"{name}: {wrong} ({case})")
    if _same(got, want):
        return
    for mistake, wrong in _space_slips(spec, s, i).items():
        if _same(got, wrong) and not _same(wrong, want):
            raise AssertionError(f"{name}: {mistake} ({case}): expected {want}, got {got}")
    raise AssertionError(f"{name}: expected {want}, got {got} ({case})")


def _bad_call(name: str, sample_fn, spec, what: str, s: int, i: int) -> str | None:
    """One bad spec: refused with ValueError; else what the student's function did instead (None: refused)."""
    try:
        Space(spec)
        raise AssertionError(f"the reference accepts {spec}")  # a broken case: never reached
    except BadInput:
        pass
    try:
        sample_fn(spec, s, i)
    except ValueError:
        return None
    except ForbiddenCall:
        raise
    except Exception as err:  # noqa: BLE001 (what the student raised is the message)
        return (f"{name}: a spec with {what} ({spec}) must raise ValueError before any draw, it raised "
                f"{type(err).__name__}: {err}")
    return f"{name}: a spec with {what} ({spec}) must raise ValueError, it returned a config"


# _space_slips: each slip is the right draw but in one kind (no log_uniform: the int slip's; no int: the log slip's),
# and this module is loaded where the student's code runs (the types' worker; reachable through gc): off limits there
@check(forbid=SPACE + ("dlo.checks.day11_space._space_slips",), hint="write the draws with numpy's Generator yourself")
def check_sample_config(sample_fn, seed: int = 0, trials: int = 6) -> None:
    """`sample_fn(spec, seed, i) -> config` equal to `dlo.tuning.space.Space(spec).config(seed, i)`; a bad
    spec raises ValueError."""
    name, rng = "sample_config", random.Random(case_seed(seed))
    calls, unrefused = _calls(rng, trials), []
    for call in calls:
        if call[0] == "good":
            _good_call(name, sample_fn, *call[1:])
        else:   # said after the good ones, as when they came last: a wrong draw is named before a missing refusal
            unrefused.append(_bad_call(name, sample_fn, *call[1:]))
    first = next((m for m in unrefused if m is not None), None)
    if first is not None:
        raise AssertionError(first)
    bad = len(unrefused)
    ok(name, f"{trials} spaces x 3 trials each against Space.config, {bad} bad specs refused, in one random order")
