"""Day 10's exercise 6 (the 5-D layout search, moved from Day 7): the check accepts the solution notebook's
search and rejects a stub, the library's reference, layouts that break a rule, and the usual slips, each
failing with the message that names it (context, expert or pipeline parallelism never tried, ring attention's K/V
traffic left out, the activations not divided by cp, the experts' weights counted on every rank)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from itertools import product

import pytest

from dlo.checks import day10_layout
from dlo.layout import Cluster, Layout, fits, memory_bytes, step_time
from tests.checks.conftest import load_solution


@pytest.fixture(scope="module")
def sol():
    return load_solution("day10_context_experts")


def stub(*args, **kwargs):
    raise NotImplementedError()


def _candidates(model, cluster, batch):
    """The rules, written out as a student writes them (the library's enumeration is off limits)."""
    n = cluster.gpus
    degrees = [d for d in range(1, n + 1) if n % d == 0]
    for tp, cp, pp in product(degrees, repeat=3):
        if n % (tp * cp * pp) or model.kv_heads % tp or model.layers % pp or (cp > 1 and model.seq % (2 * cp)):
            continue
        dp = n // (tp * cp * pp)
        if batch % dp:
            continue
        eps = [e for e in range(1, dp + 1) if dp % e == 0 and model.n_experts % e == 0] if model.n_experts else [1]
        ms = [k for k in range(max(pp, 1), batch // dp + 1) if (batch // dp) % k == 0]
        for ep, m, fsdp, ac in product(eps, ms, (False, True) if dp * cp > 1 else (False,), (False, True)):
            yield Layout(dp, tp, pp, fsdp, m, ac, cp, ep)


def _search_with(keep=lambda lay: True, memory=memory_bytes, time_model=lambda model: model):
    def search(model, cluster, batch):
        ok = [lay for lay in _candidates(model, cluster, batch)
              if keep(lay) and memory(model, lay, cluster, batch) <= cluster.mem_gib * 2**30]
        if not ok:
            raise ValueError("nothing fits")
        return min(ok, key=lambda lay: step_time(time_model(model), lay, cluster, batch))
    return search


def no_kv_traffic(model):
    return dataclasses.replace(model, kv_heads=0)  # ring_bytes_per_rank of 0 K/V heads: nothing travels


def undivided_activations(model, lay, cluster, batch):
    whole = dataclasses.replace(model, seq=model.seq * lay.cp, act_layer=model.act_layer * lay.cp,
                                act_head=model.act_head * lay.cp)
    return memory_bytes(whole, lay, cluster, batch)


def experts_everywhere(model, lay, cluster, batch):
    return memory_bytes(model, dataclasses.replace(lay, ep=1), cluster, batch)


def states_only(model, lay, cluster, batch):
    """Plausible and wrong (Day 7's slip): the model states fit, the activations forgotten."""
    return memory_bytes(dataclasses.replace(model, act_layer=0, act_head=0, hidden=0), lay, cluster, batch)


def test_the_check_accepts_the_solution_and_a_student_written_search(sol):
    day10_layout.check_layout_search(sol.search_layout, seed=1, trials=6)
    day10_layout.check_layout_search(_search_with(), seed=0)


@pytest.mark.parametrize("wrong, says", [
    (_search_with(keep=lambda lay: lay.cp == 1), "context parallelism never tried"),
    (_search_with(keep=lambda lay: lay.ep == 1), "expert parallelism never tried"),
    (_search_with(keep=lambda lay: lay.pp == 1), r"pipeline parallelism never tried \(pp = 1 only\)"),
    (_search_with(time_model=no_kv_traffic), "K/V traffic left out"),
    (_search_with(memory=undivided_activations), "activations not divided by cp"),
    (_search_with(memory=experts_everywhere), "weights counted whole on every rank"),
    (_search_with(memory=states_only), "does not fit"),
])
def test_each_slip_fails_with_its_name(wrong, says):
    with pytest.raises(AssertionError, match=says):
        day10_layout.check_layout_search(wrong, seed=0)


def test_a_stub_the_reference_and_broken_rules_are_refused():
    from dlo import layout

    with pytest.raises(NotImplementedError):
        day10_layout.check_layout_search(stub)
    with pytest.raises(AssertionError, match="off limits"):
        day10_layout.check_layout_search(lambda *a: layout.search(*a))
    with pytest.raises(AssertionError, match="on a dense model"):
        day10_layout.check_layout_search(lambda model, cluster, batch: Layout(16, 1, 1, True, 1, False, 1, 2))


def test_the_zigzag_rule_is_checked_on_the_sequence():
    """2 cp must divide the sequence; a layout at cp = 3 on 131,072 positions is no layout."""
    model = day10_layout.layout_model("llama3.1-8b", 131072)
    bad = day10_layout._valid(Layout(1, 1, 1, True, 8, True, 3, 1), model, Cluster("H100 SXM", 3), 8)
    assert "2 cp = 6 does not divide the 131072 positions" in bad


def test_the_search_must_raise_when_nothing_fits(sol):
    def none_when_nothing_fits(model, cluster, batch):
        try:
            return sol.search_layout(model, cluster, batch)
        except ValueError:
            return None

    with pytest.raises(AssertionError, match="must raise ValueError; it returned None"):
        day10_layout.check_layout_search(none_when_nothing_fits, seed=1, trials=1)


def test_the_check_passes_under_the_grader(sandbox, sol, capsys):
    """Under the grader the layout arrives as a handle to the student's object, read field by field."""
    sandbox.run(day10_layout.check_layout_search, sol.search_layout, seed=1, trials=1)
    assert capsys.readouterr().out.count(": ok (") == 1


def test_a_layout_with_a_wrong_field_type_is_refused(sol):
    def bool_degree(model, cluster, batch):
        lay = sol.search_layout(model, cluster, batch)
        return dataclasses.replace(lay, cp=True)  # True == 1, but no degree

    with pytest.raises(AssertionError, match="its cp a int"):
        day10_layout.check_layout_search(bool_degree, trials=1)


def test_the_notebooks_cases_need_the_new_axes():
    """The 8B at 131,072 tokens on 16 H100 runs faster with context parallelism, the 8-expert MoE on Llama 3.2 3B
    on 16 H100 with expert parallelism: the two visible cases each exercise one new axis."""
    from dlo.layout import search

    long = day10_layout.layout_model("llama3.1-8b", 131072)
    assert search(long, Cluster("H100 SXM", 16), 16).cp > 1
    moe = day10_layout.layout_model("llama3.2-3b", 4096, 8, 2)
    best = search(moe, Cluster("H100 SXM", 16), 16)
    assert best.ep > 1 and fits(moe, best, Cluster("H100 SXM", 16), 16)


def test_a_fixed_case_needs_pipeline_parallelism():
    """A search that never tries pp > 1 passed most seeds (pp > 1 wins in few seeded cases): the 70B at 8,192 tokens
    on 32 H200 is a fixed case, and every layout as fast as the reference's there has pp > 1."""
    import random

    from dlo.layout import search

    case = (("llama3.1-70b", 8192, 0, 0), Cluster("H200 SXM", 32, 141.0), 32)
    assert case in day10_layout._cases(random.Random(0), 0)
    model, cluster, batch = day10_layout.layout_model(*case[0]), case[1], case[2]
    t_best = step_time(model, search(model, cluster, batch), cluster, batch)
    fastest = [lay for lay in _candidates(model, cluster, batch) if fits(model, lay, cluster, batch)
               and step_time(model, lay, cluster, batch) <= t_best * (1 + 1e-9)]
    assert fastest and all(lay.pp > 1 for lay in fastest)


def test_a_fixed_case_needs_tp_and_cp_across_nodes():
    """A search that keeps tp x cp inside a node passed every seed while all clusters had nodes of 8: two 131k
    sequences of the 8B on 16 H100 in nodes of 4 fit only as tp 4 x cp 4."""
    import random

    case = (("llama3.1-8b", 131072, 0, 0), Cluster("H100 SXM", 16, per_node=4), 2)
    assert case in day10_layout._cases(random.Random(0), 0)
    model, cluster, batch = day10_layout.layout_model(*case[0]), case[1], case[2]
    fitting = [lay for lay in _candidates(model, cluster, batch) if fits(model, lay, cluster, batch)]
    assert fitting and all(lay.tp * lay.cp > cluster.per_node for lay in fitting)


# ----------------------------------------------------------------------------- red team (2026-11-30)

def _old_seeded(seed: int, trials: int = 4) -> list[tuple]:
    """The seeded cases of the generator before 2026-11-30 (powers of 2, three memories, the models' own depths): what a
    student who read the check could tabulate, 420 of them."""
    import random

    from dlo.grading.api import case_seed

    rng, out = random.Random(case_seed(seed)), []
    for _ in range(trials):
        kind = rng.choice(["dense", "long", "moe"])
        if kind == "moe":
            name, n_experts, top_k = rng.choice(day10_layout.MOE)
            key = (name, rng.choice([4096, 8192]), n_experts, top_k)
        else:
            key = (rng.choice(day10_layout.DENSE[:2]) if kind == "long" else rng.choice(day10_layout.DENSE),
                   rng.choice([32768, 65536, 131072]) if kind == "long" else rng.choice([4096, 8192]), 0, 0)
        gpus = rng.choice([32, 64, 128] if key[0] == "llama3.1-70b" else [8, 16, 32, 64])
        gpu, mem = rng.choice([("A100 80GB SXM", 80.0), ("H100 SXM", 80.0), ("H200 SXM", 141.0)])
        out.append((key, Cluster(gpu, gpus, mem), gpus * rng.choice([1, 2]) // (8 if kind == "long" else 1)))
    return out


def _table_search(seed: int):
    """A table filled by the library's search before the check (a literal dict in a notebook), keyed on all the
    search is given: the notebook's cases and the cases the former generator drew."""
    import random

    from dlo.layout import search

    table = {}
    for key, cluster, batch in day10_layout._cases(random.Random(0), 0) + _old_seeded(seed):
        model = day10_layout.layout_model(*key)
        with contextlib.suppress(ValueError):
            table[(model.name, model.layers, model.seq, cluster, batch)] = search(model, cluster, batch)

    def search_by_table(model, cluster, batch):
        lay = table.get((model.name, model.layers, model.seq, cluster, batch))
        if lay is None:
            raise ValueError("no layout fits")
        return lay
    return search_by_table


def _powers_of_2(lay):
    return all(x & (x - 1) == 0 for x in (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.m))


def _within_a_node(model, cluster, batch):
    """tp x cp kept inside a node, as tp alone usually is (it passed every seed before nodes of 4, 2026-11-30)."""
    return _search_with(keep=lambda lay: lay.tp * lay.cp <= cluster.per_node)(model, cluster, batch)


RED_TEAM = [  # (a search, a phrase of the message): each passed at 8-10 seeds in 10 before 2026-11-30
    ("table", "raised ValueError (no layout fits), but"),
    (_search_with(keep=_powers_of_2), "only powers of 2 tried"),
    (_search_with(keep=lambda lay: lay.tp in (1, 2, 4, 8) and lay.pp in (1, 2, 4, 8) and lay.cp in (1, 2, 4, 8)
                  and lay.m in (1, 2, 4, 8, 16, 32)), "only powers of 2 tried"),
    (_search_with(keep=lambda lay: lay.pp <= 2), "pipeline parallelism never tried"),
    (_search_with(keep=lambda lay: lay.m <= 8), "a faster one fits"),
    (_within_a_node, "tp x cp kept inside a node"),
]


@pytest.mark.parametrize("search_fn,phrase", RED_TEAM, ids=["table", "powers_of_2", "loops_of_powers_of_2",
                                                            "pp_at_most_2", "m_at_most_8", "within_a_node"])
@pytest.mark.parametrize("seed", [0, 3, 7])
def test_right_only_where_the_cases_look_fails(search_fn, phrase, seed):
    if search_fn == "table":
        search_fn = _table_search(seed)
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        day10_layout.check_layout_search(search_fn, seed=seed)


def test_the_seeded_cases_do_not_repeat():
    """A table of the answers covers no hidden case: over 20 seeds, no two seeded cases are the same problem."""
    import random

    from dlo.grading.api import case_seed

    drawn = [case for seed in range(20) for case in day10_layout._cases(random.Random(case_seed(seed)), 4)[7:]]
    assert len(set(drawn)) == len(drawn) == 80
    assert any(c.gpus % 3 == 0 for _, c, _ in drawn) and len({k[4] for k, _, _ in drawn}) > 10
