"""What a rank holds while a Day 7 exercise runs on it (issue 26): its own blocks of the layers it
splits, never another rank's, and no seed.

Each spy is the solution notebook's class (so the check passes: the honest code is unaffected) that,
once built on a rank, records every finite float64 value in the rank's memory (every tensor the
garbage collector tracks: the worker's arguments, its callers' frames, whatever a student's code
could reach) beside the values of the blocks it kept, and whether a seed is in a caller's frame.
Rank r's memory must hold no value of rank s's blocks; that it holds its own shows the search finds
a block where there is one. The hostile submissions that try to use the whole layer are in
test_rank_parts.py.
"""

from __future__ import annotations

import gc
import os
import pickle
import uuid

import pytest
import torch
import torch.distributed as dist

from dlo.checks import day7

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.trust]  # a hostile class's evidence (issue 26): its own CI step, pytest -m trust


@pytest.fixture(scope="module")
def sol():
    from tests.checks.conftest import load_solution

    return load_solution("day7_tensor_parallel")


def record_what_the_rank_holds(folder: str, kind: str, kept) -> None:
    """On a rank: the finite float64 values in its memory, the values of the blocks it `kept`, and
    whether a caller's frame holds a seed, written to `folder`."""
    from tests.checks.test_rank_parts import seed_on_the_stack  # here: the ranks import this module

    seen: set[float] = set()
    gc.unfreeze()  # a rank freezes what it inherited (dlo.distributed._worker): out of get_objects' sight till then
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.dtype == torch.float64 and not obj.is_meta:
            values = obj.detach().flatten()
            seen.update(values[values.isfinite()].tolist())
    mine = {float(v) for w in kept for v in w.detach().flatten().tolist()}
    record = {"rank": dist.get_rank(), "kind": kind, "seed": seed_on_the_stack(), "kept": mine, "seen": seen}
    with open(os.path.join(folder, f"{kind}-{dist.get_rank()}-{uuid.uuid4().hex}.pkl"), "wb") as f:
        pickle.dump(record, f)


def spy(cls, folder: str, weights: tuple[str, ...]):
    """`cls` recording what its rank holds once it is built (`weights`: the split ones it keeps)."""
    class Spy(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            kept = [self.get_parameter(w) for w in weights]
            record_what_the_rank_holds(folder, cls.__name__, kept)
    return Spy


def assert_only_own_blocks(folder, kinds: set[str]) -> None:
    """Per kind of layer: no seed on any rank, each rank's own blocks found in its memory, and no
    value of another rank's blocks there."""
    records = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            records.append(pickle.load(f))
    assert {r["kind"] for r in records} == kinds
    for kind in kinds:
        mine = [r for r in records if r["kind"] == kind]
        assert {r["rank"] for r in mine} == {0, 1}
        for a in mine:
            assert not a["seed"], f"{kind}: a seed on rank {a['rank']}"
            assert a["kept"] and a["kept"] <= a["seen"], f"{kind}: the search missed rank {a['rank']}'s own block"
            for b in mine:
                if b["rank"] != a["rank"]:
                    leaked = a["seen"] & b["kept"]
                    assert not leaked, f"{kind}: rank {a['rank']} holds {len(leaked)} of rank {b['rank']}'s values"


def test_linears_each_rank_holds_only_its_blocks(sol, ranks, tmp_path):
    col = spy(sol.ColumnParallelLinear, str(tmp_path), ("weight", "bias"))
    row = spy(sol.RowParallelLinear, str(tmp_path), ("weight",))  # its bias is replicated
    day7.check_tp_linears(sol.f, sol.g, col, row, seed=1)
    assert_only_own_blocks(tmp_path, {"ColumnParallelLinear", "RowParallelLinear"})


def test_swiglu_each_rank_holds_only_its_blocks(sol, ranks, tmp_path):
    day7.check_tp_swiglu(spy(sol.TensorParallelSwiGLU, str(tmp_path), ("w1.weight", "w2.weight", "w3.weight")))
    assert_only_own_blocks(tmp_path, {"TensorParallelSwiGLU"})


def test_attention_each_rank_holds_only_its_heads(sol, ranks, tmp_path):
    weights = ("wq.weight", "wk.weight", "wv.weight", "wo.weight")
    day7.check_tp_attention(spy(sol.TensorParallelAttention, str(tmp_path), weights))
    assert_only_own_blocks(tmp_path, {"TensorParallelAttention"})


def test_sequence_parallel_each_rank_holds_only_its_blocks(sol, ranks, tmp_path):
    block = spy(sol.SequenceParallelMLP, str(tmp_path), ("w1.weight", "w2.weight", "w3.weight"))
    day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, block)
    assert_only_own_blocks(tmp_path, {"SequenceParallelMLP"})
