"""Autograder checks for Day 7 (tensor parallelism).

Every check runs the student's code on `world_size` ranks through `on_ranks` (a trusted worker below
builds the full layers from the seed, shards them with the student's code, runs forward and backward
and returns outputs, gradients and the collectives it counted with `dlo.measure.CommCounter`) and
compares with one process built from the same weights, computed here, outside the worker (the
torchtitan test pattern). Everything is float64: a correct split differs from one process only by
summation order (~1e-15), so the default tolerance of `assert_close` (1e-9) catches a missing sum,
a wrong slice or a forgotten gradient all-reduce. Sizes are odd wherever the exercise allows it
(batch, sequence of the unsplit layers, input features); the split dimensions are t times an odd
number, since Megatron's layers need equal shards.

The checks live in three modules along the exercises' seams and are re-exported here, where the
notebook's test cells call them: `dlo.checks.day7_layers` (1, 2 and the shared helpers),
`dlo.checks.day7_model` (3, 6: the Llama's attention and its DTensor plan) and
`dlo.checks.day7_sequence` (4, 5).
"""

from dlo.checks.day7_layers import check_tp_linears, check_tp_swiglu
from dlo.checks.day7_model import check_dtensor_plan, check_tp_attention
from dlo.checks.day7_sequence import check_sequence_parallel, check_vocab_parallel_cross_entropy

__all__ = ["check_dtensor_plan", "check_sequence_parallel", "check_tp_attention", "check_tp_linears",
           "check_tp_swiglu", "check_vocab_parallel_cross_entropy"]
