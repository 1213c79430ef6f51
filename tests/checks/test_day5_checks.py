"""The Day 5 checks accept the solution notebook's code and reject the slips students make.

The reference solutions are the notebook's own solution cells (executed here from
solutions/day5_fsdp), so these tests prove what the grader will see. The ranks of the ZeRO and
FSDP checks come from one pool of 2 ranks kept alive across tests (`tests.rank_pool`: a launch costs
seconds of interpreter start-up). Each exercise gets its solution and one typical mistake:
gradients summed instead of averaged, an all-reduce where ZeRO reduce-scatters, gradients reduced
after backward instead of during it, parameters kept from forward to backward, FSDP applied before
activation checkpointing, a forbidden library engine, a stub.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
import torch.distributed as dist

from dlo.checks import day5, day5_memory, day5_zero
from dlo.distributed import zero
from dlo.distributed.zero_comms import all_gather
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def sol():
    return load_solution("day5_fsdp")


# ----------------------------------------------------------------------------- 1. the accountant (no ranks)

def test_accountant_accepts(sol):
    day5.check_memory_accountant(sol.memory_per_rank, seed=3)


def test_accountant_rejects_a_forgotten_master_copy():
    def no_master(n_params, world_size, stage, *, param_dtype=torch.bfloat16, optimizer="adamw"):
        b = torch.empty((), dtype=param_dtype).element_size()
        k = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}[optimizer] * (4 if b < 4 else b)  # no fp32 master copy
        s = -(-n_params // world_size)
        p, g, o = (b * (s if stage >= 3 else n_params), b * (s if stage >= 2 else n_params),
                   k * (s if stage >= 1 else n_params))
        return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}
    with pytest.raises(AssertionError, match="fp32 master copy"):
        day5.check_memory_accountant(no_master)


def test_accountant_rejects_floor_division():
    def floor(n_params, world_size, stage, *, param_dtype=torch.bfloat16, optimizer="adamw"):
        b = torch.empty((), dtype=param_dtype).element_size()
        m = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]
        k = 4 + 4 * m if b < 4 else b * m
        s = n_params // world_size  # the padding forgotten: the last elements belong to nobody
        p, g, o = (b * (s if stage >= 3 else n_params), b * (s if stage >= 2 else n_params),
                   k * (s if stage >= 1 else n_params))
        return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}
    with pytest.raises(AssertionError, match="ceil"):
        day5.check_memory_accountant(floor)


def test_accountant_rejects_the_library():
    def borrowed(*args, **kwargs):
        return zero.memory_per_rank(*args, **kwargs)
    with pytest.raises(AssertionError, match="off limits"):
        day5.check_memory_accountant(borrowed)

    def via_the_accountant(n, world_size, stage, *, param_dtype, optimizer):
        from dlo.accounting import model_state_bytes, precision_of
        return model_state_bytes(n, optimizer, precision_of(param_dtype), world_size=world_size, stage=stage)
    with pytest.raises(AssertionError, match="off limits"):
        day5.check_memory_accountant(via_the_accountant)


# ----------------------------------------------------------------------------- 2-4. ZeRO (one launch each)

def test_zero1_accepts(sol, ranks):
    day5.check_zero1(sol.ZeRO1, seed=2)


def test_zero1_accepts_a_shard_kept_outside_the_engines_parameters(sol, ranks):
    """The exercise lets the shard be an engine parameter (the solution's `self.shard`) or not: the check reads the
    model's own parameters."""
    class Unregistered(sol.ZeRO1):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            shard = self._parameters.pop("shard")  # no longer among the engine's parameters
            object.__setattr__(self, "shard", shard)
            assert not any(p is shard for p in self.parameters())
    day5.check_zero1(Unregistered, seed=3)


def test_zero1_rejects_all_reduce(sol, ranks):
    class AllReduce(sol.ZeRO1):
        def step(self):  # right parameters, but 2 Psi for the gradients and Psi more for the weights
            dist.all_reduce(self.grads.data)
            self.shard.grad = self.grads.shard(self.rank).div_(self.world_size)
            self.optimizer.step()
            all_gather(self.flat.data, self.shard.detach().clone())
    with pytest.raises(AssertionError, match="all-reduces the gradients"):
        day5.check_zero1(AllReduce)


def test_zero1_rejects_gradients_moved_point_to_point(sol, ranks):
    """The gradients averaged by send/recv (the whole buffer to the peer), then a dummy reduce-scatter
    and the all-gather to show ZeRO-1's 2 Psi: every byte a rank sends counts, send included."""
    class PointToPoint(sol.ZeRO1):
        def step(self):
            peer = torch.empty_like(self.grads.data)
            ops = [dist.P2POp(dist.isend, self.grads.data, 1 - self.rank),
                   dist.P2POp(dist.irecv, peer, 1 - self.rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            mean = (self.grads.data + peer) / self.world_size
            sol.reduce_scatter(torch.empty_like(self.shard), self.grads.data)  # for the byte count only
            self.shard.grad = mean.chunk(self.world_size)[self.rank][:self.shard.numel()].clone()
            self.optimizer.step()
            all_gather(self.flat.data, self.shard.detach().clone())
    with pytest.raises(AssertionError, match=r"rank 0 sent more than ZeRO-1 needs: recv 1\.\d\d Psi in the "
                                             r"step, send 1\.\d\d Psi in the step"):
        day5.check_zero1(PointToPoint)


def test_zero1_memory_allowance_is_what_a_correct_engine_holds_beyond_the_formula():
    """ZeRO-1's allowance, exactly: the averaged gradient shard its optimizer reads (S fp64 values), the padding
    of its two flat buffers and AdamW's step counters; it let through 4,224 bytes more before (the slack of
    ZeRO-2/3, which wait for a bucket), enough for a stray buffer of 400 doubles."""
    c = day5_zero.case(0)
    psi, tensors = day5_zero.count_psi(c), len(list(day5_zero.tied_lm(c, 0).parameters()))
    for n in (2, 3):
        assert day5_memory.memory_slack(c, n, 1) == 8 * -(-psi // n) + 16 * (n - 1) + 16 * tensors
    assert "averaged gradient shard" in day5_memory.ALLOWED[1]


def test_zero1_rejects_a_buffer_beyond_the_allowance(sol, ranks):
    class Stray(sol.ZeRO1):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_buffer("stray", torch.zeros(400, dtype=torch.float64))  # 3,200 B no ZeRO-1 needs
    with pytest.raises(AssertionError, match="allowed: the averaged gradient shard"):
        day5.check_zero1(Stray)


def test_the_live_growth_waits_out_a_finished_collectives_buffers_but_not_kept_state():
    from dlo.measure import live_bytes

    before = live_bytes()
    in_flight = [torch.zeros(500)]  # 2,000 B a communication thread still holds just after wait() returned
    threading.Timer(0.1, in_flight.clear).start()
    assert day5_zero.settled_growth(before, held=0) == 0
    kept = torch.zeros(250)         # 1,000 B an engine keeps: measured again for wait_s, then counted
    assert day5_zero.settled_growth(before, held=0, wait_s=0.1) == 1000
    del kept


@pytest.mark.trust
def test_zero1_rejects_state_kept_outside_the_engine(sol, ranks):
    """The same stray buffer, kept where the walk from the engine does not go (a class attribute): the rank's
    growth in live tensors counts it (`dlo.measure.live_bytes`), and the message says where to look."""
    class Hidden(sol.ZeRO1):
        kept = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            Hidden.kept.append(torch.zeros(400, dtype=torch.float64))

    with pytest.raises(AssertionError, match="of them outside the engine object"):
        day5.check_zero1(Hidden)


@pytest.mark.trust
def test_zero1_rejects_state_made_before_the_measured_engine(sol, ranks):
    """State made before the measured engine exists - by the class body when the rank unpickles the class, or
    by the first engine a rank builds, kept for later ones - counts: the growth is counted from before the
    student's objects are unpickled (`dlo.grading.ranks.run_on_rank`), and the measured engine is the first."""
    class AtUnpickling(sol.ZeRO1):
        kept = torch.zeros(400, dtype=torch.float64)

    class FirstEngine(sol.ZeRO1):
        kept = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not FirstEngine.kept:
                FirstEngine.kept.append(torch.zeros(400, dtype=torch.float64))

    for cls in (AtUnpickling, FirstEngine):
        with pytest.raises(AssertionError, match="of them outside the engine object"):
            day5.check_zero1(cls)


@pytest.mark.trust
def test_zero1_rejects_a_stray_buffer_behind_a_patched_meter(sol):
    """An engine that replaces what a meter would call (Tensor.untyped_storage, gc.get_referents, gc.get_objects)
    before the check measures it: the meters read through what they captured at import, before any student code.
    On ranks of its own (the patches die with them), not the tests' pool."""
    class Patched(sol.ZeRO1):
        def __init__(self, *args, **kwargs):
            import gc

            super().__init__(*args, **kwargs)
            stray = torch.zeros(400, dtype=torch.float64)
            self.register_buffer("stray", stray)
            storage, referents, objects = torch.Tensor.untyped_storage, gc.get_referents, gc.get_objects
            # the stray buffer, and it only, disappears from whatever a meter would look it up with
            torch.Tensor.untyped_storage = lambda t: torch.UntypedStorage(0) if t is stray else storage(t)
            gc.get_referents = lambda *objs: [o for o in referents(*objs) if o is not stray]
            gc.get_objects = lambda *a: [o for o in objects(*a) if o is not stray]

    with pytest.raises(AssertionError, match="allowed: the averaged gradient shard"):
        day5.check_zero1(Patched)


def test_zero2_accepts(sol, ranks):
    day5.check_zero2(sol.ZeRO2, seed=2)


def test_zero2_rejects_summed_gradients(sol, ranks):
    class Summed(sol.ZeRO2):
        def _wait(self):
            if self.pending is not None:
                b, out, handle = self.pending
                handle.wait()
                b["shard"].grad = out  # the sum over ranks: N times the mean
                b["grads"], b["ready"], self.pending = None, 0, None
    with pytest.raises(AssertionError, match="moved 2x too far"):
        day5.check_zero2(Summed)


def test_zero2_rejects_reducing_after_backward(sol, ranks):
    class AfterBackward(sol.ZeRO2):
        def _grad_ready(self, p):  # keeps every full gradient until the step: ZeRO-1's memory
            b = self.bucket_of[p]
            if b["grads"] is None:
                b["grads"] = sol.FlatBuffer(b["params"], self.world_size, bind=False)
            b["grads"].view(b["slot"][p]).copy_(p.grad)
            p.grad = None

        def step(self):
            for b in self.buckets:
                out = torch.empty(b["flat"].shard_numel, dtype=b["grads"].data.dtype)
                sol.reduce_scatter(out, b["grads"].data)
                b["shard"].grad, b["grads"] = out.div_(self.world_size), None
            self.optimizer.step()
            for b in self.buckets:
                all_gather(b["flat"].data, b["shard"].detach().clone())
    with pytest.raises(AssertionError, match="launched with async_op=True from a gradient hook"):
        day5.check_zero2(AfterBackward)


def test_zero3_names_a_root_kept_gathered_into_backward(sol, ranks):
    """Section 4 says the root stays gathered for the whole forward and backward; the exercise frees it after
    the forward like every unit and gathers it again at its output's hook: the message says so."""
    class RootKept(sol.ZeRO3):
        def _after_forward(self, unit, out):
            if unit is not self.units[0]:  # the root (the module itself) comes first
                super()._after_forward(unit, out)
    with pytest.raises(AssertionError, match=r"all-gathers in backward.*\(the root too"):
        day5.check_zero3(RootKept)


def test_zero3_accepts(sol, ranks):
    day5.check_zero3(sol.ZeRO3, seed=2)


def test_zero3_accepts_the_padding_of_three_ranks(sol, ranks):
    """Seed 115 draws sizes where N = 3 pads every tensor: the seven all-gathers of the AdamW steps carried
    7.05 Psi, and a correct engine lost the exercise's points when the tolerance did not grow with them."""
    assert day5_zero.padding_bytes(day5_zero.case(115), 3) > 0
    day5.check_zero3(sol.ZeRO3, seed=115, world_size=3)


def test_zero3_rejects_keeping_parameters_until_backward(sol, ranks):
    class NoReshard(sol.ZeRO3):
        def _after_forward(self, unit, out):  # no free: the gathered weights live until backward
            pass
    with pytest.raises(AssertionError, match="all-gathers in backward"):
        day5.check_zero3(NoReshard)


def test_zero_checks_forbid_the_library_and_subclasses_of_it():
    """What the ranks do under the ZeRO checks' forbid lists, tested here without a launch: the
    library's engine, or a subclass that inherits its methods, raises ForbiddenCall."""
    from dlo.grading.forbid import ForbiddenCall, forbidden

    class Borrowed(zero.ZeRO3):
        pass
    model = day5_zero.tied_lm(day5_zero.case(0), 0)
    for check, cls in ((day5.check_zero1, zero.ZeRO1), (day5.check_zero2, zero.ZeRO2), (day5.check_zero3, Borrowed)):
        with forbidden(check.forbid, "zero"), pytest.raises(ForbiddenCall, match="off limits"):
            cls(model, torch.optim.AdamW)
    assert "torch.distributed.fsdp.fully_shard" in day5.check_zero3.forbid


def test_a_stub_fails():
    def stub(*args, **kwargs):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):  # a plain call: the student's own exception comes through
        day5.check_memory_accountant(stub)


# ----------------------------------------------------------------------------- 5. FSDP2

def test_fsdp2_accepts(sol, ranks):
    day5.check_fsdp2(sol.parallelize, seed=2)


def test_fsdp2_rejects_fsdp_before_checkpointing(sol, ranks):
    def wrong_order(model, mesh, *, param_dtype, reduce_dtype, ac_mode="full", compile=False):
        policy = sol.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.layers.values():
            sol.fully_shard(block, mesh=mesh, mp_policy=policy)
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, sol.checkpoint_wrapper(block) if ac_mode == "full" else block)
        sol.fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    with pytest.raises(AssertionError, match="wrap for activation checkpointing first"):
        day5.check_fsdp2(wrong_order)


# ----------------------------------------------------------------------------- issue 34: what the text says either way

def test_zero1_accepts_a_zero_grad_that_keeps_the_shard_s_grad(sol, ranks):
    """The exercise says dropping the shard's .grad in zero_grad is optional (step() sets it afresh)."""
    class KeepsShardGrad(sol.ZeRO1):
        def zero_grad(self):
            self.grads.data.zero_()
    day5.check_zero1(KeepsShardGrad, seed=2)


def test_zero2_accepts_a_wait_that_adds_to_the_shard_s_grad(sol, ranks):
    """The exercise says `_wait` may set the mean as the shard's .grad or add it to one there (None after zero_grad)."""
    class Adds(sol.ZeRO2):
        def _wait(self):
            if self.pending is not None:
                b, out, handle = self.pending
                handle.wait()
                mean = out.div_(self.world_size)
                b["shard"].grad = mean if b["shard"].grad is None else b["shard"].grad.add_(mean)
                b["grads"], b["ready"], self.pending = None, 0, None
    day5.check_zero2(Adds, seed=2)


def test_zero3_solution_gives_a_weight_of_two_units_to_the_root(sol):
    """The exercise's rule (issue 34): a parameter found in two units' modules is the root's, as §4 says of a
    weight tied across units; the check's units share none, so the solution is held to it here."""
    from torch import nn

    from dlo.plan import fake_world

    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight  # tied across the two units
    model = nn.Sequential(a, b, nn.LayerNorm(3))
    with fake_world(2):
        engine = sol.ZeRO3(model, torch.optim.SGD, units=[a, b], lr=0.1)
    root = engine.unit_of[a.weight]
    assert root is engine.unit_of[model[2].weight] and a.weight in root["params"]
    assert [len(u["params"]) for u in engine.units] == [3, 1, 1]  # root: tied weight + norm; each unit its bias


# ----------------------------------------------------------------------------- red team (Day 5)

def accountant_from_the_library_helpers(n_params, world_size, stage, *, param_dtype=torch.bfloat16, optimizer="adamw"):
    """The formula assembled from dlo.accounting's helpers: precision_of's widths hold the mixed-precision rule."""
    from dlo import accounting

    w, g, m, s = accounting.precision_of(param_dtype)
    k, shard = m + accounting.OPTIMIZER_STATES[optimizer] * s, accounting.shard_numel(n_params, world_size)
    p, gr, o = w * (shard if stage >= 3 else n_params), g * (shard if stage >= 2 else n_params), k * (
        shard if stage >= 1 else n_params)
    return {"params": p, "grads": gr, "optimizer": o, "total": p + gr + o}


def accountant_from_copy_widths(n_params, world_size, stage, *, param_dtype=torch.bfloat16, optimizer="adamw"):
    from dlo import accounting

    b = torch.empty((), dtype=param_dtype).element_size()
    w, g, m, s = accounting.copy_widths(param_dtype, torch.float32 if b < 4 else None)
    k, shard = m + accounting.OPTIMIZER_STATES[optimizer] * s, -(-n_params // world_size)
    p, gr, o = w * (shard if stage >= 3 else n_params), g * (shard if stage >= 2 else n_params), k * (
        shard if stage >= 1 else n_params)
    return {"params": p, "grads": gr, "optimizer": o, "total": p + gr + o}


def parallelize_with(*, flags: bool = True, reduce_fp32: bool = False, param_fp32: bool = False):
    """The solution's parallelize, but with `flags=False` it always checkpoints and compiles whatever ac_mode and
    compile say; with `reduce_fp32` it reduce-scatters in float32 whatever reduce_dtype says (float64 asked); with
    `param_fp32` it computes in float32 when param_dtype is None. Made here: a closure travels to the ranks by
    value (this module, which imports the grader's trusted side, cannot be imported on a rank)."""
    def parallelize(model, mesh, *, param_dtype, reduce_dtype, ac_mode="full", compile=False):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        for name, block in list(model.layers.named_children()):
            block = checkpoint_wrapper(block) if ac_mode == "full" or not flags else block
            model.layers.register_module(name, torch.compile(block) if compile or not flags else block)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype or (torch.float32 if param_fp32 else None),
                                  reduce_dtype=torch.float32 if reduce_fp32 else reduce_dtype)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    return parallelize


def zero2_reducing_after_the_last_hook(sol):
    """ZeRO-2 keeping every full gradient during backward where the walk from the engine does not go (a
    class attribute), then launching all its async reduce-scatters from the last gradient hook."""
    class AllAtTheLastHook(sol.ZeRO2):
        hidden = {}

        def _grad_ready(self, p):
            grads = AllAtTheLastHook.hidden.setdefault("grads", {})
            grads[p], p.grad = p.grad, None
            if len(grads) < len(self.bucket_of):
                return
            pending = AllAtTheLastHook.hidden.setdefault("pending", [])
            for b in self.buckets:
                flat = sol.FlatBuffer(b["params"], self.world_size, bind=False)
                for q in b["params"]:
                    flat.view(b["slot"][q]).copy_(grads[q])
                out = torch.empty(b["flat"].shard_numel, dtype=p.dtype)
                pending.append((b, out, flat, sol.reduce_scatter(out, flat.data, async_op=True)))
            grads.clear()

        def _wait(self):
            for b, out, _, handle in AllAtTheLastHook.hidden.pop("pending", ()):
                handle.wait()
                b["shard"].grad = out.div_(self.world_size)
    return (AllAtTheLastHook,)


def zero2_gradients_set_aside_before_backward(sol, made_in="zero_grad"):
    """ZeRO-2 keeping every full gradient during backward in buffers made before it (in __init__ and zero_grad, or
    in forward) and held by a class attribute, all reduce-scattered from the last hook, dropped in the step: the
    check counted only what grew during backward, and the rank's count after the step comes after the drop."""
    class SetAside(sol.ZeRO2):
        kept = {}

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pend, self.index = [], {id(b): i for i, b in enumerate(self.buckets)}
            self._set_aside()

        def _set_aside(self):
            SetAside.kept.update(n=0, bufs=[sol.FlatBuffer(b["params"], self.world_size, bind=False)
                                            for b in self.buckets])

        def forward(self, *args, **kwargs):
            if made_in == "forward":
                self._set_aside()
            return super().forward(*args, **kwargs)

        def _grad_ready(self, p):
            b, kept = self.bucket_of[p], SetAside.kept
            kept["bufs"][self.index[id(b)]].view(b["slot"][p]).copy_(p.grad)
            p.grad, kept["n"] = None, kept["n"] + 1
            if kept["n"] == len(self.bucket_of):
                for b, buf in zip(self.buckets, kept["bufs"]):
                    out = torch.empty(b["flat"].shard_numel, dtype=p.dtype)
                    self.pend.append((b, out, sol.reduce_scatter(out, buf.data, async_op=True)))

        def _wait(self):
            for b, out, handle in self.pend:
                handle.wait()
                b["shard"].grad = out.div_(self.world_size)
            self.pend = []
            SetAside.kept.clear()

        def zero_grad(self):
            super().zero_grad()
            if made_in == "zero_grad":
                self._set_aside()
    return (SetAside,)


def zero3_gathered_copies_kept(sol):
    """ZeRO-3 keeping a copy of every unit it gathers in a class attribute until the step: the forward's samples
    read only what the walk from the engine reaches."""
    class Hoard(sol.ZeRO3):
        kept = []

        def _gather(self, unit):
            super()._gather(unit)
            Hoard.kept.append(unit["flat"].data.clone())

        def step(self):
            super().step()
            Hoard.kept.clear()
    return (Hoard,)


def zero1_ddp_with_a_hidden_copy(sol):
    """DDP in ZeRO-1's clothes: a reduce-scatter and an all-gather of the gradients (ZeRO-1's bytes), every
    parameter stepped on every rank from a full copy and AdamW's moments kept in numpy (out of every tensor
    meter's sight); the copy written back over whatever happened to the parameters, so the ranks agree."""
    import numpy as np

    class HiddenCopy(torch.nn.Module):
        def __init__(self, module, optimizer_cls, lr, weight_decay=0.0):
            super().__init__()
            self.module, self.adam, self.params = module, optimizer_cls is torch.optim.AdamW, list(module.parameters())
            for p in self.params:
                dist.broadcast(p.data, 0)
            self.n, self.lr, self.wd, self.t = sum(p.numel() for p in self.params), lr, weight_decay, 0
            self.m, self.v = np.zeros(self.n), np.zeros(self.n)
            self.copy = torch.cat([p.detach().reshape(-1) for p in self.params]).numpy().copy()

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def step(self):
            world = dist.get_world_size()
            flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [self.params[0].new_zeros(-self.n % world)])
            shard = flat.new_empty(flat.numel() // world)
            sol.reduce_scatter(shard, flat)
            all_gather(flat, shard)
            g, p = (flat[:self.n] / world).numpy(), self.copy
            if self.adam:
                self.t += 1
                p *= 1 - self.lr * self.wd
                self.m += (g - self.m) * 0.1
                self.v = self.v * 0.999 + 0.001 * g * g
                p -= self.lr / (1 - 0.9 ** self.t) * self.m / (np.sqrt(self.v) / np.sqrt(1 - 0.999 ** self.t) + 1e-8)
            else:
                p -= self.lr * g
            for q, new in zip(self.params, torch.from_numpy(p).split([q.numel() for q in self.params])):
                q.data.copy_(new.view_as(q))

        def zero_grad(self):
            for p in self.params:
                p.grad = None
    return (HiddenCopy,)


RED_TEAM = [
    (day5.check_memory_accountant, lambda sol: (accountant_from_the_library_helpers,), "precision_of is off limits"),
    (day5.check_memory_accountant, lambda sol: (accountant_from_copy_widths,), "copy_widths is off limits"),
    (day5.check_fsdp2, lambda sol: (parallelize_with(flags=False),), "with ac_mode='none'"),
    (day5.check_fsdp2, lambda sol: (parallelize_with(flags=False, reduce_fp32=True),), "with ac_mode='none'"),
    (day5.check_fsdp2, lambda sol: (parallelize_with(reduce_fp32=True),), "with reduce_dtype=None"),
    (day5.check_fsdp2, lambda sol: (parallelize_with(reduce_fp32=True, param_fp32=True),), "with param_dtype=None"),
    (day5.check_zero2, zero2_reducing_after_the_last_hook, "never holds the whole gradient, wherever it is kept"),
    (day5.check_zero2, zero2_gradients_set_aside_before_backward, "wherever it is kept and whenever it was made"),
    (day5.check_zero2, lambda sol: zero2_gradients_set_aside_before_backward(sol, "forward"),
     "wherever it is kept and whenever it was made"),
    (day5.check_zero3, zero3_gathered_copies_kept, "keeps its shards and the unit being computed, wherever a copy"),
    (day5.check_zero1, zero1_ddp_with_a_hidden_copy, "values carry their owner's disturbance"),
]


@pytest.mark.parametrize("check,make,phrase", RED_TEAM, ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(RED_TEAM)])
@pytest.mark.parametrize("seed", [0, 1])
def test_right_only_where_the_checks_look_fails(sol, ranks, check, make, phrase, seed):
    """Red team (Day 5): each passed its check at some or all seeds 0..9 before the check looked there."""
    with pytest.raises(AssertionError, match=re.escape(phrase)):
        check(*make(sol), seed=seed)
