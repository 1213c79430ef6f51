"""dlo.grading.identity.burn: a clone of a forbidden reference made before a check began (same code object,
held anywhere) is refused while the check runs and works again after it."""

import inspect
import types

import pytest
import torch

import dlo.optim.reference as ref
from dlo.checks import day1
from dlo.grading.forbid import ForbiddenCall, forbidden


def test_a_clone_made_before_the_check_is_burned_with_its_original():
    f = inspect.unwrap(ref.adamw_step)
    clone = types.FunctionType(f.__code__, f.__globals__, "mine", f.__defaults__, f.__closure__)
    clone.__kwdefaults__ = f.__kwdefaults__
    hidden = {"kept": clone}
    del clone

    def step():
        p = torch.zeros(2)
        hidden["kept"](p, torch.ones(2), torch.zeros(2), torch.zeros(2), 1, lr=0.1)
        return p

    with forbidden(day1.check_adamw_step.forbid, "adamw_step"), pytest.raises(ForbiddenCall):
        step()
    assert step().abs().sum() > 0  # given back


def test_a_forbidden_context_manager_takes_no_other_with_it():
    """@contextmanager's wrapper code (contextlib's `helper`) is every context manager's: burning it in every
    holder broke every `with` of the check's own process (Day 7's loss_parallel is forbidden)."""
    from contextlib import contextmanager

    from dlo.checks import day7_sequence

    @contextmanager
    def mine():
        yield 1

    with forbidden(day7_sequence.check_vocab_parallel_cross_entropy.forbid, "vocab_parallel_cross_entropy"):
        with mine() as one:
            assert one == 1
