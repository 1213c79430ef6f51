"""Measurements a student engine cannot fake (issue 33): the bytes a rank sends are counted twice, and what
a ZeRO-1/2 rank keeps shows in its parameters.

The ZeRO checks count each rank's collectives on the rank (`dlo.measure.CommCounter`, beside the
student's engine) and read what its TCP sockets sent from outside it (`dlo.grading.meter`: the kernel's
counters, read by the process that launched the ranks). An engine that rewrites the counter on the rank
- here plain DDP (an all-reduce of the gradients, the whole optimizer on every rank) reporting ZeRO-1's
reduce-scatter and all-gather, with the held-bytes meter scaled to match - passed the check; the sockets
now tell. The instructors' ZeRO engines and FSDP2 recipe agree with their sockets; bytes an FSDP2 recipe sends
beside a patched counter fail. DDP that moves exactly ZeRO-1's bytes (a reduce-scatter and an all-gather of
the gradients) and keeps its optimizer state in numpy, out of every tensor meter's sight, is caught by its
parameters: a disturbed copy stays disturbed. These run real launches (not the tests' reused ranks, which have
no meter), as a notebook's check and through the grader's sandbox.
"""

from __future__ import annotations

import pytest

from dlo.checks import day5
from dlo.grading.trusted import LocalSandbox
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.trust]  # a hostile class's evidence: its own CI step, pytest -m trust

DISGUISED = '''
import gc
import torch
import torch.distributed as dist

def _disguise():
    """Report an all-reduce as ZeRO-1's reduce-scatter and all-gather, and 70% of the bytes held."""
    from dlo.measure import comm
    if getattr(comm.CommCounter, "disguised", False):
        return
    real = comm.CommCounter.__torch_dispatch__

    def dispatch(counter, func, types, args=(), kwargs=None):
        n = len(counter.calls)
        out = real(counter, func, types, args, kwargs)
        for c in counter.calls[n:]:
            if c.kind == "all_reduce":
                c.kind = "reduce_scatter"
                counter.calls.append(comm.CommCall(c.op, "all_gather", c.nbytes, c.sent, c.world_size, c.async_op,
                                                   c.phase))
        return out
    comm.CommCounter.__torch_dispatch__ = dispatch
    comm.CommCounter.disguised = True
    gc.unfreeze()  # the rank froze what it inherited (dlo.distributed._worker): out of get_objects' sight till then
    bench = next(d for d in gc.get_objects() if type(d) is dict and d.get("__name__") == "dlo.checks.day5_worker")
    held = bench["held_bytes"]
    bench["held_bytes"] = lambda *roots: int(0.7 * held(*roots))

class DisguisedDDP(torch.nn.Module):
    """DDP: every rank all-reduces the whole gradient and runs the whole optimizer."""
    def __init__(self, module, optimizer_cls=torch.optim.AdamW, **kw):
        super().__init__()
        _disguise()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)
        self.opt = optimizer_cls(module.parameters(), **kw)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self):
        params = [p for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)
'''


@pytest.fixture(scope="module")
def student():
    return student_cell(DISGUISED, "meters_student")


def test_a_rewritten_comm_meter_fails_a_notebook_s_check(student):
    with pytest.raises(AssertionError, match=r"zero1: the ranks' sockets sent [\d,]+ bytes, the collectives counted"):
        day5.check_zero1(student.DisguisedDDP)


def test_a_rewritten_comm_meter_fails_in_the_sandbox(student, tmp_path):
    with LocalSandbox(tmp_path) as sandbox, pytest.raises(AssertionError, match=r"zero1: the ranks' sockets sent"):
        sandbox.run(day5.check_zero1, student.DisguisedDDP)



GATHERED = '''
import numpy as np
import torch
import torch.distributed as dist

class GatheredGradients(torch.nn.Module):
    """DDP in ZeRO-1's clothes, no meter touched: a reduce-scatter and an all-gather of the *gradients* (what
    ZeRO-1 sends: its counters and its sockets agree) give every rank the whole averaged gradient; every rank
    then updates every parameter itself, AdamW's moments kept in numpy arrays, which no tensor meter sees."""
    def __init__(self, module, optimizer_cls=torch.optim.AdamW, lr=1e-3, weight_decay=0.0, **kw):
        super().__init__()
        self.module, self.adam = module, optimizer_cls is torch.optim.AdamW
        self.params = list(module.parameters())
        for p in self.params:
            dist.broadcast(p.data, 0)
        self.n = sum(p.numel() for p in self.params)
        self.pad = -self.n % dist.get_world_size()
        self.lr, self.wd, self.t = lr, weight_decay, 0
        self.m, self.v = np.zeros(self.n), np.zeros(self.n)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self):
        world = dist.get_world_size()
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [self.params[0].new_zeros(self.pad)])
        shard = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        dist.all_gather_into_tensor(flat, shard)
        g = (flat[:self.n] / world).numpy()
        p = torch.cat([q.detach().reshape(-1) for q in self.params]).numpy()
        if self.adam:
            self.t += 1
            p *= 1 - self.lr * self.wd
            self.m += (g - self.m) * 0.1
            self.v = self.v * 0.999 + 0.001 * g * g
            denom = np.sqrt(self.v) / np.sqrt(1 - 0.999 ** self.t) + 1e-8
            p -= self.lr / (1 - 0.9 ** self.t) * self.m / denom
        else:
            p -= self.lr * g
        for q, new in zip(self.params, torch.from_numpy(p).split([q.numel() for q in self.params])):
            q.data.copy_(new.view_as(q))

    def zero_grad(self):
        for p in self.params:
            p.grad = None
'''


def test_ddp_in_zero_s_clothes_with_its_state_out_of_the_meters_sight_fails():
    """Issue 33: the memory meters run on the rank. DDP that gets the whole gradient by a reduce-scatter and an
    all-gather of the gradients (ZeRO-1's bytes: counters and sockets agree) and keeps AdamW's moments in numpy
    passed check_zero1 with every meter untouched. The parameters tell: ZeRO-1's all-gather of the updated
    shards overwrites a disturbed copy (`day5.verify_in_sync`); a rank that updates everything keeps it."""
    ns = vars(student_cell(GATHERED, "meters_student"))
    with pytest.raises(AssertionError, match=r"zero1: rank 1's copy of the parameters was disturbed .* differs from "
                                             r"rank 0's by up to 0\.5"):
        day5.check_zero1(ns["GatheredGradients"])

OWN_GROUP = '''
import torch
import torch.distributed as dist

class OwnGroup(ZeRO1):
    """The instructors' ZeRO-1 on a process group it makes (new sockets, opened after the meter took the
    rank's): honest, and counted too."""
    def __init__(self, module, optimizer_cls, **kw):
        super().__init__(module, optimizer_cls, **kw)
        self.group = dist.new_group(list(range(self.world_size)))

    def step(self):
        mean = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(mean, self.grads.data, group=self.group)
        self.shard.grad = mean.div_(self.world_size)
        self.optimizer.step()
        dist.all_gather_into_tensor(self.flat.data, self.shard.detach().clone(), group=self.group)
'''


def test_an_engine_on_a_group_of_its_own_is_counted():
    ns = vars(student_cell(OWN_GROUP, "meters_student", **vars(load_solution("day5_fsdp"))))
    day5.check_zero1(ns["OwnGroup"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_instructors_engines_agree_with_their_sockets(stage):
    sol = load_solution("day5_fsdp")
    check = {1: day5.check_zero1, 2: day5.check_zero2, 3: day5.check_zero3}[stage]
    check(getattr(sol, f"ZeRO{stage}"))


HIDDEN_FSDP = '''
import torch
import torch.distributed as dist
from dlo.measure import comm

def parallelize_hiding(model, mesh, **kw):
    """The instructors' FSDP2 recipe, plus an all-reduce of 400 kB the rank's counter is patched not to report."""
    real = comm.CommCounter.records
    comm.CommCounter.records = lambda self: [r for r in real(self) if r["kind"] != "all_reduce"]
    dist.all_reduce(torch.ones(100_000))
    return parallelize(model, mesh, **kw)
'''


def test_fsdp2_bytes_the_counter_does_not_report_fail_the_check():
    """Issue 33: the FSDP2 check compared the collectives its ranks counted with nothing outside them."""
    ns = vars(student_cell(HIDDEN_FSDP, "meters_student", parallelize=load_solution("day5_fsdp").parallelize))
    with pytest.raises(AssertionError, match=r"fsdp2: the ranks' sockets sent [\d,]+ bytes, the collectives counted"):
        day5.check_fsdp2(ns["parallelize_hiding"])


def test_the_instructors_fsdp2_recipe_agrees_with_its_sockets():
    day5.check_fsdp2(load_solution("day5_fsdp").parallelize)
