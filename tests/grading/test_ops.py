"""dlo.grading.ops: a notebook's check refuses its forbidden operators while it runs and gives torch's
kernels back entirely afterwards; in a process that ends with the check they stay refused."""

import pytest
import torch

from dlo.checks import day2_attention
from dlo.grading.forbid import ForbiddenCall, forbidden
from tests.forked import in_a_fork

SDPA = torch.nn.functional.scaled_dot_product_attention


def _fake_sdpa():
    """SDPA on fake tensors, as `dlo plan` runs a model's step."""
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q = torch.empty(1, 2, 8, 4)
        return SDPA(q, q, q).shape


def test_a_notebook_s_check_leaves_torch_as_it_found_it():
    """Undoing a dispatcher registration left FakeTensorMode running the refusing kernel as the operator's
    meta kernel: after Day 2's attention check, a notebook's `dlo plan` (fake tensors) failed."""
    q = torch.randn(1, 2, 8, 4)
    with forbidden(day2_attention.FORBID, "flash_attention"):
        with pytest.raises(ForbiddenCall, match="aten::_scaled_dot_product_flash_attention_for_cpu"):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)  # any holder of the operator
    assert SDPA(q, q, q).shape == q.shape
    assert _fake_sdpa() == (1, 2, 8, 4)


def test_in_a_process_that_ends_with_the_check_they_stay_refused():
    def after_the_check() -> str:
        with forbidden(day2_attention.FORBID, "flash_attention", for_good=True):
            pass
        q = torch.randn(1, 2, 8, 4)
        try:
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
        except ForbiddenCall:
            return "refused"
        return "ran"

    assert in_a_fork(after_the_check) == "refused"
