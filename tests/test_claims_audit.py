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
