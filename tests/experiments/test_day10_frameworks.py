"""Day 10's frameworks section: each installed framework's DDP (and DeepSpeed's ZeRO stages) on 2 gloo ranks makes
the updates of dlo's DDP and of one process on the global batch, the control (no gradient average) differs, and a
framework that is absent is skipped with its reason (the course's venv may lack any of them)."""

from __future__ import annotations

import pytest

from dlo import claims as C
from dlo.distributed import launch
from dlo.experiments import day10_frameworks as fw

P = fw.preset(steps=3)


@pytest.fixture(scope="module")
def result():
    """One launch: dlo's DDP and every engine whose package is installed here."""
    names = fw.engines(fw.installed())
    return fw.compare(P, launch(fw.run_ranks, 2, P, names, backend="gloo", timeout=300)), names


def test_dlo_ddp_is_one_process_and_the_control_differs(result):
    res, _ = result
    assert res["engines"][fw.REFERENCE]["vs one process"] <= fw.TOLERANCE
    assert res["control"] > 1e3 * fw.TOLERANCE_FP32_WIRE  # a missing gradient average is seen at either tolerance


@pytest.mark.parametrize("engine,module", [("Accelerate DDP", "accelerate"), ("Fabric DDP", "lightning_fabric"),
                                           ("DeepSpeed ZeRO-1", "deepspeed"), ("DeepSpeed ZeRO-3", "deepspeed"),
                                           ("DeepSpeed ZeRO-2 + optimizer offload", "deepspeed")])
def test_a_framework_makes_the_same_updates(result, engine, module):
    pytest.importorskip(module)
    res, names = result
    assert engine in names
    row = {c.claim.split("'s updates")[0]: c for c in fw.claims(res, 2, P.max_steps)}[engine]
    assert row.verdict == C.AGREES, row.row()


def test_an_absent_framework_is_skipped_with_its_reason():
    found = fw.installed({"accelerate": ("dlo_no_such_module", "accelerate"),
                         "deepspeed": ("dlo_no_such_module_either", "deepspeed")})
    assert found == {"accelerate": None, "deepspeed": None}
    assert fw.engines(found) == []
    lines = fw.skipped(found)
    assert lines[0] == ("accelerate: skipped: not installed (the course's lock has it: `make venv` installs it into an "
                        "older .venv)")
    assert lines[1].startswith("deepspeed: skipped: not installed (not in the course's lock")
    assert fw.engines({"fabric": "2.6.6"}) == ["Fabric DDP"]
    # each engine that did not run is a row with its reason, never dropped
    res = {"control": 0.08, "engines": {"Fabric DDP": {"wrapped as": "-", "vs one process": 0.0, "vs dlo DDP": 0.0}}}
    rows = fw.claims(res, 2, 3, {"accelerate": None, "fabric": "2.6.6", "deepspeed": None})
    verdicts = {c.claim.split("'s updates")[0]: c.verdict for c in rows}
    assert verdicts == {"Fabric DDP": C.AGREES, **{n: C.NOT_MEASURABLE for n in fw.ENGINES if n != "Fabric DDP"}}
    assert "deepspeed is not installed here" in rows[-1].why


def test_a_framework_that_does_not_average_gradients_disagrees():
    res = {"control": 0.08, "engines": {
        "Accelerate DDP": {"wrapped as": "-", "vs one process": 0.08, "vs dlo DDP": 0.08},
        "DeepSpeed ZeRO-2": {"wrapped as": "-", "vs one process": 1.5e-7, "vs dlo DDP": 1.5e-7},
        "Fabric DDP": {"wrapped as": "-", "vs one process": 1.5e-7, "vs dlo DDP": 1e-17}}}
    verdicts = {c.claim.split("'s updates")[0]: c.verdict for c in fw.claims(res, 2, 3)}
    # float32 rounding passes only where the gradients cross the wire in float32 (DeepSpeed)
    assert verdicts == {"Accelerate DDP": C.DISAGREES, "DeepSpeed ZeRO-2": C.AGREES, "Fabric DDP": C.DISAGREES}
