"""Autograder check for Day 1's gradient accumulation (`check_accumulate_gradients`, re-exported by
`dlo.checks.day1`, whose name the test cell calls).

The student's `fn(model, loss_fn, x, y, micro_batches)` runs in a worker (`run_student`) that records what
the model and torch saw: the micro-batch sizes (a forward hook), the order of the forwards and backwards
(hooks on each micro-batch's output), and through a TorchDispatchMode (`_Watch`) the most rows of x or y one
operator read and the multiply-adds of the forwards and of the backwards. The reference, here, is one
backward on the whole batch's mean cross-entropy.

Accumulation's point is memory: one micro-batch's activations alive at a time. So no operator may read more
than a micro-batch of x or y (a whole-batch forward through model.forward, F.linear on x, torch.cat of the
chunks), and each micro-batch's backward, carrying a gradient, comes before the next forward. The watch sees
only what runs through torch's dispatcher while it is on the dispatch stack: a whole-batch pass run past it
(a dispatch mode popped or disabled, another thread) would read nothing it sees. So it must also have seen
the work: the multiply-adds of the model's Linear layers over the whole batch in the forwards and again in
the backwards (the weights' gradients), and every gradient accumulated into a parameter's .grad must arrive
while it is on the stack (`torch.Tensor.register_post_accumulate_grad_hook`). The named ways out are also
forbidden (`dlo.checks.saved.MODES`).

Code that finds the watch (on torch's dispatch stack, or among the interpreter's objects) can rewrite what it
counted. So, under `dlo grade`, one more case (~4,100 samples, a hidden layer HELD_HIDDEN wide) also has the
process's memory read by the kernel from outside it (`_held`, `dlo.grading.api.student_memory`): the whole
batch's activations alive at once show there, whatever the watch says. Left open: .grad filled by
assignment from gradients computed past the watch, a micro-batch at a time, beside a backward of the same
size.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.checks.saved import MODES
from dlo.grading.api import case_seed, check, run_student, student_memory
from dlo.grading.compare import DTYPE, assert_close, assert_held, fmt, ok, rand
from dlo.measure import tensors_in
from dlo.measure.process import steady_malloc

# taken at import, before any student code: what the hooks ask of torch's dispatch stack and autograd
_STACK_LEN, _STACK_AT, _NODE = (torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at,
                                torch._C._current_autograd_node)
HELD_HIDDEN = 2048  # the large case's hidden width: batch x 2048 float64 activations, 64 MiB for ~4k samples
# the matmuls a Linear layer's forward and backward run (their last two tensor arguments multiplied)
MATMULS = frozenset(("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_addmm_activation"))
OUTSIDE = ("ran outside torch's dispatcher, where the grader's watch does not see it (a dispatch mode popped or "
           "disabled, another thread): run each micro-batch's forward and backward in plain PyTorch")


def _tiny_mlp(gen: torch.Generator, d_in: int, n_cls: int, hidden: int = 13) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, n_cls)).to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DTYPE) * 0.5)
    return model


def _macs(args: tuple) -> int:
    """A matmul's multiply-adds: its last two tensor arguments, (.., m, k) by (.., k, n) or by a vector."""
    a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
    return a.numel() * (b.shape[-1] if b.dim() >= 2 else 1)


class _Watch(TorchDispatchMode):
    """The most rows of the batch (x or y) one operator read, and which operator: accumulation computes
    on micro-batches of <= cap rows; a whole-batch forward (model.forward(x) past the hooks, F.linear on
    x, torch.cat of the chunks) reads more. Views (tensor_split, chunk, slicing) read nothing. Also the
    matmuls' multiply-adds, in the forward and in the backward (an autograd node running)."""

    def __init__(self, **batch: torch.Tensor):
        super().__init__()
        self.batch = {name: (t.untyped_storage().data_ptr(), t.storage_offset(), t.stride(0))
                      for name, t in batch.items()}
        self.most, self.what = 0, ""
        self.macs = {"forward": 0, "backward": 0}

    def on_stack(self) -> bool:
        return any(_STACK_AT(i) is self for i in range(_STACK_LEN()))

    def _rows(self, func, args, t: torch.Tensor, base: tuple) -> int:
        if t.numel() == 0:
            return 0
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default) and t is args[0]:
            idx = args[1][0] if func is torch.ops.aten.index.Tensor else (args[2] if args[1] == 0 else None)
            if isinstance(idx, torch.Tensor):  # x[idx] reads the rows it selects, not all of x
                return int(idx.sum()) if idx.dtype == torch.bool else idx.numel()
        _, off, row = base
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return (last - off) // row - (t.storage_offset() - off) // row + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            if func.overloadpacket.__name__ in MATMULS:
                self.macs["forward" if _NODE() is None else "backward"] += _macs(args)
            tensors = tensors_in((args, list((kwargs or {}).values())))  # not pytree's: 3x the watch's cost
            for name, base in self.batch.items():
                rows = sum(self._rows(func, args, t, base) for t in tensors
                           if t.untyped_storage().data_ptr() == base[0])
                if rows > self.most:
                    self.most, self.what = rows, f"{func.overloadpacket.__name__} read {rows} rows of {name}"
        return func(*args, **(kwargs or {}))


def _accumulate_worker(fn, model, x, y, k, steady: bool = False) -> dict:
    """Run the student's accumulation on `model` (stale grads included); record the micro-batch sizes
    the model saw, the order of forwards ("F", i) and of the gradients reaching their outputs ("B", i)
    (the all-zero ones in "zero"), what the watch saw, the parameters whose .grad was accumulated while the
    watch was off the dispatch stack ("off"), the returned loss and the gradients."""
    seen, events, out_grads, off = [], [], {}, []
    watch = _Watch(x=x, y=y)
    if steady:  # the kernel counts this call (`_held`): malloc returns large blocks at free from now on
        steady_malloc()

    def on_grad(i, g):
        events.append(("B", i))
        out_grads[i] = g  # read after the call: an operator here would run under the watch

    def forward_hook(mod, inp, out):
        i = len(seen)
        seen.append(inp[0].shape[0])
        events.append(("F", i))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: on_grad(i, g))  # backward() and autograd.grad alike

    hooks = [model.register_forward_hook(forward_hook)]
    hooks += [p.register_post_accumulate_grad_hook(lambda p, n=n: off.append(n) if not watch.on_stack() else None)
              for n, p in model.named_parameters()]
    try:
        with watch:
            got = fn(model, F.cross_entropy, x, y, k)
    finally:
        for hook in hooks:
            hook.remove()
    zero = [i for i, g in sorted(out_grads.items()) if not g.any()]
    return {"seen": seen, "events": events, "zero": zero, "off": off, "most": watch.most, "what": watch.what,
            "macs": dict(watch.macs), "loss": got if isinstance(got, torch.Tensor) else None,
            "grads": [[n, p.grad] for n, p in model.named_parameters()]}


def _one_at_a_time(name: str, res: dict, batch: int, k: int, hp: dict) -> None:
    """Accumulation's point is memory: only one micro-batch's activations alive at a time. So no operator
    reads more than a micro-batch of the batch, and each micro-batch's backward comes before the next forward."""
    cap = math.ceil(batch / k)
    if res["most"] > cap:
        raise AssertionError(f"{name}: {res['what']} at once; each forward and backward works on one micro-batch of "
                             f"<= {cap} samples (x.tensor_split(micro_batches)), never on the whole batch ({fmt(hp)})")
    events, want = res["events"], [e for i in range(len(res["seen"])) for e in (("F", i), ("B", i))]
    if events != want:
        missing = next((i for i in range(len(res["seen"])) if ("B", i) not in events), None)
        why = (f"micro-batch {missing}'s output got no gradient" if missing is not None
               else "a micro-batch's backward came after the next micro-batch's forward")
        raise AssertionError(f"{name}: {why} (forwards F, backwards B: {' '.join(f'{e}{i}' for e, i in events)}): "
                             f"call backward on each micro-batch's loss right after its forward, so that only one "
                             f"micro-batch's activations are alive at a time (summed losses and one backward keep "
                             f"every graph: the whole batch's memory) ({fmt(hp)})")


def _all_seen(name: str, res: dict, need: int, hp: dict) -> None:
    """The watch saw the work: every .grad accumulated while it was on the stack, the Linear layers'
    multiply-adds over the whole batch (`need`) in the forwards and in the backwards, no micro-batch's
    backward carrying nothing (a zero gradient: .grad filled by something else)."""
    if res["off"]:
        raise AssertionError(f"{name}: {res['off'][0]}.grad was accumulated while the grader's watch was off "
                             f"torch's dispatch stack: the backward {OUTSIDE} ({fmt(hp)})")
    for phase in ("forward", "backward"):
        if res["macs"][phase] < need:
            raise AssertionError(f"{name}: the grader's watch saw {res['macs'][phase]} multiply-adds in the {phase}s, "
                                 f"the model's Linear layers take {need} on the whole batch: the {phase} {OUTSIDE} "
                                 f"({fmt(hp)})")
    if res["zero"]:
        raise AssertionError(f"{name}: micro-batch {res['zero'][0]}'s output got an all-zero gradient: back-propagate "
                             f"each micro-batch's own loss, weighted by its share of samples; its backward is what "
                             f"fills .grad ({fmt(hp)})")


@check(forbid=("dlo.optim.utils.accumulate_gradients", *MODES))
def check_accumulate_gradients(fn, seed: int = 0, trials: int = 5) -> None:
    """`fn(model, loss_fn, x, y, micro_batches) -> loss` vs one backward on the whole batch's mean
    cross-entropy. Batch sizes are odd (unequal chunks); stale grads are pre-filled to test zeroing; a
    forward hook checks that the model really saw micro-batches that add up to the batch, a dispatch mode
    that no operator read more than a micro-batch of x or y and that the forwards and backwards ran under
    it, and hooks on each micro-batch's output that its backward came before the next forward (one
    micro-batch's activations alive at a time)."""
    name, cs = "accumulate_gradients", case_seed(seed)  # a secret seed when graded
    rng, gen = random.Random(cs), torch.Generator().manual_seed(cs)
    for t in range(trials + 1):
        batch, k = rng.choice([13, 21, 29, 31]), [4, 3, 1, 5, 2][t % 5]
        d_in, n_cls, hidden = rng.choice([5, 7]), rng.choice([3, 4]), 13
        if t == trials:  # the case whose memory the kernel counts (`_held`): the whole batch's activations 64 MiB
            batch, k, d_in, hidden = rng.choice([4093, 4099, 4111]), 16, 16, HELD_HIDDEN
        model = _tiny_mlp(gen, d_in, n_cls, hidden)
        x, y = rand((batch, d_in), gen), torch.randint(0, n_cls, (batch,), generator=gen)
        ref = _tiny_mlp(gen, d_in, n_cls, hidden)
        ref.load_state_dict(model.state_dict())
        want = F.cross_entropy(ref(x), y)
        want.backward()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=DTYPE)  # stale grads from a previous step
        # the kernel's count around the large case only; None in a notebook's check, where it is not judged
        before = student_memory(reset=True) if t == trials else None
        res = run_student(_accumulate_worker, fn, model, x, y, k, before is not None)
        after = student_memory() if before is not None else None
        seen, got = res["seen"], res["loss"]
        hp = dict(batch=batch, micro_batches=k)
        if (k > 1 and (len(seen) < 2 or max(seen) > math.ceil(batch / k))) or sum(seen) != batch:
            raise AssertionError(f"{name}: expected about {k} forward passes on micro-batches of <= "
                                 f"{math.ceil(batch / k)} samples covering the batch once, saw sizes {seen} "
                                 f"({fmt(hp)})")
        _one_at_a_time(name, res, batch, k, hp)
        _all_seen(name, res, batch * sum(m.weight.numel() for m in ref if isinstance(m, torch.nn.Linear)), hp)
        if not isinstance(got, torch.Tensor) or got.requires_grad:
            raise AssertionError(f"{name}: must return the whole-batch mean loss as a detached tensor ({fmt(hp)})")
        # rtol 1e-6: the loss is only logged, so a float32 running sum is acceptable here.
        assert_close(name, "returned loss (mean over the whole batch)", got, want.detach(), hp, rtol=1e-6)
        names = [n for n, _ in ref.named_parameters()]
        if [g[0] if isinstance(g, (list, tuple)) and g else None for g in res["grads"]] != names:
            raise AssertionError(f"{name}: the grader got the gradients of {len(res['grads'])} of the model's "
                                 f"{len(names)} parameters ({names}): every parameter's .grad must come back "
                                 f"({fmt(hp)})")
        for (pname, grad), r in zip(res["grads"], ref.parameters()):
            assert_close(name, f"{pname}.grad (weight each micro-batch mean loss by its share of samples)",
                         grad, r.grad, hp)
        if before is not None:
            _held(name, before, after, batch, hp)
    ok(name, f"{trials + 1} trials, seed={seed}")


def _held(name: str, before, after, batch: int, hp: dict) -> None:
    """The kernel's count of the student's process during the large case, read outside it under `dlo grade`
    (`student_memory`). The whole batch's hidden activations (batch x HELD_HIDDEN float64, ~64 MiB) alive at
    once, whatever the code did to the watch, grow it by at least twice that: tanh's input and output in the
    forward, the output and its gradient in the backward. Honest accumulation (micro-batches of 1/16) grew it by
    12-16 MiB (2026-12-01, 4 seeds). One whole batch's worth is allowed."""
    whole = batch * HELD_HIDDEN * DTYPE.itemsize
    assert_held(name, before, after, whole, f"more than the whole batch's hidden activations ({whole / 2 ** 20:.0f} "
                f"MiB): forward and backward one micro-batch at a time, so that only one micro-batch's are alive", hp)
