"""dlo.experiments.day5_reshard: FSDP2's reshard_after_forward and prefetching counted on a fake
process group of 8 ranks, against sizes counted by hand on the tiny Llama."""

import pytest

from dlo.claims import AGREES, DISAGREES, NOT_MEASURABLE
from dlo.experiments import day5_reshard as R
from dlo.registry import DAYS

TINY = DAYS["day5_fsdp"].presets["tiny"]
# the tiny Llama by hand (fp32): root = embedding 256 x 64 + final norm 64 (the head is tied);
# block = q, o 64 x 64, k, v 32 x 64, w1, w3 176 x 64, w2 64 x 176, two norms of 64
ROOT = 4 * (256 * 64 + 64)
BLOCK = 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64 + 2 * 64)
PSI = ROOT + R.BLOCKS * BLOCK


@pytest.fixture(scope="module")
def rows():
    return R.reshard_prefetch(TINY, 8)


def _at(rows, raf, d):
    return next(r for r in rows if r["reshard_after_forward"] == raf and r["prefetch"] == d)


def test_counts_and_bytes_match_the_hand_count(rows):
    assert [(r["reshard_after_forward"], r["prefetch"]) for r in rows] == R.variants(8)
    assert (rows[0]["root"], rows[0]["block"], rows[0]["psi"]) == (ROOT, BLOCK, PSI)
    units = R.BLOCKS + 1
    for raf in (True, False, 4):
        for d in (0, 1):
            c = _at(rows, raf, d)["comm"]
            assert (c["all_gather (forward)"]["calls"], c["all_gather (forward)"]["bytes"]) == (units, PSI)
            assert (c["reduce_scatter (backward)"]["calls"], c["reduce_scatter (backward)"]["bytes"]) == (units, PSI)
            back = c.get("all_gather (backward)", {"calls": 0, "bytes": 0, "sent": 0})
            assert (back["calls"], back["bytes"]) == ((0, 0) if raf is False else (units, PSI))
            assert back["sent"] == {True: 7 / 8 * PSI, False: 0, 4: 3 / 4 * PSI}[raf]  # ring over 8 or 4 ranks


def test_peaks_match_the_units_held(rows):
    peak = {(r["reshard_after_forward"], r["prefetch"]): r["peak"] for r in rows}
    assert peak[(True, 0)] == {"forward": ROOT + BLOCK, "backward": ROOT + 2 * BLOCK}  # implicit backward prefetch
    assert peak[(True, 1)] == {"forward": ROOT + 2 * BLOCK, "backward": ROOT + 2 * BLOCK}  # one more unit
    assert peak[(False, 0)] == peak[(False, 1)] == {"forward": PSI, "backward": PSI}
    assert peak[(4, 0)] == {"forward": ROOT + BLOCK + 3 * BLOCK // 4, "backward": ROOT + 2 * BLOCK + 3 * BLOCK // 4}


def test_claims_agree_and_a_wrong_count_disagrees(rows):
    claims = R.reshard_claims(rows)
    assert [c.verdict for c in claims[:-1]] == [AGREES] * (len(claims) - 1)
    assert claims[-1].verdict == NOT_MEASURABLE  # time, on a fake process group
    wrong = [dict(r, peak={**r["peak"], "forward": r["peak"]["forward"] + BLOCK}) for r in rows]  # one block more
    assert DISAGREES in [c.verdict for c in R.reshard_claims(wrong)]
    assert len(R.table(rows)) == len(rows)


def test_bad_world_refused_in_one_line():
    with pytest.raises(ValueError, match="even world size of at least 4"):
        R.reshard_prefetch(TINY, 2)
    with pytest.raises(ValueError, match="world_size=64"):
        R.reshard_prefetch(TINY, 64)
