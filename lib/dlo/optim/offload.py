"""Optimizer state in host memory, stepped on the CPU (ZeRO-Offload, Ren et al. 2021).

AdamW keeps two fp32 moments per parameter: 8 bytes, as much as the fp32 parameter and its
gradient together; in mixed precision it also keeps an fp32 master copy, 12 of the "16 bytes per
parameter" (Rajbhandari et al. 2020). ZeRO-Offload moves that state, and the update itself, to the
host: after backward every gradient is copied into host memory (pinned, so the copy is a DMA that
can overlap the rest of backward), the CPU runs Adam on the fp32 master weights there (DeepSpeed's
vectorised CPU-Adam), and the updated weights are copied back. The accelerator keeps only the
weights and the gradients; the price is the two transfers per step and a CPU-speed update, which
ZeRO-Offload hides by overlapping them with the next step's compute (and, optionally, by delaying
the update one step).

`CPUOffloadOptimizer(params, torch.optim.AdamW, lr=...)` is the plain version of that step
(copies, CPU update, copies back; no overlap): same arithmetic as the wrapped optimizer on the
master copies, so on a CPU its parameters equal plain AdamW's bit for bit. Where each byte lives
is `bytes_by_side()`; `dlo.measure.optimizer_state_bytes` counts what a plain optimizer keeps
beside its parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlo.measure import tensor_bytes


class CPUOffloadOptimizer:
    """Wrap an optimizer class so that its state and its update live in host memory.

    `params` stay where they are (the accelerator); fp32 master copies, their gradients and the
    wrapped optimizer's state are host tensors (pinned when CUDA exists). `step()` copies the
    gradients to the host, steps the wrapped optimizer there and copies the weights back; `zero_grad`,
    `state_dict` and `param_groups` behave as the wrapped optimizer's.
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        self.params: list[Tensor] = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("CPUOffloadOptimizer: no parameter requires grad")
        pin = torch.cuda.is_available()  # pinned pages make the device <-> host copies asynchronous DMAs
        self.master = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin) for p in self.params]
        for m, p in zip(self.master, self.params):
            m.copy_(p.detach())
            m.grad = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
        self.inner = optimizer_cls(self.master, **kwargs)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Gradients to the host, the wrapped optimizer's step on the master copies, weights back."""
        skipped = []
        for p, m in zip(self.params, self.master):
            if p.grad is None:  # a parameter without gradient keeps its state untouched, as in torch
                skipped.append((m, m.grad))
                m.grad = None
            else:
                m.grad.copy_(p.grad, non_blocking=True)
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()  # the asynchronous copies must land before the CPU reads them
        self.inner.step()
        for m, g in skipped:
            m.grad = g
        for p, m in zip(self.params, self.master):
            p.copy_(m, non_blocking=True)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def bytes_by_side(self) -> dict[str, int]:
        """{"device": bytes this optimizer holds on an accelerator (none: every tensor it allocates
        is a host tensor), "host": fp32 master weights + their gradients + the wrapped optimizer's
        state}. Exact by accounting; on a CPU-only machine both sides are the same memory."""
        held = [*self.master, *(m.grad for m in self.master if m.grad is not None),
                *(t for s in self.inner.state.values() for t in s.values() if isinstance(t, Tensor))]
        device = tensor_bytes([t for t in held if t.device.type != "cpu"])
        return {"device": device, "host": tensor_bytes(held) - device}
