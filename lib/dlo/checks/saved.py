"""The saved-tensor meter of the checks that forbid saved-tensor hooks (Days 3, 6 and 7); the ways out of a
dispatch mode that Days 1 and 2 forbid.

PyTorch applies only the innermost pair of saved-tensor hooks: a student's own pair inside the grader's meter
(an identity pair around an ordinary forward) would hide from it everything the forward saves, and popping the
meter's would blind it. Those checks forbid `HOOKS` in the student's code; this meter pushes and pops its own
through autograd's C functions, taken here at import, before anything is blocked (the checks' modules are
sealed where student code runs, so these references are not reachable from it).

`MODES`: the one-line ways out of a check's TorchDispatchMode (Days 1 and 2 watch the student's operators through
one; `torch.utils._mode_utils.no_dispatch` is `_DisableTorchDispatch`), forbidden by name. Not the pops a tensor's
repr makes (`_disable_current_modes`, `_pop_mode`, `torch._C._pop_torch_dispatch_stack`: a print(x) in the
exercise must work), nor the dispatch-key guards (each forbidden name costs ~0.3 ms per call of the student's
code): those checks also require their mode to have seen the exercise's work, which the other ways out miss.
"""

from __future__ import annotations

import torch

from dlo.measure import SavedTensorMeter

HOOKS = ("torch.autograd.graph.saved_tensors_hooks", "torch._C._autograd._push_saved_tensors_default_hooks",
         "torch._C._autograd._pop_saved_tensors_default_hooks")
MODES = ("torch.utils._python_dispatch._pop_mode_temporarily", "torch._C._DisableTorchDispatch")
_PUSH = torch._C._autograd._push_saved_tensors_default_hooks
_POP = torch._C._autograd._pop_saved_tensors_default_hooks


class GuardedMeter(SavedTensorMeter):
    """`SavedTensorMeter`, its hooks pushed through the C functions captured at import."""

    def __enter__(self):
        _PUSH(self._pack, self._unpack)
        return self

    def __exit__(self, *exc):
        _POP()
