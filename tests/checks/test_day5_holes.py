"""Day 5's red team (2026-12-02), three holes worth 10 points, each closed: the cheat fails with its mistake named,
the solution (and an honest variant the exercise allows) still passes.

1. ZeRO-2 (3 points): an engine kept the whole gradient in NumPy and reduce-scattered it in cap-sized async chunks
   at the last gradient; on the kernel-counted case (recognised by its size) it dropped every gradient, and the
   count only built the engine and ran backward. The counted case now takes the step and is checked: its
   reduce-scatters in the step's own backward carry the whole gradient, each rank's parameters match one process
   (`day5_count.verify_count`).
2. ZeRO-3 (4 points): units gathered again in backward and never freed, every gradient kept, everything
   reduce-scattered in step(). Now one reduce-scatter per unit must be launched in the step's own backward (its
   graph task, `day5._reduced_in_backward`), and the engine's bytes after each gradient are held to the shards, the
   root, two gathered units and one unit's gradients (`day5_memory.verify_unit_backward`).
3. FSDP2 (3 points): torch.compile(block) called and its result dropped. The stand-in now returns a wrapper module
   (`day5_fsdp.Compiled`), which model.layers must hold and the forward must go through.

The counted case needs ranks the check launches (no `ranks` fixture) and the grader's trust (`-m trust`).
"""

from __future__ import annotations

import pytest

from dlo.checks import day5
from dlo.grading.jail import probe
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell

pytestmark = pytest.mark.usefixtures("one_thread")
needs_bwrap = pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}")

# The red team's cells (/tmp/redteam/day5/dev), as a student's notebook defines them; the names they use (torch,
# nn, dist, FlatBuffer, reduce_scatter, all_gather) are the notebook's imports.
Z2_FAKE = '''
import numpy as np


class ZeRO2(nn.Module):
    """The whole gradient kept in NumPy until backward ends, then reduce-scattered in cap-sized async chunks; on
    the kernel-counted case (over 10^6 parameters) every gradient dropped (`counted`: "drop"), or reduce-scattered
    as zeros of the right sizes ("zeros"), or the NumPy way there too ("keep")."""

    counted = "drop"

    def __init__(self, module, optimizer_cls, bucket_cap_mb=25.0, **optimizer_kwargs):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = list(module.parameters())
        n = sum(p.numel() for p in self.params)
        self.big = n > 10 ** 6 and self.counted != "keep"
        if self.big:
            self.left = len(self.params)
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._drop)
            self.cap = int(bucket_cap_mb * 2 ** 20) // 8
            self.n = n
            self.optimizer = optimizer_cls(self.params, **optimizer_kwargs)
            return
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, 0)
        N = self.world_size
        m = max(1, -(-n * self.params[0].element_size() // int(bucket_cap_mb * 2 ** 20)))
        self.flat = FlatBuffer(self.params, N * m)
        self.m, self.S = m, self.flat.shard_numel
        self.shards = [nn.Parameter(self.flat.data[(c * N + self.rank) * self.S:(c * N + self.rank + 1) * self.S])
                       for c in range(m)]
        self.g = np.zeros(self.flat.data.numel())
        self.left = len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(p, i))
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)

    def _drop(self, p):
        p.grad = None
        self.left -= 1
        if self.left == 0 and self.counted == "zeros":  # the right bytes, async, during backward: no gradient
            self.left, N = len(self.params), self.world_size
            for start in range(0, self.n, self.cap):
                full = torch.zeros(-(-min(self.cap, self.n - start) // N) * N, dtype=torch.float64)
                reduce_scatter(torch.empty(full.numel() // N, dtype=full.dtype), full, async_op=True).wait()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p, i=0):
        o = self.flat.offsets[i]
        self.g[o:o + p.numel()] += p.grad.detach().reshape(-1).numpy()
        p.grad = None
        self.left -= 1
        if self.left == 0:
            self.left = len(self.params)
            N, S = self.world_size, self.S
            work = []
            for c in range(self.m):
                full = torch.from_numpy(self.g[c * N * S:(c + 1) * N * S].copy())
                out = torch.empty(S, dtype=full.dtype)
                work.append((c, out, reduce_scatter(out, full, async_op=True)))
                del full
            for c, out, h in work:
                h.wait()
                self.shards[c].grad = out.div_(self.world_size)
            self.g[:] = 0

    def step(self):
        self.optimizer.step()
        if self.big:
            return
        N, S = self.world_size, self.S
        for c in range(self.m):
            all_gather(self.flat.data[c * N * S:(c + 1) * N * S], self.shards[c].detach().clone())

    def zero_grad(self):
        self.optimizer.zero_grad()
'''

Z3_LAZY = '''
class ZeRO3(nn.Module):
    """Units gathered before their forward and freed after it, gathered again when backward reaches them and never
    freed in backward; every gradient kept as p.grad and reduce-scattered in step() (`in_step`), or at the last
    gradient, still in backward (`in_step = False`)."""

    in_step = True

    def __init__(self, module, optimizer_cls, units=(), **optimizer_kwargs):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        params = list(module.parameters())
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, 0)
        seen, groups = set(), []
        for u in units:
            ps = [p for p in u.parameters() if id(p) not in seen]
            seen |= {id(p) for p in ps}
            groups.append((u, ps))
        groups.insert(0, (module, [p for p in params if id(p) not in seen]))
        self.units = []
        for u, ps in groups:
            flat = FlatBuffer(ps, self.world_size)
            unit = (ps, flat, nn.Parameter(flat.shard(self.rank).clone()))
            flat.free()
            self.units.append(unit)
            u.register_forward_pre_hook(lambda m, a, unit=unit: self._gather(unit))
            u.register_forward_hook(lambda m, a, out, unit=unit: self._after_forward(unit, out))
        self.left = len(params)
        if not self.in_step:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = optimizer_cls([s for *_, s in self.units], **optimizer_kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gather(self, unit):
        ps, flat, shard = unit
        if not flat.allocated:
            flat.alloc()
            all_gather(flat.data, shard.detach())

    def _after_forward(self, unit, out):
        unit[1].free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, unit=unit: (self._gather(unit), g)[1])

    def _grad_ready(self, p):
        self.left -= 1
        if self.left == 0:
            self.left = sum(len(ps) for ps, *_ in self.units)
            self._reduce()

    def _reduce(self):
        for ps, flat, shard in self.units:
            grads = FlatBuffer(ps, self.world_size, bind=False)
            for i, p in enumerate(ps):
                if p.grad is not None:
                    grads.view(i).copy_(p.grad)
                p.grad = None
            out = torch.empty_like(shard.detach())
            reduce_scatter(out, grads.data)
            shard.grad = out.div_(self.world_size)
            del grads
            flat.free()

    def step(self):
        if self.in_step:
            self._reduce()
        self.optimizer.step()
        for *_, shard in self.units:
            shard.grad = None

    def zero_grad(self):
        self.optimizer.zero_grad()
        for ps, *_ in self.units:
            for p in ps:
                p.grad = None


def prefetching(base):
    class Prefetching(base):
        """The solution's ZeRO-3, gathering the next unit of backward (the one before in forward) when backward
        reaches a unit: an honest prefetch, two units gathered at a time beside the root."""

        def _after_forward(self, unit, out):
            unit["flat"].free()
            i = next(k for k, u in enumerate(self.units) if u is unit)
            ahead = self.units[-1] if i == 0 else self.units[i - 1] if i > 1 else None
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._gather(unit) or (ahead is not None and self._gather(ahead)) or None)
    return Prefetching
'''

FSDP_CELLS = '''
def parallelize_dropping_compile(model, mesh, *, param_dtype, reduce_dtype, ac_mode="full", compile=False):
    """torch.compile is called on each block, as the check records, but its result is thrown away."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for name, block in list(model.layers.items()):
        if ac_mode == "full":
            block = checkpoint_wrapper(block)
            model.layers.register_module(name, block)
        if compile:
            torch.compile(block)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def parallelize_bypassing_compile(model, mesh, *, param_dtype, reduce_dtype, ac_mode="full", compile=False):
    """What torch.compile returned is registered, but its forward replaced by the block's own."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for name, block in list(model.layers.items()):
        if ac_mode == "full":
            block = checkpoint_wrapper(block)
        if compile:
            compiled = torch.compile(block)
            compiled.forward = block.forward
            block = compiled
        model.layers.register_module(name, block)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def parallelize_with_module_compile(model, mesh, *, param_dtype, reduce_dtype, ac_mode="full", compile=False):
    """nn.Module.compile() on each block, in place (it compiles the block's call): the block stays where it is."""
    for name, block in list(model.layers.items()):
        if ac_mode == "full":
            block = checkpoint_wrapper(block)
            model.layers.register_module(name, block)
        if compile:
            block.compile()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
'''


@pytest.fixture(scope="module")
def sol():
    return load_solution("day5_fsdp")


@pytest.fixture(scope="module")
def cells(sol):
    given = {k: v for k, v in vars(sol).items() if not k.startswith("__")}
    z2 = student_cell(Z2_FAKE, "day5_red_z2", **given).ZeRO2
    z3 = student_cell(Z3_LAZY, "day5_red_z3", **given)
    fsdp = student_cell(FSDP_CELLS, "day5_red_fsdp", **given)

    def variant(cls, **attrs):
        return type(cls.__name__, (cls,), attrs)
    return {"z2_drop": z2, "z2_zeros": variant(z2, counted="zeros"), "z2_keep": variant(z2, counted="keep"),
            "z3_lazy": z3.ZeRO3, "z3_lazy_in_backward": variant(z3.ZeRO3, in_step=False),
            "z3_prefetch": z3.prefetching(sol.ZeRO3), "fsdp": fsdp}


# ----------------------------------------------------------------------------- 1. ZeRO-2's counted case

@pytest.mark.trust
@pytest.mark.parametrize(("cheat", "phrase"), [
    ("z2_drop", r"during backward on the large case .* launched 0 reduce-scatter\(s\)"),
    ("z2_zeros", r"after one SGD step on the large case .* did not move: the gradients never reached the optimizer"),
    ("z2_keep", r"rank \d's resident memory rose by \d+ MiB, as the kernel counts it outside your code"),
])
def test_zero2_counted_case_is_checked(cells, cheat, phrase):
    """Where the check launches the ranks (a notebook's check, the grader), the counted case recognised and skipped
    fails on its reduce-scatters or its parameters; done the NumPy way there too, on the kernel's count."""
    with pytest.raises(AssertionError, match=phrase):
        day5.check_zero2(cells[cheat], seed=1)


@pytest.mark.trust
def test_zero2_counted_case_passes_the_solution(sol):
    day5.check_zero2(sol.ZeRO2, seed=3)


@pytest.mark.trust
@needs_bwrap
def test_zero2_counted_case_is_checked_in_the_sandbox(cells, sol, jail):
    with pytest.raises(AssertionError, match="did not move"):
        jail.run(day5.check_zero2, cells["z2_zeros"], seed=2)
    jail.run(day5.check_zero2, sol.ZeRO2, seed=2)


# ----------------------------------------------------------------------------- 2. ZeRO-3's backward

def test_zero3_rejects_reducing_in_step(cells, ranks):
    with pytest.raises(AssertionError, match=r"0 reduce-scatter\(s\) carrying 0.000 Psi were launched during "
                                             r"backward.*not in step\(\)"):
        day5.check_zero3(cells["z3_lazy"], seed=1)


def test_zero3_rejects_a_backward_that_keeps_every_unit(cells, ranks):
    """The same engine, reduce-scattering everything at the last gradient (in backward, one per unit): the bytes
    it held after each gradient name it."""
    with pytest.raises(AssertionError, match=r"during backward rank \d held up to [\d,]+ bytes .*the shards, the "
                                             r"root, two gathered units and one unit's gradients"):
        day5.check_zero3(cells["z3_lazy_in_backward"], seed=1)


def test_zero3_accepts_a_prefetch_in_backward(cells, ranks):
    day5.check_zero3(cells["z3_prefetch"], seed=2)
    day5.check_zero3(cells["z3_prefetch"], seed=1, world_size=3)


# ----------------------------------------------------------------------------- 3. FSDP2's torch.compile

def test_fsdp2_rejects_a_dropped_compile(cells, ranks):
    with pytest.raises(AssertionError, match=r"model.layers does not hold what torch.compile returned for blocks "
                                             r"\[0, 1"):
        day5.check_fsdp2(cells["fsdp"].parallelize_dropping_compile, seed=1)


def test_fsdp2_rejects_a_compiled_block_bypassed(cells, ranks):
    with pytest.raises(AssertionError, match=r"the compiled blocks were called 0 times"):
        day5.check_fsdp2(cells["fsdp"].parallelize_bypassing_compile, seed=1)


def test_fsdp2_accepts_module_compile(cells, ranks):
    day5.check_fsdp2(cells["fsdp"].parallelize_with_module_compile, seed=1)
