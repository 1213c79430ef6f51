"""The same work under another holder (a red-team audit, 2026-12-02): for Days 1, 6, 7, 8, 10 and 11 every library
and torch function doing a graded exercise's work was called from a student's function under the exercise's check.
Those that passed are off limits now; each test shows such a delegating function fails with "is off limits" and the
instructors' solution still passes.

Holes found, all Day 7: torch's tensor-parallel styles (`ColwiseParallel()._apply`, `RowwiseParallel()._apply`,
src_data_rank=None) did exercise 1's column and row layers; torch's autograd-aware collectives
(`torch.distributed.nn.functional`, funcol's `*_autograd`) and Day 7's collective matmuls with an identity weight
(`dlo.distributed.async_tp`) exercise 4's gather_fn and scatter_fn; the private functions behind `loss_parallel`
(`torch.distributed.tensor.parallel.loss._log_softmax`, `_nll_loss_forward`, `_nll_loss_and_log_softmax_backward`)
exercise 5's cross-entropy. A forbidden call on a rank ends a pool of ranks: those checks launch their own.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo.checks import day7
from dlo.grading.forbid import ForbiddenCall, forbidden
from tests.checks.conftest import load_solution

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sol():
    return load_solution("day7_tensor_parallel")


def _students() -> SimpleNamespace:
    """The delegating students' code, made in a function: cloudpickle ships it to the ranks by value (a module-level
    object goes by reference, and this module imports the grader, sealed where the student's code runs)."""
    def _mesh(group):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group or dist.group.WORLD, "cpu")


    class _Local:
        """A DTensor parameter's local block, as the check reads `layer.weight.grad`."""

        def __init__(self, p):
            self.p = p

        @property
        def grad(self):
            return None if self.p.grad is None else self.p.grad.to_local()


    class _Styled(nn.Module):
        """A linear split by one of torch's tensor-parallel styles, the rank's own block kept (src_data_rank=None)."""

        def __init__(self, linear, style, group):
            super().__init__()
            style.src_data_rank = None
            self.lin = style._apply(copy.deepcopy(linear), _mesh(group))

        def forward(self, x):
            y = self.lin(x)
            return y.clone() if type(y) is not torch.Tensor else y  # an AsyncCollectiveTensor waited for

        def __getattr__(self, name):
            if name in ("weight", "bias"):
                return _Local(getattr(self._modules["lin"], name))
            return super().__getattr__(name)


    class ColwiseColumn(_Styled):
        def __init__(self, linear, group=None, gather_output=False):
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel

            style = ColwiseParallel(output_layouts=Replicate()) if gather_output else ColwiseParallel()
            super().__init__(linear, style, group)


    class RowwiseRow(_Styled):
        def __init__(self, linear, group=None):
            from torch.distributed.tensor.parallel import RowwiseParallel

            super().__init__(linear, RowwiseParallel(), group)


    def gather_nn_functional(x, group=None):
        import torch.distributed.nn.functional as dnn

        return torch.cat(dnn.all_gather(x, group=group or dist.group.WORLD), 1)


    def gather_funcol_autograd(x, group=None):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_gather_tensor_autograd(x.contiguous(), 1, group or dist.group.WORLD)


    def scatter_identity_matmul(x, group=None):
        from dlo.distributed.async_tp import matmul_reduce_scatter

        return matmul_reduce_scatter(x, torch.eye(x.shape[-1], dtype=x.dtype), 1, group)


    def _waited(t):
        return t.wait() if type(t) is not torch.Tensor and hasattr(t, "wait") else t


    def ce_loss_parallel_privates(logits, target, group=None):
        """torch's vocabulary-parallel cross-entropy, called on the rank's logits (what loss_parallel switches on)."""
        from torch.distributed.tensor.parallel import loss

        mesh = _mesh(group)
        shape = torch.Size((logits.shape[0], logits.shape[1] * mesh.size()))

        class CrossEntropy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ls = _waited(loss._log_softmax(x, 1, False, mesh, 0))
                out, total = loss._nll_loss_forward(ls, target, None, None, 1, -100, shape, 1, mesh, 0)
                ctx.save_for_backward(ls, total)
                return _waited(out).clone()

            @staticmethod
            def backward(ctx, g):
                ls, total = ctx.saved_tensors
                return _waited(loss._nll_loss_and_log_softmax_backward(g, ls, target, None, 1, -100, total, shape, 1,
                                                                       mesh, 0))
        return CrossEntropy.apply(logits)

    return SimpleNamespace(ColwiseColumn=ColwiseColumn, RowwiseRow=RowwiseRow,
                           gather_nn_functional=gather_nn_functional, gather_funcol_autograd=gather_funcol_autograd,
                           scatter_identity_matmul=scatter_identity_matmul,
                           ce_loss_parallel_privates=ce_loss_parallel_privates)


STUDENT = _students()


# ----------------------------------------------------------------------------- the solution passes (pooled ranks)

def test_the_solution_passes_the_linears(sol, ranks):
    day7.check_tp_linears(sol.f, sol.g, sol.ColumnParallelLinear, sol.RowParallelLinear, seed=4)


def test_the_solution_passes_sequence_parallelism(sol, ranks):
    day7.check_sequence_parallel(sol.gather_from_sp, sol.reduce_scatter_to_sp, sol.SequenceParallelMLP, seed=4)


def test_the_solution_passes_the_vocab_parallel_cross_entropy(sol, ranks):
    day7.check_vocab_parallel_cross_entropy(sol.vocab_parallel_cross_entropy, seed=4)


# ----------------------------------------------------------------------------- each holder fails (ranks of its own)

def test_torch_colwise_style_is_off_limits_in_the_linears(sol):
    with pytest.raises(AssertionError, match="ColwiseParallel is off limits"):
        day7.check_tp_linears(sol.f, sol.g, STUDENT.ColwiseColumn, sol.RowParallelLinear)


def test_torch_rowwise_style_is_off_limits_in_the_linears(sol):
    with pytest.raises(AssertionError, match="RowwiseParallel is off limits"):
        day7.check_tp_linears(sol.f, sol.g, sol.ColumnParallelLinear, STUDENT.RowwiseRow)


def test_torch_autograd_all_gather_is_off_limits_in_sequence_parallelism(sol):
    with pytest.raises(AssertionError, match="nn.functional.all_gather is off limits"):
        day7.check_sequence_parallel(STUDENT.gather_nn_functional, sol.reduce_scatter_to_sp, sol.SequenceParallelMLP)


def test_funcol_autograd_all_gather_is_off_limits_in_sequence_parallelism(sol):
    with pytest.raises(AssertionError, match="all_gather_tensor_autograd is off limits"):
        day7.check_sequence_parallel(STUDENT.gather_funcol_autograd, sol.reduce_scatter_to_sp, sol.SequenceParallelMLP)


def test_the_collective_matmul_is_off_limits_in_sequence_parallelism(sol):
    with pytest.raises(AssertionError, match="async_tp.matmul_reduce_scatter is off limits"):
        day7.check_sequence_parallel(sol.gather_from_sp, STUDENT.scatter_identity_matmul, sol.SequenceParallelMLP)


def test_loss_parallel_privates_are_off_limits_in_the_cross_entropy():
    with pytest.raises(AssertionError, match="loss._log_softmax is off limits"):
        day7.check_vocab_parallel_cross_entropy(STUDENT.ce_loss_parallel_privates)


def test_torch_s_cross_layer_equalization_is_off_limits_in_smoothing():
    """Day 8's smoothing factors at alpha = 0.5 are torch's cross-layer equalization's scale (the root of the ranges'
    ratio): the check forbids the module, and still passes the solution."""
    from torch.ao.quantization import _equalize

    from dlo.checks import day8_smooth

    with pytest.raises(ForbiddenCall, match="_equalize"):
        with forbidden(day8_smooth.check_smoothing_factors.forbid, "smoothing_factors"):
            _equalize.cross_layer_equalization(nn.Linear(3, 3), nn.Linear(3, 3))
    day8_smooth.check_smoothing_factors(load_solution("day8_quantization_pruning").smoothing_factors)
