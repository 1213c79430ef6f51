"""Activation checkpointing: recompute in backward instead of saving, or offload to host memory.

A layer's backward needs some tensors of its forward (inputs of matmuls, softmax outputs, dropout
masks, ...). Autograd keeps them alive from forward to backward: that is the activation memory, and
it grows with batch x sequence x depth. Checkpointing a function keeps only its inputs and runs its
forward again during backward (Chen et al. 2016, "Training deep nets with sublinear memory cost"):
for n layers cut into sqrt(n) segments the memory falls from O(n) to O(sqrt(n)) for one extra
forward pass. `torch.utils.checkpoint` is the production version; this one is short and readable.

- `checkpoint(fn, *args)`: `CheckpointFunction`, RNG state replayed so dropout draws the same masks.
- `every_kth(n, k)`: the block indices of the "checkpoint every k-th block" policy.
- `cpu_offload()`: saved tensors live in (pinned) host memory between forward and backward.

What a policy saves and costs is measured by `dlo.measure` (`saved_bytes`, `measure_step`), the
rows of Day 3's table by `dlo.experiments.day3.policy_rows`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

_AMP_DEVICES = ("cpu", "cuda")


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AMP_DEVICES]


class CheckpointFunction(torch.autograd.Function):
    """y = fn(*args) without saving fn's intermediate tensors; backward recomputes them.

    Forward runs fn under no_grad and saves only the tensor inputs, the CPU (and used CUDA devices')
    RNG states and the autocast state. Backward restores those states inside `fork_rng` (so the
    caller's RNG stream is not disturbed), re-runs fn with grad on detached inputs, and back-propagates
    the incoming gradients through that fresh graph. Parameters used by fn get their .grad from that
    inner backward, hence at least one input must require grad (else forward's output has no grad_fn).
    """

    @staticmethod
    def forward(ctx, fn, preserve_rng_state, *args):
        ctx.fn, ctx.preserve = fn, preserve_rng_state
        ctx.tensor_idx = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.others = [None if isinstance(a, Tensor) else a for a in args]
        ctx.autocast = _autocast_state()
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_devices = sorted({a.device.index for a in args if isinstance(a, Tensor) and a.is_cuda})
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_idx))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)  # a fresh leaf per input
        devices = ctx.cuda_devices if ctx.preserve else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.preserve), contextlib.ExitStack() as stack:
            if ctx.preserve:
                torch.set_rng_state(ctx.cpu_rng)
                for d, state in zip(devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            for dev, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            with torch.enable_grad():
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [a.grad if isinstance(a, Tensor) else None for a in args]
        return (None, None, *grads)


def checkpoint(fn, *args, preserve_rng_state: bool = True):
    """fn(*args) with activation checkpointing (CheckpointFunction). fn returns a tensor or a tuple of them."""
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    if torch.is_grad_enabled() and not any(isinstance(a, Tensor) and a.requires_grad for a in args):
        raise ValueError("checkpoint: no input requires grad, so the output would have no grad_fn and fn's "
                         "parameters would get no gradient; pass at least one input that requires grad "
                         "(e.g. the output of an embedding) or run fn without checkpointing")
    return CheckpointFunction.apply(fn, preserve_rng_state, *args)


def every_kth(n_blocks: int, k: int) -> list[int]:
    """Blocks 0, k, 2k, ... (k >= 1) to checkpoint; k = 0 checkpoints none, k = 1 all."""
    if k < 0 or n_blocks < 0:
        raise ValueError(f"every_kth: n_blocks and k must be >= 0, got {n_blocks}, {k}")
    return [] if k == 0 else list(range(0, n_blocks, k))


# ----------------------------------------------------------------------------- offload to host memory

def offload_pack(t: Tensor):
    """Copy a saved tensor to host memory (pinned when CUDA exists, so the copy can be asynchronous)."""
    host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available() and t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return t.device, host


def offload_unpack(packed) -> Tensor:
    device, host = packed
    return host.to(device, non_blocking=True)


def cpu_offload():
    """Context manager: tensors saved for backward inside it live in host memory until backward."""
    return torch.autograd.graph.saved_tensors_hooks(offload_pack, offload_unpack)

