"""Autograder checks, one module per day: `dlo.checks.day1.check_adamw_step(adamw_step)`.

A notebook's locked test cells call these on the student's functions. Each check compares against a
trusted reference on random odd shapes and hyper-parameters drawn from `seed`, and raises
AssertionError with an actionable message (or NotImplementedError propagates from a stub). What runs
them (the `@check` decorator, the sandbox, the trusted runner) is `dlo.grading`.
"""

import importlib

from dlo.registry import DAYS

# each day's checks module (`dlo.registry.DaySpec.checks`), as an attribute: `dlo.checks.day5`
__all__ = [spec.short for spec in DAYS.values()]
globals().update({spec.short: importlib.import_module(spec.checks) for spec in DAYS.values()})
