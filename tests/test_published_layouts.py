"""The published layouts' table is consistent and sourced, and the comparison runs (meta device, seconds)."""

from dataclasses import replace

import pytest

from dlo.errors import BadInput
from dlo.published_layouts import PUBLISHED, check_row, compare, compare_all


def test_every_published_row_names_its_table_and_is_consistent():
    assert PUBLISHED
    for row in PUBLISHED:
        check_row(row)
        assert row.fsdp * row.tp * row.pp * row.cp == row.gpus
        assert row.tokens_per_s_gpu > 0 and 0 < row.mem_gib <= row.gpu_mem_gib


@pytest.mark.parametrize("change, says", [(dict(tp=4), "GPUs"), (dict(global_batch=17), "global"),
                                          (dict(source="somewhere"), "table"), (dict(ac="some"), "checkpointing")])
def test_an_inconsistent_row_is_refused(change, says):
    with pytest.raises(BadInput, match=says):
        check_row(replace(PUBLISHED[0], **change))


def test_compare_gives_the_published_run_its_layout_modelled_and_the_search():
    row = next(r for r in PUBLISHED if r.model == "llama3.1-8b" and r.gpus == 8)
    published, theirs, ours = compare(row)
    assert published["tokens/s/GPU"] == row.tokens_per_s_gpu and published["source"].startswith(row.source)
    assert theirs["layout"] == "FSDP 8 x TP 1 x PP 1" and theirs["AC"].startswith("full")
    assert ours["fits"] and ours["tokens/s/GPU"] >= theirs["tokens/s/GPU"]  # the search is never slower


def test_rows_without_a_library_model_are_listed_not_compared():
    rows, skipped = compare_all([r for r in PUBLISHED if r.model == "llama3.1-405b"])
    assert rows == [] and "405b" in skipped[0]



def test_the_context_parallel_rows_are_compared():
    """Issue 36: torchtitan's Table 2 (the 8B at FSDP x CP = 8, 32k to 262k tokens) is compared like the others;
    at 262,144 tokens the search picks their layout, FSDP 1 x CP 8 (FSDP over the cp ranks)."""
    rows = [r for r in PUBLISHED if r.cp > 1]
    assert [r.seq for r in rows] == [65536, 131072, 262144] and all("Table 2" in r.source for r in rows)
    published, theirs, ours = compare(rows[-1])
    assert published["layout"] == theirs["layout"] == ours["layout"] == "FSDP 1 x TP 1 x PP 1 x CP 8"
    assert theirs["fits"] and published["tokens/s/GPU"] == 548
