"""Each rank only its own shard, drawn from a secret seed (issue 26).

The vocabulary-parallel cross-entropy (Day 7) and the ZeRO checks (Day 5) used to hand every rank
the seed and the whole problem (the full logits, the global batch): a student's function found the
full logits in its caller's frame, or redrew the case from the seed with a copy of the test bench,
and computed the answer without a byte of communication. Now the grader draws the case (from a
secret seed when it grades) and each rank receives its own part only, deleted before any student
code runs on any rank.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random

import pytest
import torch
import torch.nn.functional as F

from dlo.checks import day7
from dlo.grading.api import DirectSession, case_seed

pytestmark = pytest.mark.usefixtures("one_thread")


def peek_at_the_full_logits(logits, target, group=None):
    """Cross-entropy of the whole logits found on the stack: right, and not a byte sent."""
    import torch.distributed as dist
    for info in inspect.stack():
        for value in info.frame.f_locals.values():
            full = value.get("logits") if isinstance(value, dict) else None
            if isinstance(full, torch.Tensor) and full.shape[-1] > logits.shape[-1]:
                r, v = dist.get_rank(), logits.shape[-1]
                whole = torch.cat([full[:, :r * v], logits, full[:, (r + 1) * v:]], -1)
                return F.cross_entropy(whole, target)
    raise RuntimeError("no full logits on the stack")


def redraw_the_case(logits, target, group=None):
    """The test bench's case drawing, copied from its source (readable on disk), with the test cell's
    seed: the whole logits recomputed on the rank."""
    import torch.distributed as dist
    t, r, v = dist.get_world_size(), dist.get_rank(), logits.shape[-1]
    for seed in (0, 1, 2):
        for trial in range(3):
            rng, gen = random.Random(seed * 10 + trial), torch.Generator().manual_seed(1000 * seed + 50 + trial)
            n, vocab = rng.choice([1, 7, 13]), t * rng.choice([3, 5, 11])
            shift = 800.0 if trial == 1 else 0.0
            full = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * rng.choice([0.5, 3.0]) + shift
            if full.shape == (logits.shape[0], t * v) and torch.equal(full[:, r * v:(r + 1) * v], logits.detach()):
                whole = torch.cat([full[:, :r * v], logits, full[:, (r + 1) * v:]], -1)
                return F.cross_entropy(whole, target)
    raise RuntimeError("the case could not be redrawn")


def test_the_full_logits_are_on_no_rank(ranks):
    with pytest.raises(AssertionError, match="no full logits on the stack"):
        day7.check_vocab_parallel_cross_entropy(peek_at_the_full_logits)


def test_a_graded_case_cannot_be_redrawn(tmp_path, ranks):
    """In a notebook (direct checks) the case comes from the test cell's seed: copying the bench's
    drawing works there, and only there; the grader draws it from a secret seed."""
    from dlo.grading.trusted import LocalSandbox  # here: the ranks import this module (sealed) for its functions

    assert case_seed(3) == 3  # the direct backend: reproducible feedback
    day7.check_vocab_parallel_cross_entropy(redraw_the_case)  # the cheat works where the seed is known
    with LocalSandbox(tmp_path) as sandbox:
        with pytest.raises(AssertionError, match="the case could not be redrawn"):
            sandbox.run(day7.check_vocab_parallel_cross_entropy, redraw_the_case)


def _what_a_rank_holds(mine, tag):
    """A worker: this rank's part, and what is left in the folder the parts came through."""
    folder = next(f.frame.f_locals["shards"] for f in inspect.stack() if "shards" in f.frame.f_locals)
    return {"mine": mine, "tag": tag, "left": sorted(os.listdir(folder))}


def test_each_rank_gets_its_part_and_sees_no_other():
    parts = [{"rank": r, "secret": torch.full((2,), float(r))} for r in range(2)]
    got = DirectSession("shards", ()).on_ranks(_what_a_rank_holds, 2, ("x",), {}, 120, "gloo", per_rank=parts)
    for r, res in enumerate(got):
        assert res["mine"]["rank"] == r and res["mine"]["secret"].tolist() == [float(r)] * 2 and res["tag"] == "x"
        assert res["left"] == []  # every part was taken and deleted before the worker ran


# ----------------------------------------------------------------------------- the runner's own process

class _LoadsTheStudentsCode:
    """Unpickled, it calls a function of the student's (pickle's __reduce__): code that runs wherever
    the captured function is loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_copy_every_part, (self.path,))


def _copy_every_part(path):
    """Where it is loaded: every rank's part of a case found in the process's memory, written to `path`."""
    import gc
    import pickle

    gc.unfreeze()  # a rank freezes what it inherited (dlo.distributed._worker): out of get_objects' sight till then
    for obj in gc.get_objects():
        if type(obj) is dict and obj.get("per_rank"):
            with contextlib.suppress(OSError), open(path, "wb") as f:
                pickle.dump(obj["per_rank"], f)
    return path


def _shards_copier(folder):
    """A daemon (double fork) that copies every rank's shard file it sees into `folder` for a minute."""
    import glob
    import shutil
    import tempfile
    import time

    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                for path in glob.glob(os.path.join(tempfile.gettempdir(), "dlo-shards-*", "rank-*.pkl")):
                    target = os.path.join(folder, os.path.basename(os.path.dirname(path)))
                    os.makedirs(target, exist_ok=True)
                    with contextlib.suppress(OSError):
                        shutil.copyfile(path, os.path.join(target, os.path.basename(path)))
                time.sleep(0.005)
        os._exit(0)


def _leaked_parts(where: str) -> list:
    """Every set of per-rank parts found at `where` (the gc spy's file, or the copier's folders)."""
    import pickle

    if os.path.isfile(where):
        with open(where, "rb") as f:
            return [pickle.load(f)]
    found = []
    for sub in sorted(os.listdir(where)) if os.path.isdir(where) else []:
        ranks = []
        for r in range(8):
            path = os.path.join(where, sub, f"rank-{r}.pkl")
            if not os.path.exists(path):
                break
            with contextlib.suppress(Exception), open(path, "rb") as f:
                ranks.append(pickle.load(f))
        found.append(ranks)
    return found


def cross_entropy_from_a_leak(where):
    """A student's vocab-parallel cross-entropy that sends nothing: the other ranks' logits are read
    from what leaked out of the runner's process (`where`), if anything did."""
    spy = _LoadsTheStudentsCode(where)

    def fn(logits, target, group=None):
        import torch.distributed as dist

        r, path = dist.get_rank(), spy if isinstance(spy, str) else spy.path
        for parts in _leaked_parts(path):
            for trial, mine in enumerate(parts[r] if len(parts) > r else []):
                if mine["logits"].shape == logits.shape and torch.equal(mine["logits"], logits.detach()):
                    whole = torch.cat([logits if k == r else parts[k][trial]["logits"] for k in range(len(parts))], -1)
                    return F.cross_entropy(whole, target)
        raise RuntimeError("nothing leaked from the runner")
    return fn


def splits_and_leaves_a_copier(folder):
    def fn(costs, p):
        _shards_copier(folder)
        return [list(range(len(costs)))] + [[] for _ in range(p - 1)]
    return fn


def test_the_runner_never_loads_the_students_objects_beside_every_ranks_part(tmp_path):
    """The runner's session child used to unpickle the student's captured function (running the
    student's code: `__reduce__`) while it held the request with every rank's part: the code found
    them with `gc` and left them in a file for the ranks. Now that process loads nothing of the
    student's for an on-ranks check; each rank loads the capture after taking its own part."""
    from dlo.grading.trusted import LocalSandbox

    with LocalSandbox(tmp_path / "sb") as sandbox:
        with pytest.raises(AssertionError, match="nothing leaked from the runner"):
            sandbox.run(day7.check_vocab_parallel_cross_entropy, cross_entropy_from_a_leak(str(tmp_path / "leak")))
    assert not (tmp_path / "leak").exists()


def test_what_the_students_code_leaves_running_ends_with_its_check(tmp_path):
    """A student's function, called by one check in the runner, left a daemon watching for shard files;
    the next check's ranks had their parts copied out before they took them. Now the runner kills
    what a session left behind when its child exits."""
    from dlo.checks import day6
    from dlo.grading.trusted import LocalSandbox

    leak = tmp_path / "leak"
    leak.mkdir()
    with LocalSandbox(tmp_path / "sb") as sandbox:
        with pytest.raises(AssertionError):
            sandbox.run(day6.check_split_stages, splits_and_leaves_a_copier(str(leak)))
        with pytest.raises(AssertionError, match="nothing leaked from the runner"):
            sandbox.run(day7.check_vocab_parallel_cross_entropy, cross_entropy_from_a_leak(str(leak)))


def released_cross_entropy(logits, target, group=None):
    raise NotImplementedError()


def test_the_released_stub_is_told_apart_without_ranks_under_the_grader(tmp_path):
    """The runner's stub probe (a grandchild loads the capture): the verdict without starting ranks,
    whose own failure would read 'rank 0 raised NotImplementedError'."""
    from dlo.grading.trusted import LocalSandbox

    with LocalSandbox(tmp_path / "sb") as sandbox:
        with pytest.raises(AssertionError, match="released_cross_entropy raised NotImplementedError on every rank: "
                                                 "the exercise is not done yet"):
            sandbox.run(day7.check_vocab_parallel_cross_entropy, released_cross_entropy)


def _one():
    return 1


def test_a_module_planted_in_the_working_directory_never_runs_on_a_rank(tmp_path, monkeypatch):
    """The runner's working directory is writable by the student's code that runs there, and `python -m`
    put it first on a rank's sys.path: a planted `dlo` package ran in each rank before the rank took
    its shard (and could read every rank's). Ranks start with `python -P` now."""
    from dlo.distributed.launch import launch

    marker = tmp_path / "planted-code-ran"
    (tmp_path / "dlo").mkdir()
    (tmp_path / "dlo" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    assert launch(_one, 1, backend="gloo", timeout=120) == [1]
    assert not marker.exists()
