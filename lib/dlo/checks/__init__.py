"""Autograder checks, one module per day: `dlo.checks.day1.check_adamw_step(adamw_step)`.

A notebook's locked test cells call these on the student's functions. Each check compares against a
trusted reference on random odd shapes and hyper-parameters drawn from `seed`, and raises
AssertionError with an actionable message (or NotImplementedError propagates from a stub). What runs
them (the `@check` decorator, the sandbox, the trusted runner) is `dlo.grading`.
"""

from dlo.checks import day1, day2, day3, day4, day5, day6, day7, day8

__all__ = ["day1", "day2", "day3", "day4", "day5", "day6", "day7", "day8"]
