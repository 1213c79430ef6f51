"""Hostile submissions for the on-ranks checks of Day 4 (issue 26), as test_rank_parts.py does for
Days 5-7: each recomputes the expected result from what it finds in its callers' frames on its rank
(the other ranks' inputs, the whole global batch, every rank's counts) and sends the collectives or
messages the check counts, for show. The checks used to hand every rank the seed and draw the whole
case there, and each of these got full marks; now the case is drawn on the grader's side and each
rank holds only its own part, so there is nothing to recompute from.

The honest submissions pass the same checks in test_day4_checks.py.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks import day4
from tests.checks.test_day4_checks import BucketOk, broadcast_ok
from tests.checks.test_rank_parts import dummy_all_reduce, on_the_stack

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS: dict[int, int] = {}  # per model (by id), the rows of the first batch its forward saw: this rank's shard


def whole_batch(rows: int):
    """The global batch in a caller's frame: world_size times this rank's rows (inputs, then labels)."""
    n = dist.get_world_size() * rows
    x = on_the_stack(lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 2
                     and v.shape[0] == n)
    y = on_the_stack(lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 1
                     and v.shape[0] == n)
    if x is None or y is None:
        raise RuntimeError("no whole batch on the stack")
    return x, y


def full_batch_gradients(module, rows: int) -> None:
    """Every .grad replaced by one process's gradient on the whole batch (autograd.grad: no hook fires)."""
    x, y = whole_batch(rows)
    params = list(module.parameters())
    for p, g in zip(params, torch.autograd.grad(F.cross_entropy(module(x), y), params)):
        p.grad.copy_(g)


# ----------------------------------------------------------------------------- ring all-reduce

def ring_from_the_stack(t):
    """The sum of every rank's input found in a caller's frame; one message around the ring for show."""
    w, r = dist.get_world_size(), dist.get_rank()
    inputs = on_the_stack(lambda v: isinstance(v, list) and len(v) == w
                          and all(isinstance(i, torch.Tensor) and i.shape == t.shape for i in v)
                          and torch.equal(v[r], t))
    if inputs is None:
        raise RuntimeError("no other rank's input on the stack")
    one = torch.zeros(1, dtype=torch.float64)
    for op in [dist.isend(one.clone(), (r + 1) % w), dist.irecv(one, (r - 1) % w)]:
        op.wait()
    t.copy_(torch.stack(inputs).sum(0))


def test_ring_finds_no_other_input_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no other rank's input on the stack"):
        day4.check_ring_all_reduce(ring_from_the_stack, world_size=3)


# ----------------------------------------------------------------------------- naive DDP

def broadcast_and_watch(module):
    """The honest broadcast, and a hook that notes how many rows this rank's forward gets."""
    broadcast_ok(module)
    module.register_forward_pre_hook(note_rows)


def note_rows(module, args) -> None:  # returns None: the input goes on unchanged
    ROWS.setdefault(id(module), args[0].shape[0])


def gradients_from_the_whole_batch(module):
    """The gradient of one process on the whole batch found in a caller's frame; an all-reduce for show."""
    full_batch_gradients(module, ROWS[id(module)])
    dummy_all_reduce()


def test_naive_ddp_finds_no_whole_batch_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no whole batch on the stack"):
        day4.check_naive_ddp(broadcast_and_watch, gradients_from_the_whole_batch)


# ----------------------------------------------------------------------------- bucketed DDP

class BucketFromTheStack(BucketOk):
    """The honest buckets, all-reduced async during backward (for the counts), then every gradient
    overwritten with one process's on the whole batch found in a caller's frame."""

    def forward(self, *args):
        ROWS.setdefault(id(self), args[0].shape[0])
        return self.module(*args)

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        full_batch_gradients(self.module, ROWS[id(self)])


def test_bucket_ddp_finds_no_whole_batch_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no whole batch on the stack"):
        day4.check_bucket_ddp(BucketFromTheStack)


# ----------------------------------------------------------------------------- accumulation

def accumulation_from_the_stack(model, optimizer, loss_fn, xs, ys):
    """The honest micro-batches with no_sync (one all-reduce round, for the count), then the gradient
    of one process on the whole batch found in a caller's frame."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        with model.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
            loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    with model.no_sync():
        full_batch_gradients(model.module, sum(len(y) for y in ys))
    optimizer.step()
    optimizer.zero_grad()


def test_accumulation_finds_no_whole_batch_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no whole batch on the stack"):
        day4.check_accumulation_step(accumulation_from_the_stack)


# ----------------------------------------------------------------------------- metrics

def metrics_from_the_stack(loss_sum, correct, count):
    """Every rank's sums and counts found in a caller's frame (by the check's names); an all-reduce
    for show."""
    frame = next((f.frame.f_locals for f in inspect.stack()[1:]
                  if all(k in f.frame.f_locals for k in ("counts", "losses", "corrects"))), None)
    if frame is None:
        raise RuntimeError("no other rank's counts on the stack")
    dummy_all_reduce()
    total = sum(frame["counts"])
    return sum(frame["losses"]) / total, sum(frame["corrects"]) / total


def test_metrics_find_no_other_counts_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no other rank's counts on the stack"):
        day4.check_all_reduce_metrics(metrics_from_the_stack, world_size=3)
