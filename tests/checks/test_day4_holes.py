"""A red team's Day 4 cheats that scored (2026-12-02), and the false negative it found: each cheat now fails its
check with a message naming the mistake, and the solution notebook still passes every check changed for them.

The cheats are written as a student's cells (`tests.student_cell`: a module nothing imports, shipped to the ranks
by value, as a notebook's): torch DDP's C++ Reducer and start-up sync doing exercises 2 and 3, an all-reduce
after backward relabelled "backward", Day 7's collective matmul ring doing exercise 1, accumulation's watches fed
by calling their hooks, metrics through files, and a right sampler failed by chance.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo.checks import day4
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def pooled(ranks):
    """Every check's ranks come from the module's pool (tests.rank_pool)."""
    yield


@pytest.fixture(scope="module")
def solution():
    return load_solution("day4_ddp")


def cell(source: str):
    return student_cell(source, "day4_holes_student", torch=torch, nn=nn, dist=dist)


# ----------------------------------------------------------------------------- 1, 4: torch DDP's engine

BUCKET_REDUCER = '''
class BucketDDP(nn.Module):
    """torch DDP's C++ engine: its start-up sync, its bucket assignment, its Reducer."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        from torch.distributed.utils import _sync_module_states
        pg = dist.distributed_c10d._get_default_group()
        _sync_module_states(module, pg, 250 * 2**20, 0, set())
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int(bucket_cap_mb * 2**20)
        idx, limits = dist._compute_bucket_assignment_by_size(params, [cap], [False] * len(params))
        self.reducer = dist.Reducer(params, list(reversed(idx)), list(reversed(limits)), pg,
                                    [False] * len(params), cap, False, False, {}, cap)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.reducer.prepare_for_forward()
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.reducer.prepare_for_backward([])
        return out

    def finish_gradient_synchronization(self):
        pass


class ReducerOnly(BucketDDP):
    """The Reducer alone, the start-up broadcast written out (dist.broadcast is the exercise's)."""

    def __init__(self, module, bucket_cap_mb=25.0):
        nn.Module.__init__(self)
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, 0)
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int(bucket_cap_mb * 2**20)
        c10d = torch._C._distributed_c10d
        idx, limits = c10d._compute_bucket_assignment_by_size(params, [cap], [False] * len(params))
        self.reducer = c10d.Reducer(
            params, list(reversed(idx)), list(reversed(limits)), dist.distributed_c10d._get_default_group(),
            [False] * len(params), cap, False, False, {}, cap)
'''

NAIVE_TORCH = '''
def broadcast_parameters(module):
    """torch DDP's own start-up broadcast."""
    from torch.distributed.utils import _sync_module_states
    _sync_module_states(module, dist.distributed_c10d._get_default_group(), 250 * 2**20, 0, set())


def broadcast_coalesced(module):
    tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
    dist._broadcast_coalesced(dist.distributed_c10d._get_default_group(), tensors, 250 * 2**20, 0)


def broadcast_ok(module):
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, 0)


def all_reduce_gradients(module):
    """torch DDP's default comm hook's averaging all-reduce, per gradient."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _allreduce_fut
    pg = dist.distributed_c10d._get_default_group()
    for f in [_allreduce_fut(pg, p.grad) for p in module.parameters() if p.grad is not None]:
        f.wait()


def all_reduce_mean(module):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
'''


def test_bucket_ddp_from_torch_s_reducer_is_off_limits():
    """Red team item 1 (4/4 before): the Reducer and its bucket assignment, reached by either module's name."""
    student = cell(BUCKET_REDUCER)
    with pytest.raises(AssertionError, match="_sync_module_states is off limits"):
        day4.check_bucket_ddp(student.BucketDDP, seed=0)
    with pytest.raises(AssertionError, match="_compute_bucket_assignment_by_size is off limits"):
        day4.check_bucket_ddp(student.ReducerOnly, seed=0)


@pytest.mark.parametrize("bcast,reduce,phrase", [
    ("broadcast_parameters", "all_reduce_mean", "_sync_module_states is off limits"),
    ("broadcast_coalesced", "all_reduce_mean", "_broadcast_coalesced is off limits"),
    ("broadcast_ok", "all_reduce_gradients", "_allreduce_fut is off limits")])
def test_naive_ddp_from_torch_s_internals_is_off_limits(bcast, reduce, phrase):
    """Red team item 4 (2/2 before): DDP's start-up sync and its default comm hook's all-reduce."""
    student = cell(NAIVE_TORCH)
    with pytest.raises(AssertionError, match=phrase):
        day4.check_naive_ddp(getattr(student, bcast), getattr(student, reduce), seed=0)


def test_the_ddp_list_resolves():
    """Every name of the DDP exercises' list resolves in this torch (one that does not stops the check)."""
    from dlo.grading.targets import forbidden_targets

    for path in day4.DDP:
        assert forbidden_targets(path), path
    assert {"torch.distributed.Reducer", "torch.distributed.utils._sync_module_states",
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks._allreduce_fut"} <= set(day4.DDP)


# ----------------------------------------------------------------------------- 2: "during backward" from autograd

BUCKET_AFTER = '''
class Relabelled(nn.Module):
    """No hooks, no overlap: everything after backward; the counter's phase relabelled "backward"."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, 0)
        cap, self.buckets, cur, size = bucket_cap_mb * 2 ** 20, [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reduce(self):
        for b in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in b]) / dist.get_world_size()
            dist.all_reduce(flat, async_op=True).wait()
            for p, g in zip(b, flat.split([p.numel() for p in b])):
                p.grad.copy_(g.view_as(p))

    def finish_gradient_synchronization(self):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        for m in _get_current_dispatch_mode_stack():
            if hasattr(m, "phase"):
                m.phase = "backward"
        self._reduce()


class InABackwardOfItsOwn(Relabelled):
    """The same all-reduces after backward, launched from a hook of a one-element backward of its own."""

    def finish_gradient_synchronization(self):
        x = torch.zeros(1, requires_grad=True)
        x.register_post_accumulate_grad_hook(lambda _: self._reduce())
        (x * 1).sum().backward()
'''


@pytest.mark.parametrize("name", ["Relabelled", "InABackwardOfItsOwn"])
def test_bucket_all_reduces_after_backward_fail_whatever_the_label(name):
    """Red team item 2 (4/4 before): "during backward" was the counter's phase label, which the student's code
    set; now it is the backward pass autograd's engine runs at the call, the step's own."""
    with pytest.raises(AssertionError, match=re.escape("launched with async_op=True from the gradient hooks, "
                                                       "during loss.backward()")):
        day4.check_bucket_ddp(getattr(cell(BUCKET_AFTER), name), seed=0)


# ----------------------------------------------------------------------------- 3: the library's other rings

RING_ASYNC_TP = '''
def ring_all_reduce(tensor):
    """The library's ring reduce-scatter and ring all-gather (Day 7's collective matmul) with a 1x1 identity."""
    from dlo.distributed.async_tp import all_gather_matmul, matmul_reduce_scatter
    flat = tensor.reshape(-1)
    buf = torch.cat([flat, flat.new_zeros((-flat.numel()) % dist.get_world_size())]).unsqueeze(1)
    one = torch.ones(1, 1, dtype=tensor.dtype)
    full = all_gather_matmul(matmul_reduce_scatter(buf, one, dim=0), one, dim=0)
    tensor.copy_(full[:flat.numel(), 0].view_as(tensor))
    return tensor
'''


def test_ring_from_the_library_s_collective_matmul_is_off_limits():
    """Red team item 3 (3/3 before)."""
    with pytest.raises(AssertionError, match="matmul_reduce_scatter is off limits"):
        day4.check_ring_all_reduce(cell(RING_ASYNC_TP).ring_all_reduce, seed=0)
    from dlo.checks.day4_ring import LIBRARY_RINGS
    assert {"dlo.distributed.async_tp.*", "dlo.distributed.context_parallel.*",
            "dlo.distributed.pipeline_comms.*"} <= set(LIBRARY_RINGS)


# ----------------------------------------------------------------------------- 5: accumulation's watches

ACCUM_FAKE = '''
def hooks_called(model, optimizer, loss_fn, xs, ys):
    """One forward and backward of the whole batch; the grader's hooks fed what accumulation would show."""
    net = model.module
    for x in xs:
        for h in list(net._forward_hooks.values()) + list(net._forward_pre_hooks.values()):
            try:
                h(net, (x,), net.forward(x).detach())
            except TypeError:
                h(net, (x,))
    p0 = next(net.parameters())
    with model.no_sync():
        for _ in xs[:-1]:
            for h in list(p0._post_accumulate_grad_hooks.values()):
                h(p0)
    loss_fn(net.forward(torch.cat(xs)), torch.cat(ys)).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()


def dummy_backwards(model, optimizer, loss_fn, xs, ys):
    """Each micro-batch's forward for show (no_grad), k-1 backward passes of a zero through the first
    parameter in no_sync, then one forward and backward of the whole batch."""
    net = model.module
    with torch.no_grad():
        for x in xs:
            model(x)
    p0 = next(net.parameters())
    with model.no_sync():
        for _ in xs[:-1]:
            (p0 * 0).sum().backward()
    loss_fn(net.forward(torch.cat(xs)), torch.cat(ys)).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()
'''


@pytest.mark.parametrize("name,phrase", [
    ("hooks_called", "the grader's watches (the first parameter's post-accumulate-grad hook, the module's forward "
                     "hook) were called outside"),
    ("dummy_backwards", "expected each micro-batch's loss, from its own forward, backpropagated once")])
def test_accumulation_watches_count_what_autograd_does(name, phrase):
    """Red team item 5 (2/2 before): the watches' hooks called directly, or fed by backward passes of nothing."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        day4.check_accumulation_step(getattr(cell(ACCUM_FAKE), name), seed=0)


# ----------------------------------------------------------------------------- 6: metrics through an all-reduce

METRICS = '''
def through_files(loss_sum, correct, count):
    """No collective at all: the sums travel beside torch.distributed, through files."""
    import json, os, tempfile, time
    r, w = dist.get_rank(), dist.get_world_size()
    d = os.path.join(tempfile.gettempdir(), f"dlo-holes-{os.getppid()}-{os.environ.get('MASTER_PORT', 'x')}-{w}")
    os.makedirs(d, exist_ok=True)
    calls = len([f for f in os.listdir(d) if f.startswith(f"{r}-")])
    with open(f"{d}/{r}-{calls}.tmp", "w") as f:
        json.dump([float(loss_sum), float(correct), float(count)], f)
    os.replace(f"{d}/{r}-{calls}.tmp", f"{d}/{r}-{calls}.json")
    while not all(os.path.exists(f"{d}/{q}-{calls}.json") for q in range(w)):
        time.sleep(0.005)
    rows = [json.load(open(f"{d}/{q}-{calls}.json")) for q in range(w)]
    L, C, N = (sum(x[i] for x in rows) for i in range(3))
    return L / N, C / N


def files_and_a_show(loss_sum, correct, count):
    """The same, and an all-reduce of ones for show."""
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    return through_files(loss_sum, correct, count)
'''


@pytest.mark.parametrize("name,phrase", [
    ("through_files", "the rank made no collective"),
    ("files_and_a_show", "the all-reduce did not take in this rank's loss_sum")])
def test_metrics_need_the_all_reduce_of_the_rank_s_sums(name, phrase, tmp_path):
    """Red team item 6 (2/2 before): the right floats, exchanged through files."""
    import glob
    import os
    import shutil
    import tempfile

    try:
        with pytest.raises(AssertionError, match=re.escape(phrase)):
            day4.check_all_reduce_metrics(getattr(cell(METRICS), name), seed=0)
    finally:
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), "dlo-holes-*")):
            shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- 7: the sampler's false negative

def _rank0_repeats(solution, seed: int, trials: int) -> bool:
    """Whether the check's cases at `seed` (drawn as check_shard_indices draws them, the seed itself outside the
    grader) hold one where the solution gives rank 0 the same shard in epochs e and e + 1."""
    rng = random.Random(seed)
    for _ in range(trials):
        n, w = rng.choice([1, 2, 10, 17, 33, 100]), rng.choice([2, 3, 4, 5])
        s, e = rng.randrange(1000), rng.randrange(5)
        if n >= 10 and solution.shard_indices(n, 0, w, seed=s, epoch=e + 1) == solution.shard_indices(
                n, 0, w, seed=s, epoch=e):
            return True
    return False


def test_the_solution_s_sampler_passes_at_every_seed(solution):
    """Red team item 7 (a right answer lost 2 points in ~1.5% of submissions): rank 0's shard alone was compared
    across epochs, and it is the same in two epochs by chance (n=10, world_size=5: two of the ten indices); now every
    rank's (the whole permutation). Of 2,000 seeds of the hidden call's 20 trials, those where rank 0's shard repeats
    (the ones that failed: ~1.3%) are checked, and a few others (a check costs a second: forbidding, sealing)."""
    risky = [seed for seed in range(2000) if _rank0_repeats(solution, seed, 20)]
    assert len(risky) >= 10 and 149 in risky  # n=10, world_size=5, seed=259, epoch=3: the red team's case
    for seed in risky[:8] + [0, 1, 2]:
        day4.check_shard_indices(solution.shard_indices, seed=seed, trials=20)


def test_the_epoch_rule_still_catches_no_reshuffle():
    def same_every_epoch(n, rank, world_size, seed=0, epoch=0):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return perm[rank::world_size].tolist()

    with pytest.raises(AssertionError, match="gives the same shards as epoch .* on every rank: reshuffle per epoch"):
        day4.check_shard_indices(same_every_epoch, seed=random.Random(0).randrange(100), trials=20)


# ----------------------------------------------------------------------------- the solution still passes

def test_the_solution_passes_the_changed_checks(solution):
    day4.check_ring_all_reduce(solution.ring_all_reduce, seed=1, world_size=3)
    day4.check_naive_ddp(solution.broadcast_parameters, solution.all_reduce_gradients, seed=1, world_size=3)
    day4.check_bucket_ddp(solution.BucketDDP, seed=0)
    day4.check_bucket_ddp(solution.BucketDDP, seed=1, world_size=3, frozen=True)
    day4.check_accumulation_step(solution.accumulation_step, seed=0)
    day4.check_accumulation_step(solution.accumulation_step, seed=1, world_size=3)
    day4.check_all_reduce_metrics(solution.all_reduce_metrics, seed=1, world_size=3)


@pytest.mark.trust
def test_sandboxed(sandbox, capsys):
    """The grader's path: a cheat and the solution in the runner, the reference here."""
    sol = load_solution("day4_ddp")
    sandbox.run(day4.check_bucket_ddp, sol.BucketDDP, seed=0)
    sandbox.run(day4.check_all_reduce_metrics, sol.all_reduce_metrics, seed=0)
    assert "bucket_ddp: ok" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="during loss.backward"):
        sandbox.run(day4.check_bucket_ddp, cell(BUCKET_AFTER).Relabelled, seed=0)
    with pytest.raises(AssertionError, match="were called outside"):
        sandbox.run(day4.check_accumulation_step, cell(ACCUM_FAKE).hooks_called, seed=0)
