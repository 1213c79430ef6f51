"""dlo.claims_audit: the printed claims tables are read back and every verdict checked against its evidence."""

import dataclasses

import pytest

from dlo import claims as C
from dlo import estimates as E
from dlo.claims_audit import audit_notebook, audit_row, audit_text, parse_tables


def _table() -> list[C.Claim]:
    times = C.timed(E.median_interval([1.0, 1.1, 0.9, 1.05]), device="cpu", cores=2)
    return [
        C.Claim("bf16 matches fp32", "slides", "same", C.between(-0.05, 0.05),
                E.paired_difference([0, .01, -.01], [0] * 3)),
        C.Claim("16 B/param", "ZeRO", "16", C.approx(16, abs_tol=0.5), E.exact(16)),
        C.Claim("step under 2 s", "slides", "< 2 s", C.at_most(2.0), times),
        C.Claim("LAMB beats AdamW", "You et al.", "> 0", C.at_least(0),
                E.difference(E.accuracy(0.6, 512), E.accuracy(0.5, 512))),
        C.by_construction(">= 1 skip", "Micikevicius et al.", ">= 1", "a 2^40 scale forces it", E.exact(2)),
        C.not_measurable("H100 speed-up", "slides", "2x", "no GPU"),
    ]


def test_the_printed_table_reads_back_and_passes():
    text = "some output\n" + C.claims_table(_table()) + "\n\n{'agrees': 2}\n"
    (rows,) = parse_tables(text)
    assert [r["verdict"] for r in rows] == ["agrees", "agrees", "agrees", "not measurable here (one seed)",
                                            "by construction", "not measurable here"]
    assert rows[0]["evidence"] == "3 repeats, paired by seed" and rows[2]["evidence"].startswith("4 timings, 1 rank(s)")
    assert rows[3]["evidence"] == "512 test examples, unpaired"  # shown, and no evidence: "one seed"
    assert audit_text(text) == []


def test_rows_without_their_evidence_are_caught():
    ok = {"claim": "c", "verdict": "agrees", "evidence": "3 repeats"}
    assert audit_row(ok) == []
    assert audit_row({**ok, "evidence": "2 repeats"}) == ["'c': agrees from 2 repeats (< 3)"]
    assert "without a stated basis" in audit_row({**ok, "evidence": "-"})[0]
    assert "never checked" in audit_row({**ok, "verdict": "disagrees", "evidence": "8 timings"})[0]
    crowded = {**ok, "evidence": "8 timings, 2 rank(s) x 1 thread(s) + kernel on 2 cores, cpu"}
    assert "+ kernel on 2 cores" in audit_row(crowded)[0]
    assert audit_row({**ok, "verdict": "yes"}) == ["'c': unknown verdict 'yes'"]
    # verdicts that are no evidence need none
    assert audit_row({**ok, "verdict": "not measurable here (2 seeds < 3)", "evidence": "2 repeats"}) == []


def test_a_notebook_is_walked_cell_by_cell_with_split_stream_chunks():
    table = C.claims_table(_table())
    half = len(table) // 2
    nb = {"cells": [{"outputs": [{"output_type": "stream", "text": table[:half]},
                                 {"output_type": "stream", "text": [table[half:]]}]},
                    {"outputs": [{"output_type": "execute_result", "data": {"text/plain": "42"}}]}]}
    assert audit_notebook(nb) == (6, [])


def test_a_figure_after_a_table_is_not_read_as_a_row():
    # Day 7's solution prints its claims table and then shows a figure in the same cell: the figure's
    # text/plain ("<Figure size ...>") once read as a row with no verdict
    nb = {"cells": [{"outputs": [{"output_type": "stream", "text": C.claims_table(_table()) + "\n"},
                                 {"output_type": "display_data",
                                  "data": {"image/png": "iVBOR", "text/plain": "<Figure size 800x350 with 1 Axes>"}}]}]}
    assert audit_notebook(nb) == (6, [])


def test_a_line_printed_right_after_a_table_ends_it():
    text = C.claims_table(_table()) + "\nTensorBoard: tensorboard --logdir runs/day6 (the day's 6 claims: 2 agree)\n"
    (rows,) = parse_tables(text)
    assert len(rows) == 6 and audit_text(text) == []


def _audit(claims: list[C.Claim]) -> list[str]:
    return audit_text(C.claims_table(claims))


def test_the_pairing_is_printed_and_an_unpaired_shared_test_set_comparison_is_caught():
    a, b = E.accuracy(0.70, 512), E.accuracy(0.60, 512)
    mcnemar = E.paired_examples([1] * 400 + [0] * 112, [1] * 350 + [0] * 162)
    rows = [C.Claim("int8 keeps the accuracy", "slides", "same", C.between(-0.2, 0.2), mcnemar)]
    assert parse_tables(C.claims_table(rows))[0][0]["evidence"] == "512 paired examples, McNemar"
    assert _audit(rows) == []
    # the estimator refuses it ("one seed"); a row that forced it through anyway is caught where it is printed
    planted = dataclasses.replace(E.difference(a, b), reason="")
    (problem,) = _audit([C.Claim("LAMB beats AdamW", "You et al.", "> 0", C.at_least(0.0), planted)])
    assert problem == ("'LAMB beats AdamW': agrees from an unpaired comparison on a shared test set "
                       "(pair by seed or per example)")
    assert audit_row({"claim": "c", "verdict": "disagrees", "evidence": "512 test examples, unpaired"})
    # over seeds too: two arms' means over their own seeds, on one test set, are not paired by seed
    seeds = E.difference(E.from_samples([0.70, 0.71, 0.69]), E.from_samples([0.60, 0.62, 0.61]),
                         how="mean test accuracy over 3 seeds each, 512 test images")
    (problem,) = _audit([C.Claim("LAMB beats AdamW", "You et al.", "> 0", C.at_least(0.0), seeds)])
    assert "unpaired comparison on a shared test set" in problem
    # unpaired timings (two medians) are no shared test set; an exact factor is no second arm
    timings = "8 timings, unpaired, 1 rank(s) x 1 thread(s) on 2 cores, cpu"
    assert audit_row({"claim": "c", "verdict": "agrees", "evidence": timings}) == []
    assert E.ratio(a, E.exact(2.0)).pairing == "" and E.ratio(a, b).pairing == "unpaired"


def test_a_row_measured_by_its_own_formula_is_circular():
    predicted = E.formula(2 * 7 / 8, "2(N-1)/N at N = 8")
    with pytest.raises(ValueError, match="circular"):
        C.Claim("the ring sends 2(N-1)/N", "Patarasuk & Yuan 2009", "1.75 n", C.approx(1.75, rel=1e-3), predicted)
    # labelled, it is shown and passes; printed as evidence (a table assembled by hand), it is caught
    shown = C.by_construction("the ring sends 2(N-1)/N", "Patarasuk & Yuan 2009", "1.75 n", "the formula itself",
                              predicted, C.approx(1.75, rel=1e-3))
    assert shown.row()["evidence"] == "formula" and _audit([shown]) == []
    (problem,) = audit_text(C.claims_table([shown]).replace("by construction", "agrees         "))
    assert "computed by a formula (circular)" in problem
    # a measurement held to its prediction keeps the measurement's kind (not circular)
    assert E.ratio(E.exact(1.74), predicted).kind == "exact"
    assert E.ratio(E.median_interval([1, 2, 3]), predicted).basis == "3 timings"


def test_tables_built_by_the_days_code_pass():
    from dlo.experiments import day6_report, day8

    seeds = [{"seed": k, "sparsity": 0.9, "fp32": 0.6 + 0.002 * k, "int8 channel": 0.6, "int4 tensor": 0.55,
              "int4 group": 0.58, "int2 tensor": 0.2, "int2 group": 0.5, "PTQ": 0.4, "float ft + PTQ": 0.45,
              "QAT": 0.57 - 0.001 * k, "one-shot + ft": 0.48, "gradual": 0.49 + 0.003 * k, "rewind": 0.57,
              "random re-init": 0.55 + 0.002 * k, "labels only": 0.58, "distilled": 0.6 - 0.001 * k,
              "student/teacher params": 0.2} for k in range(3)]
    rows = day8.claims(seeds, 512, None) + day6_report.zero_bubble_claims()
    text = C.claims_table(rows)
    assert "paired by seed" in text and audit_text(text) == []


def test_the_command_walks_every_notebook_below_a_folder(tmp_path, capsys):
    """`python -m dlo.claims_audit DIR` (make run's last step): exit 0 when every table holds, 1 with the
    problem named when one row does not, 2 for a path that is not there."""
    import json

    from dlo.claims_audit import main

    good = {"cells": [{"outputs": [{"output_type": "stream", "text": C.claims_table(_table())}]}]}
    (tmp_path / "day1").mkdir()
    (tmp_path / "day1" / "day1.ipynb").write_text(json.dumps(good))
    assert main([str(tmp_path)]) == 0 and "6 claims rows, no problem(s)" in capsys.readouterr().out
    bad = C.claims_table(_table()).replace("agrees", "yes", 1)
    (tmp_path / "day2.ipynb").write_text(json.dumps({"cells": [{"outputs": [{"output_type": "stream", "text": bad}]}]}))
    assert main([str(tmp_path)]) == 1 and "unknown verdict 'yes'" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2


# ----------------------------------------------------------------------------- issue 34: faults a verdict cannot hide

def test_a_measured_side_the_code_under_test_reports_about_itself_is_self_verification():
    """Day 4's PowerSGD row read its bytes from PowerSGDState's own bookkeeping; Day 2's 16 bytes per
    parameter counted the copies mixed_precision_bytes built: `self_reported` marks them, Claim refuses
    them as evidence, and the audit catches one printed as evidence or said so in its "how"."""
    own = E.self_reported(22_648, "PowerSGDState: 22,648 B all-reduced / 22,648 B")
    assert own.basis == "exact, self-reported" and E.ratio(own, E.exact(22_648)).provenance == E.SELF_REPORTED
    with pytest.raises(ValueError, match="self-verification"):
        C.Claim("PowerSGD all-reduces (n + m) r values", "Vogels et al. 2019", "the formula", C.approx(1, rel=1e-3),
                E.ratio(own, E.exact(22_648)))
    shown = C.by_construction("PowerSGD all-reduces (n + m) r values", "Vogels et al. 2019", "the formula",
                              "the engine's own count of what it sends", E.ratio(own, E.exact(22_648)))
    assert _audit([shown]) == []
    (problem,) = audit_text(C.claims_table([shown]).replace("by construction", "agrees         "))
    assert "reports about itself (its evidence is self-reported)" in problem
    # the "how" alone: the day's printed row of today (an exact count read from the state's bookkeeping)
    row = {"claim": "PowerSGD", "verdict": "agrees", "evidence": "exact",
           "how": "PowerSGDState: 22,648 B all-reduced / 22,648 B"}
    (problem,) = audit_row(row)
    assert "'PowerSGDState:'" in problem and "self-verification" in problem
    for how in ("CommCounter, bytes sent per step restates the engine's own compression", "by its own counter"):
        assert audit_row({**row, "how": how}), how
    # counters outside the code under test, and the same words on a row that is no evidence, pass (Day 3's
    # offload row on the H200: the device's tensors of the optimizer's state, summed by dlo.measure)
    for how in ("CommCounter: bytes of its sends / n", "TCP socket counters (TCP_INFO), 5 trials",
                "counted (held_bytes) after a step", "saved-tensor meter, exact",
                "state bytes on the device side, by accounting (dlo.measure)"):
        assert audit_row({**row, "how": how}) == [], how
    assert audit_row({**row, "verdict": "by construction"}) == []


def test_an_agreeing_row_whose_control_could_not_fail_is_caught():
    """Day 8's DistilBERT row: control 0.997 [0.965, 1.03] against ">= 0.97" escaped "the control meets it
    too" only because its interval was wider; printed today the control carries its verdict, and a table
    printed before that is judged from its interval and the "tested as" region."""
    region = C.at_least(0.97, ">= 0.97")
    keeps = E.from_samples([0.99, 1.0, 1.01])
    wide, low = E.from_samples([0.96, 1.0, 1.03]), E.from_samples([0.80, 0.81, 0.82])
    inconclusive = C.Claim("keeps 97%", "Sanh et al. 2019", ">= 0.97", region, keeps, control=wide)
    assert inconclusive.verdict == C.INCONCLUSIVE and _audit([inconclusive]) == []
    sound = C.Claim("keeps 97%", "Sanh et al. 2019", ">= 0.97", region, keeps, control=low)
    assert sound.verdict == C.AGREES and _audit([sound]) == []
    # planted: the same row printed "agrees" (the table of the 2026-11-28 run, control without its verdict)
    old = {"claim": "keeps 97%", "tested as": ">= 0.97", "evidence": "3 repeats, paired by seed",
           "verdict": "agrees", "control": "0.997 [0.965, 1.03]"}
    (problem,) = audit_row(old)
    assert "its control (0.997 [0.965, 1.03]) does not disagree: its interval reaches the region" in problem
    assert audit_row({**old, "control": "0.8 [0.75, 0.85]"}) == []
    assert "does not disagree: inconclusive at this scale" in audit_row(
        {**old, "control": "0.997 [0.965, 1.03] (inconclusive at this scale)"})[0]
    assert "has no verdict" in audit_row({**old, "tested as": "much better", "control": "0.9"})[0]
    for tested, control, bad in ((">= 0.97", "0.99", True), ("gap > 0", "-0.1 [-0.2, -0.05]", False),
                                 ("ratio 1 +- 0.1", "1.05 [0.98, 1.12]", True), ("1.10 .. 1.40", "1.6", False),
                                 ("[-0.05, 0.05]", "0.049", True), ("<= 0.25", "1,000", False)):
        assert bool(audit_row({**old, "tested as": tested, "control": control})) is bad, (tested, control)


def test_a_gpu_claim_judged_on_cpu_timings_is_caught():
    """Day 1's "one b256 step costs less than 8 b32 steps" (large batches use the hardware better) was judged
    on CPU medians; the GPU-claim path (timed(..., gpu_claim=True)) makes it not measurable there, and
    marks the evidence of a GPU claim timed on a GPU."""
    ratio = E.ratio(E.median_interval([8.0, 8.2, 7.9, 8.1]), E.median_interval([2.0, 2.1, 1.9, 2.05]))
    on_cpu = C.timed(ratio, device="cpu", threads=2, cores=2)
    planted = C.Claim("one b256 step costs less than 8 b32 steps", "Goyal et al. 2017",
                      "large batches use the hardware better", C.at_least(1.0, "ratio > 1"), on_cpu)
    (problem,) = _audit([planted])
    assert "a GPU claim ('the hardware') judged on timings on cpu" in problem
    through = C.Claim(planted.claim, planted.source, planted.claimed, planted.region,
                      C.timed(ratio, device="cpu", gpu_claim=True, cores=2))
    assert through.verdict.startswith(C.NOT_MEASURABLE) and _audit([through]) == []
    on_gpu = C.Claim(planted.claim, planted.source, planted.claimed, planted.region,
                     C.timed(ratio, device="cuda", gpu_claim=True, cores=2))
    assert on_gpu.row()["evidence"].endswith("cuda, GPU claim") and _audit([on_gpu]) == []
    # a CPU claim timed on a CPU passes: no GPU word in its claim, claimed value or source
    amdahl = C.Claim("the fix speeds the step up by 1 / (1 - share)", "Amdahl's law", "2x", C.approx(2, rel=0.5),
                     on_cpu)
    assert _audit([amdahl]) == []
    for words in ("GPU 0 has low utilization", "MFU of 40%", "tensor cores", "H100 speed-up"):
        row = {"claim": "c", "claimed": words, "verdict": "agrees",
               "evidence": "8 timings, 1 rank(s) x 1 thread(s) on 2 cores, cpu"}
        assert "a GPU claim" in audit_row(row)[0], words


def test_an_injected_effect_counted_as_evidence_is_caught():
    """Day 8's SmoothQuant and AWQ rows on injected outlier channels hold by design: a demonstration of the
    mechanism is "by construction"; counted as evidence, the audit catches it."""
    gap = E.paired_examples([1] * 500 + [0] * 12, [1] * 400 + [0] * 112,
                            how="McNemar paired, outlier channels injected x20 into 2 of 64 dims")
    planted = C.Claim("SmoothQuant recovers what W8A8 loses", "Xiao et al. 2023", "recovers", C.at_least(0.0), gap)
    (problem,) = _audit([planted])
    assert "put there itself ('injected')" in problem
    shown = C.by_construction(planted.claim, planted.source, planted.claimed,
                              "a demonstration of the mechanism on injected outliers", gap, C.at_least(0.0))
    assert _audit([shown]) == []
    for how in ("planted outliers", "on synthetic outliers", "a scale started at 2^40 on purpose"):
        assert audit_row({"claim": "c", "verdict": "agrees", "evidence": "exact", "how": how}), how
    # a real measurement passes, synthetic data included (the tiny profile's deterministic data)
    assert audit_row({"claim": "c", "verdict": "agrees", "evidence": "exact",
                      "how": "max |x| / median over channels, deterministic synthetic data"}) == []
