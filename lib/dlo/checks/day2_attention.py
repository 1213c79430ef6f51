"""Autograder check for Day 2's FlashAttention exercise: the forward pass block by block, in PyTorch
(`check_flash_attention`, re-exported by `dlo.checks.day2`, whose name the test cell calls).

The student's `fn(q, k, v, *, causal, block_k) -> (O, L)` runs in a worker (`dlo.grading.api.run_student`)
under a TorchDispatchMode that sees every tensor a torch operator makes: the largest one, and any fused
attention operator, come back with the result. The references are computed here, in float64, from the
same (rounded) inputs: O by torch's scaled_dot_product_attention, L by torch.logsumexp of the scores
written out (`dlo.attention.attention_scores`). What is checked, case by case:

- odd T (1 up to a few hundred), never a multiple of block_k, causal and not, D in {16, 64}, fp32 and
  bf16 inputs; with causal and T > block_k, a row's later key blocks are masked entirely (rowmax -inf):
  a nan there is its own message;
- the point of the algorithm: on cases where T x T outgrows every tensor a block-wise forward needs
  (T > 2 B H max(D, block_k)), no operator may produce a tensor of T * T elements or more (the scores,
  P, a full causal mask); no reduction along a dimension and no matmul's inner dimension may span more
  than max(D, block_k) elements (`_span`: an exact softmax, or P V, over all T keys, even taken a few
  query rows at a time, where no single tensor reaches T * T); and, in the last case, no more than a
  T x T fp32 matrix may be allocated outside torch (tracemalloc: numpy, Python lists), which no
  dispatch mode sees. No fused attention operator may run at all: each is refused at dispatch whatever
  reached it (`FORBID`'s "aten::" patterns, `dlo.grading.ops`), and the watch reports one that ran anyway.
- in every case, the watch must have seen the attention's work (`_all_seen`): the multiply-adds of q k^T
  and P V over every (query, key) pair the mask keeps, in torch's matmuls, sums and products (`_work`).
  Work it does not see escapes every rule above: numpy or Python (a softmax over all keys a few rows at a
  time holds little memory), or torch past the watch (the mode popped, Python dispatch switched off; the
  one-line ways are also forbidden: `dlo.checks.saved.MODES`).

Code that finds the watch (on torch's dispatch stack, or among the interpreter's objects) can rewrite what it
counted, or stop tracemalloc. So, under `dlo grade`, a case of ~4,100 keys also has the process's memory read
by the kernel from outside it (`_held`, `dlo.grading.api.student_memory`): a (T, T) matrix shows there,
whatever the watch says. `_span` knows every softmax-like operator of torch (`SOFTMAXES`: a red team's softmax
over all keys went through `torch._masked_softmax`). Left open: other reductions that `_span` does not list
(scatter_add, a convolution); work
done outside torch beside as much torch work as the attention takes, for show; a softmax over all keys a few
query rows at a time (no (T, T) matrix) with the watch's span rewritten.
"""

from __future__ import annotations

import random
import tracemalloc

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.attention import attention_scores
from dlo.checks.saved import MODES
from dlo.grading.api import case_seed, check, run_student, student_memory
from dlo.grading.compare import assert_close, assert_held, fmt, ok
from dlo.measure import tensors_in
from dlo.measure.process import steady_malloc

# fp32: the student's fp32 sums over <= ~300 keys, in another order than float64's, differ by ~1e-6;
# 1e-5 leaves a margin of 10 while a missing rescale or a shifted mask errs by O(0.1-1).
FP32_TOL = 1e-5
# bf16: the inputs are rounded to bf16 before either side sees them (so that is not an error); O is
# rounded to bf16 once at the end (relative 2^-9) and P may be rounded to bf16 before P V as the
# kernel does (another 2^-9 per term): 1e-2 (atol and rtol; O is a convex mix of |v| <= ~4) is a few
# bf16 ulps. L is fp32 arithmetic on the bf16 values in both dtypes (the exercise computes in fp32):
# FP32_TOL.
BF16_O_TOL = 1e-2
# Memory outside torch (numpy, Python objects; tracemalloc) that the watch itself and a block-wise forward
# in torch allocate stays at 5-60 kB: at least 256 kiB (T x T fp32 for T = 256, below the last case's T)
# is asked before a verdict.
HOST_FLOOR = 1 << 18
FUSED = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
FORBID = ("torch.nn.functional.scaled_dot_product_attention", "dlo.attention.*", *MODES,
          "dlo.kernels.flash_attention.flash_attention", "dlo.kernels.flash_attention.flash_attention_ref",
          "dlo.kernels.flash_attention.flash_attention_blocked_ref",
          *(f"aten::{op}*" for op in ("scaled_dot_product", "_scaled_dot_product", "_flash_attention",
                                      "_efficient_attention", "_cudnn_attention")),  # every fused kernel, at dispatch
          "aten::_nested_tensor_softmax_with_shape")  # a softmax over a nested tensor's last dimension: no dim to read


# Operators that sum or reduce along a dimension: a softmax, its maximum and sum, or P V over all T keys
# is one of them spanning T (`_span`). Full reductions (x.max(), x.all()) are left alone: a debugging
# check of a whole tensor is no attention, and O itself needs a contraction over the keys.
# Every softmax-like operator this torch has is one (the composite ones, softmax, log_softmax and special_*, reach
# the watch as `_softmax` / `_log_softmax` / `logsumexp` / `_logcumsumexp`; a red team's exact softmax over all T
# keys a few rows at a time went through `_masked_softmax`, which the list lacked); their backward operators read
# `grad_output` and `output` instead of `self`, and `_masked_softmax`'s dim=None is the last dimension (`LAST_DIM`).
SOFTMAXES = ("_softmax", "_log_softmax", "_safe_softmax", "_masked_softmax", "_sparse_softmax", "_sparse_log_softmax",
             "_softmax_backward_data", "_log_softmax_backward_data", "_masked_softmax_backward",
             "_sparse_softmax_backward_data", "_sparse_log_softmax_backward_data", "softmax", "log_softmax",
             "special_softmax", "special_log_softmax", "logsumexp", "special_logsumexp", "logcumsumexp",
             "_logcumsumexp")
LAST_DIM = frozenset(("_masked_softmax", "_masked_softmax_backward"))
REDUCTIONS = frozenset(("sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", *SOFTMAXES, "prod", "argmax",
                        "argmin", "topk", "sort", "kthvalue", "median", "nanmedian", "mode", "var", "std", "var_mean",
                        "std_mean", "norm", "linalg_vector_norm", "cumsum", "cumprod", "cummax", "cummin"))
CONTRACTIONS = frozenset(("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"))
# What q k^T and P V take, however written (a matmul, or a broadcast product summed; einsum multiplies without
# a sum where the contracted dimension is 1: a last key block of one key): a contraction's multiply-adds, a
# sum's additions, a product's multiplications (`_work`). Every other operator is free.
SUMS, PRODUCTS = frozenset(("sum", "nansum", "mean")), frozenset(("mul", "mul_"))


_PLANS: dict = {}  # an operator -> where its operand and dim are (`_plan`), read once per operator
OPERANDS = ("self", "grad_output")  # a reduction's operand: the backward operators' is the incoming gradient


def _plan(func) -> tuple | None:
    """((position, name) of the operand, (position, name) of `dim` or None) of a contraction or a
    reduction along a dimension; None for every other operator."""
    if func not in _PLANS:
        name, args = func.overloadpacket.__name__, [a.name for a in func._schema.arguments]
        where = lambda n: (args.index(n), n)  # noqa: E731
        if name in CONTRACTIONS:
            _PLANS[func] = (where(next(n for n in ("mat1", "batch1", "mat", "self") if n in args)), None)
        elif name in REDUCTIONS and "dim" in args and any(n in args for n in OPERANDS):
            _PLANS[func] = (where(next(n for n in OPERANDS if n in args)), where("dim"))
        else:
            _PLANS[func] = None
    return _PLANS[func]


def _span(func, args: tuple, kwargs: dict) -> int:
    """How many elements of one input dimension each output element of a contraction (the inner
    dimension of a matmul) or of a reduction along `dim` combines; 0 for every other operator."""
    plan = _plan(func)
    if plan is None:
        return 0
    (i, name), dim_at = plan
    x = args[i] if i < len(args) else kwargs.get(name)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 0
    if dim_at is None:
        return x.shape[-1]
    dim = args[dim_at[0]] if dim_at[0] < len(args) else kwargs.get(dim_at[1])
    if dim is None and func.overloadpacket.__name__ in LAST_DIM:
        dim = -1
    dims = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
    return int(torch.Size(x.shape[d] for d in dims).numel()) if dims else 0  # no dim: a full reduction, not counted


_OPS: dict = {}  # an operator -> (its name, fused attention?, how its work counts): read once per operator


def _op(func) -> tuple[str, bool, str | None]:
    if func not in _OPS:
        name = func.overloadpacket.__name__
        kind = "sum" if name in SUMS else "product" if name in PRODUCTS else "contraction" if name in CONTRACTIONS \
            else None
        _OPS[func] = (name, any(f in name for f in FUSED), kind)
    return _OPS[func]


def _work(func, kind: str, args: tuple, kwargs: dict, out) -> int:
    """A contraction's multiply-adds (its operand, (.., m, k), times the next one's n), a sum's inputs, a
    product's outputs (`kind`, from `_op`)."""
    if kind != "contraction":
        x = (args[0] if args else kwargs.get("self")) if kind == "sum" else out
        return x.numel() if isinstance(x, torch.Tensor) else 0
    i = _plan(func)[0][0]
    x, y = (args[j] if j < len(args) else kwargs.get(func._schema.arguments[j].name) for j in (i, i + 1))
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return 0
    return x.numel() * (y.shape[-1] if y.dim() >= 2 else 1)


class _Watch(TorchDispatchMode):
    """Every operator's outputs while active: the largest tensor (elements, and which op made it), the
    widest contraction or reduction (`_span`), the work of the contractions, sums and products (`_work`),
    and the fused attention operators called (SDPA reaches one on every device)."""

    def __init__(self):
        super().__init__()
        self.numel, self.what, self.span, self.span_what, self.fused, self.work = 0, "", 0, "", set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name, fused, kind = _op(func)
        if fused:
            self.fused.add(f"aten.{name}")
        span = _span(func, args, kwargs or {})
        if kind:
            self.work += _work(func, kind, args, kwargs or {}, out)
        if span > self.span:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.span, self.span_what = span, f"aten.{name} on {', '.join(map(str, shapes))}"
        for t in tensors_in(out):
            if t.numel() > self.numel:
                self.numel = t.numel()
                self.what = f"aten.{name} made a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
        return out


def _flash_worker(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_k: int,
                  trace: bool, steady: bool = False) -> dict:
    """The student's forward under `_Watch`: its (O, L) (or what it returned instead, described) and
    what the watch saw; with `trace`, also the peak of memory allocated outside torch during the call
    (tracemalloc: numpy's arrays and Python objects, which no dispatch mode sees)."""
    if steady:  # the kernel counts this call (`_held`): malloc returns large blocks at free from now on
        steady_malloc()
    tracing = tracemalloc.is_tracing()
    if trace and not tracing:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0] if trace else 0
    if trace:
        tracemalloc.reset_peak()
    try:
        with _Watch() as watch:
            got = fn(q, k, v, causal=causal, block_k=block_k)
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base if trace else 0
        if trace and not tracing:
            tracemalloc.stop()
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got):
        out = [x.detach() for x in got]
    else:
        kinds = [type(x).__name__ for x in got] if isinstance(got, (tuple, list)) else type(got).__name__
        out = f"a {type(got).__name__} of {kinds}" if isinstance(got, (tuple, list)) else f"a {kinds}"
    return {"out": out, "numel": watch.numel, "what": watch.what, "span": watch.span, "span_what": watch.span_what,
            "fused": sorted(watch.fused), "work": watch.work, "host_bytes": peak}


def _cases(rng: random.Random, trials: int) -> list[dict]:
    """`trials` random cases (T odd and not a multiple of block_k; every other one causal; the last one
    bf16) with the case of ~4k keys whose memory the kernel counts second, then the two materialisation cases
    (T well above block_k, causal and not)."""
    cases = []
    for t in range(trials):
        block_k = rng.choice([8, 16, 32])
        T = rng.choice([1, 17, 33, 67, 101, 129]) if t else rng.choice([1, 7])  # one below block_k
        dtype = torch.bfloat16 if t == trials - 1 else torch.float32
        cases.append(dict(B=rng.choice([1, 2]), H=rng.choice([1, 3]), T=T, D=rng.choice([16, 64]), block_k=block_k,
                          causal=t % 2 == 1, dtype=dtype))
    T = rng.choice([257, 263, 301])
    cases += [dict(B=1, H=2, T=T, D=16, block_k=32, causal=c, dtype=torch.float32) for c in (True, False)]
    # second, the case whose memory the kernel counts (`_held`): after the first call has imported what a dispatch
    # mode imports once (~90 MB in a fresh process), before any larger case could raise the process's mark
    cases.insert(1, dict(B=1, H=1, T=rng.choice([4093, 4099, 4111]), D=16, block_k=32, causal=False,
                         dtype=torch.float32))
    return cases


@check(forbid=FORBID)
def check_flash_attention(fn, seed: int = 0, trials: int = 4) -> None:
    """`fn(q, k, v, *, causal, block_k) -> (O, L)` on (B, H, T, D) inputs: O = softmax(q k^T / sqrt(D)) v
    in q's dtype (causal: query i sees keys j <= i), L (B, H, T) the log-sum-exp of each score row,
    computed block by block of `block_k` keys, never holding a (T, T) matrix."""
    name, rng = "flash_attention", random.Random(case_seed(seed))
    cases = _cases(rng, trials)
    for c in cases:
        hp = {**c, "dtype": str(c["dtype"]).removeprefix("torch.")}
        gen = torch.Generator().manual_seed(rng.randrange(10 ** 6))
        shape = (c["B"], c["H"], c["T"], c["D"])
        # q scaled by 3: scores of spread ~3, so the maximum grows from block to block and every
        # rescale matters
        q, k, v = (torch.randn(shape, generator=gen) * s for s in (3.0, 1.0, 1.0))
        q, k, v = (x.to(c["dtype"]) for x in (q, k, v))
        q64, k64, v64 = (x.double() for x in (q, k, v))
        o_ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=c["causal"])
        l_ref = torch.logsumexp(attention_scores(q64, k64, c["causal"]), dim=-1)
        # memory outside torch in the last case only: tracemalloc triples the cost of the call
        # the kernel's count around the ~4k-key case only; None in a notebook's check, where it is not judged
        before = student_memory(reset=True) if c is cases[1] else None
        got = run_student(_flash_worker, fn, q, k, v, c["causal"], c["block_k"], c is cases[-1], before is not None)
        after = student_memory() if before is not None else None
        _compare(name, got, c, o_ref, l_ref, hp)
        if before is not None:
            _held(name, before, after, c["T"], hp)
    ok(name, f"{trials + 3} cases, seed={seed}")


def _held(name: str, before, after, T: int, hp: dict) -> None:
    """The kernel's count of the student's process during the ~4k-key case, read outside it under `dlo grade`
    (`student_memory`): a forward that held a (T, T) fp32 matrix (64 MiB) grew by at least that, whatever it did
    to the watch; a block-wise one holds a few (T, block_k) blocks (0.5 MiB each). Half a matrix is allowed."""
    assert_held(name, before, after, 2 * T * T, f"more than half a (T x T) fp32 matrix, T={T}: hold one block of "
                f"block_k={hp['block_k']} keys at a time", hp)


def _large(c: dict) -> bool:
    """A case where T x T outgrows every tensor a block-wise forward needs."""
    return c["T"] > 2 * c["B"] * c["H"] * max(c["D"], c["block_k"])


def _compare(name: str, got: dict, c: dict, o_ref: torch.Tensor, l_ref: torch.Tensor, hp: dict) -> None:
    """One case's verdict: what was returned, fused operators, the work seen, nan, then values, then the largest
    tensor."""
    B, H, T, D = o_ref.shape
    if isinstance(got["out"], str):
        raise AssertionError(f"{name}: return (O, L), two tensors; got {got['out']} ({fmt(hp)})")
    o, lse = got["out"]
    if o.shape != o_ref.shape or o.dtype != c["dtype"]:
        raise AssertionError(f"{name}: O must be q's shape {tuple(o_ref.shape)} and dtype {hp['dtype']}, got "
                             f"{tuple(o.shape)} {str(o.dtype).removeprefix('torch.')} ({fmt(hp)})")
    if lse.shape != l_ref.shape or not lse.is_floating_point():
        raise AssertionError(f"{name}: L must be a float tensor of shape (B, H, T) = {tuple(l_ref.shape)}, got "
                             f"{tuple(lse.shape)} {str(lse.dtype).removeprefix('torch.')} ({fmt(hp)})")
    if got["fused"]:
        raise AssertionError(f"{name}: the exercise asks for your own implementation; {', '.join(got['fused'])} "
                             f"is torch's fused attention ({fmt(hp)})")
    _all_seen(name, got, c, hp)
    bad = o.isnan().any(dim=-1) | lse.isnan()
    if bad.any():
        rows = bad.flatten(0, 1).any(dim=0).nonzero().flatten().tolist()  # the query positions with a nan
        why = ("query 0 has no key left: causal keeps the keys j <= i, the diagonal included" if rows == [0]
               else "exp(-inf - (-inf)) is nan: a key block that causality masks entirely has rowmax -inf; take exp "
                    "against the running maximum m_new (finite once a row has seen key 0), not the block's own max")
        raise AssertionError(f"{name}: nan at {len(rows)} of {T} query positions, the first {rows[0]}: {why} "
                             f"({fmt(hp)})")
    fp32 = "" if c["dtype"] == torch.float32 else "; compute in fp32 (q.float()), a bf16 score is 3 digits"
    assert_close(name, f"L (m + log l per row; rescale l by exp(m_old - m_new) whenever the maximum grows{fp32})",
                 lse, l_ref, hp, rtol=FP32_TOL, atol=FP32_TOL)
    tol = FP32_TOL if c["dtype"] == torch.float32 else BF16_O_TOL
    assert_close(name, "O (rescale the unnormalised output by exp(m_old - m_new) whenever the maximum grows; "
                       "divide by l once, after the last block)", o, o_ref, hp, rtol=tol, atol=tol)
    if not _large(c):
        return
    blocks = f"hold one block of block_k={c['block_k']} keys at a time"
    if got["numel"] >= T * T:
        raise AssertionError(f"{name}: materialised a (T x T) matrix: {got['what']}, T={T}; {blocks} (its causal "
                             f"mask too) ({fmt(hp)})")
    if got["span"] > max(D, c["block_k"]):
        raise AssertionError(f"{name}: {got['span_what']} combined {got['span']} elements of one dimension at once, "
                             f"more than block_k={c['block_k']} keys (or D={D}): a softmax or P V over all T={T} keys "
                             f"is not FlashAttention; {blocks}, with the running max m and sum l ({fmt(hp)})")
    if got["host_bytes"] >= max(4 * T * T, HOST_FLOOR):
        raise AssertionError(f"{name}: {got['host_bytes']} bytes allocated outside torch (numpy arrays, Python "
                             f"lists) during the call, a (T x T) fp32 matrix is {4 * T * T}, T={T}: write the forward "
                             f"in PyTorch, {blocks} ({fmt(hp)})")


def _all_seen(name: str, got: dict, c: dict, hp: dict) -> None:
    """The watch saw the attention's work: q k^T and P V over every (query, key) pair causality keeps, D
    multiply-adds each, in torch's contractions, sums or products. Work done elsewhere (numpy, Python, past the watch:
    a dispatch mode popped or disabled) escapes every rule above, and is missing here."""
    B, H, T, D = (c[n] for n in "BHTD")
    need = 2 * B * H * D * (T * (T + 1) // 2 if c["causal"] else T * T)
    if got["work"] < need:
        raise AssertionError(f"{name}: torch's operators did {got['work']} multiply-adds, q k^T and P V over the "
                             f"(query, key) pairs take {need}: the attention ran outside torch's dispatcher (numpy, "
                             f"Python, a dispatch mode popped or disabled), where the grader's watch does not see it; "
                             f"write the forward in PyTorch ({fmt(hp)})")
