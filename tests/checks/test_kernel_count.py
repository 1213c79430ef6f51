"""The watch rewritten, the kernel's count kept (issue 33): Days 1-3's memory judged outside the process.

Day 1's accumulation and Day 2's FlashAttention are checked by a TorchDispatchMode in the process where the
student's code runs: what no operator may read or make at once (a whole batch, a (T, T) matrix); Day 3's
checkpoint by meters there of what its forward saved and kept. Code that finds them (torch's dispatch stack,
`gc`) and rewrites what they counted passes every rule there, as the notebook's own check shows below. Under
`dlo grade` each check also has a large case whose memory the grading process reads from /proc
(`dlo.grading.api.student_memory`): the sandbox's process cannot change that count, reset its high water mark
(it is not dumpable: /proc/self/clear_refs is root's), nor move the work into a child process unseen. Honest
work stays far under the allowance.
"""

from __future__ import annotations

import pytest

from dlo.checks.day1_accum import check_accumulate_gradients
from dlo.checks.day2_attention import check_flash_attention
from dlo.checks.day3 import check_checkpoint_function
from dlo.grading.jail import probe
from dlo.measure import process
from tests.checks.conftest import load_solution
from tests.checks.test_day1_checks import accum_autograd_grad, accum_chunk, accum_scaled_after
from tests.checks.test_day2_flash_checks import per_head_matrices, query_and_key_blocks

# no `one_thread` here: Day 3 compares gradients exactly, and its references must then take the sandboxed
# runner's thread count (the default, from the same environment, as under `dlo grade`)
pytestmark = pytest.mark.trust
needs_bwrap = pytest.mark.skipif(probe() != "bwrap", reason=f"bubblewrap cannot run here: {probe()}")

# The student's cell, in a module nothing can import: its functions travel by value, as a notebook's do.
STUDENT = '''
import gc, math, os, pickle
import torch

def _watch(attr):
    """The grader's dispatch mode, from torch's own stack (gc.get_objects() would also find it)."""
    modes = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    return next(w for w in modes if hasattr(w, attr))

def _naive(q, k, v, causal):
    T = q.shape[-2]
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), torch.logsumexp(s, -1)

def _hide_from_the_watch():
    w = _watch("span_what")
    w.numel, w.span = 1, 1  # no (T, T) tensor, no reduction over T keys, as far as the watch knows

def flash_rewritten(q, k, v, *, causal, block_k):
    """Plain attention, (T, T) scores and all; then the watch's records rewritten."""
    out = _naive(q, k, v, causal)
    _hide_from_the_watch()
    return out

def flash_mark_reset(q, k, v, *, causal, block_k):
    """The same, and the kernel's high water mark reset once the (T, T) matrices are freed."""
    out = _naive(q, k, v, causal)
    _hide_from_the_watch()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return out

def flash_in_a_child(q, k, v, *, causal, block_k):
    """The (T, T) work in a forked child, its result sent back; the watch told it saw the work."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, pickle.dumps([x.numpy() for x in _naive(q, k, v, causal)]))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        o, lse = (torch.from_numpy(x) for x in pickle.loads(f.read()))
    os.waitpid(pid, 0)
    watch = _watch("span_what")
    watch.work += 2 * q.shape[-2] * k.shape[-2] * q.shape[-1] * q.shape[0] * q.shape[1]
    return o.to(q.dtype), lse

def flash_blocks(q, k, v, *, causal, block_k):
    """FlashAttention's forward, one block of keys at a time."""
    B, H, T, D = q.shape
    qf, kf, vf = q.float() / math.sqrt(D), k.float(), v.float()
    m, l = torch.full((B, H, T), -math.inf), torch.zeros(B, H, T)
    o = torch.zeros(B, H, T, D)
    for s in range(0, T, block_k):
        sc = qf @ kf[:, :, s:s + block_k].transpose(-1, -2)
        if causal:
            keep = torch.arange(s, min(s + block_k, T))[None] <= torch.arange(T)[:, None]
            sc = sc.masked_fill(~keep, -math.inf)
        m_new = torch.maximum(m, sc.amax(-1))
        p, scale = torch.exp(sc - m_new[..., None]), torch.exp(m - m_new)
        l, o, m = l * scale + p.sum(-1), o * scale[..., None] + p @ vf[:, :, s:s + block_k], m_new
    return (o / l[..., None]).to(q.dtype), m + torch.log(l)

class CheckpointRewritten(torch.autograd.Function):
    """No recomputation: fn's graph built in forward and kept on ctx, the saved-bytes and allocation meters
    zeroed; fn called in backward for show (its RNG draws undone)."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn, ctx.inputs = fn, [a.detach().requires_grad_(a.requires_grad) for a in args]
        with torch.enable_grad():
            ctx.out = fn(*ctx.inputs)
        from dlo.measure.memory import SavedTensorMeter
        for meter in gc.get_objects():
            if isinstance(meter, SavedTensorMeter):
                meter.bytes = meter.peak = 0
        _watch("bytes").bytes = 0  # AllocationMeter, on the dispatch stack
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        with torch.no_grad(), torch.random.fork_rng():
            ctx.fn(*ctx.inputs)
        torch.autograd.backward(ctx.out, grad_output)
        return (None, *[t.grad if t.requires_grad else None for t in ctx.inputs])

def accumulate_rewritten(model, loss_fn, x, y, micro_batches):
    """One backward on the whole batch (all its activations alive); the hooks' and the watch's records then
    rewritten to show micro-batches, one at a time."""
    hook = next(iter(model._forward_hooks.values()))
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(model(x), y)
    loss.backward()
    _watch("macs").most = 1
    cells = {n: c.cell_contents for n, c in zip(hook.__code__.co_freevars, hook.__closure__)}
    sizes = [len(c) for c in x.tensor_split(micro_batches)]
    cells["seen"][:] = sizes
    cells["events"][:] = [e for i in range(len(sizes)) for e in (("F", i), ("B", i))]
    grads = next(c.cell_contents for c in cells["on_grad"].__closure__ if type(c.cell_contents) is dict)
    grads.update({i: torch.ones(1) for i in range(len(sizes))})
    return loss.detach()
'''


@pytest.fixture(scope="module")
def student():
    ns = {"__name__": "kernel_count_student"}
    exec(compile(STUDENT, "student cell", "exec"), ns)
    ns["accumulate_solution"] = load_solution("day1_optimizers").accumulate_gradients
    ns["checkpoint_solution"] = load_solution("day3_checkpointing").Checkpoint
    return type("Student", (), ns)


def test_a_rewritten_watch_passes_the_notebook_s_own_checks(student):
    """The hole: in the process that runs them, the watches and meters of these checks can be rewritten."""
    check_flash_attention(student.flash_rewritten)
    check_accumulate_gradients(student.accumulate_rewritten)
    check_checkpoint_function(student.CheckpointRewritten, device="cpu")


@needs_bwrap
@pytest.mark.parametrize("fn", ["flash_rewritten", "flash_mark_reset"])
def test_the_kernel_counts_the_scores_a_rewritten_watch_hides(student, jail, fn):
    with pytest.raises(AssertionError, match=r"resident memory grew by \d+ MiB .* half a \(T x T\) fp32 matrix"):
        jail.run(check_flash_attention, getattr(student, fn))


@needs_bwrap
def test_the_kernel_counts_the_whole_batch_a_rewritten_watch_hides(student, jail):
    with pytest.raises(AssertionError, match=r"resident memory grew by \d+ MiB .* whole batch's hidden activations"):
        jail.run(check_accumulate_gradients, student.accumulate_rewritten)


@needs_bwrap
def test_the_kernel_counts_the_graph_a_rewritten_meter_hides(student, jail):
    match = r"resident memory stayed \d+ MiB higher after the call.* fn's activations"
    with pytest.raises(AssertionError, match=match):
        jail.run(check_checkpoint_function, student.CheckpointRewritten, device="cpu")


@needs_bwrap
def test_work_moved_into_a_child_process_fails(student, jail):
    with pytest.raises(AssertionError, match="your code started a process while the grader measured its memory"):
        jail.run(check_flash_attention, student.flash_in_a_child)


@needs_bwrap
@pytest.mark.parametrize("seed", [0, 1])
def test_honest_work_passes_under_the_kernel_s_count(student, jail, seed):
    """The instructors' accumulation and this file's FlashAttention: a point lost here is a false negative."""
    jail.run(check_flash_attention, student.flash_blocks, seed=seed)
    jail.run(check_accumulate_gradients, student.accumulate_solution, seed=seed)
    jail.run(check_checkpoint_function, student.checkpoint_solution, seed=seed, device="cpu")


@needs_bwrap
def test_other_honest_variants_pass_under_the_kernel_s_count(jail):
    """The honest variants of the checks' own tests, written apart: chunk and index tensors, autograd.grad,
    .grad divided at the end; query and key blocks, one head at a time."""
    for fn in (query_and_key_blocks, per_head_matrices):
        jail.run(check_flash_attention, fn, seed=2)
    for fn in (accum_chunk, accum_autograd_grad, accum_scaled_after):
        jail.run(check_accumulate_gradients, fn, seed=2)


@needs_bwrap
def test_a_grader_that_may_not_reset_the_mark_judges_the_same(student, jail, monkeypatch):
    """Grading as an unprivileged user, the grading process may not write the sandbox's clear_refs either (root's,
    as for the student): the high water mark then runs from the session's start. Each large case comes after a
    small one, which has imported what the watch imports (~90 MB), so the mark is the resident size there, and
    the same verdicts follow (measured: 0.0 MiB between them before each large case)."""
    monkeypatch.setattr(process, "_reset", lambda pid: False)
    jail.run(check_flash_attention, student.flash_blocks, seed=3)
    jail.run(check_accumulate_gradients, student.accumulate_solution, seed=3)
    with pytest.raises(AssertionError, match=r"resident memory grew by \d+ MiB"):
        jail.run(check_flash_attention, student.flash_rewritten, seed=3)
    with pytest.raises(AssertionError, match=r"resident memory grew by \d+ MiB"):
        jail.run(check_accumulate_gradients, student.accumulate_rewritten, seed=3)
