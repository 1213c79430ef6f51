"""Autograder checks for Day 7 (tensor parallelism).

Every check draws its case here, on the grader's side (from a secret seed when `dlo grade` runs it:
`case_seed`), and runs the student's code on `world_size` ranks through `on_ranks`: each rank is
given only its part (`per_rank`: the layer the exercise splits, and of the inputs and output
gradients its own block where the layer is split, so that what the other ranks hold must come
through a collective); a trusted worker shards the layer with the student's code, runs forward and
backward and returns outputs, gradients, the collectives it counted with `dlo.measure.CommCounter`,
what it put into each of them (`dlo.checks.day7_comms`: an all-reduce's inputs must sum to the layer's
output or input gradient, never carry weights; the bytes counted must agree with the ranks' sockets) and,
where a rank holds the whole layer, its FLOPs (1/t of one process's: a rank that computes the whole layer
and issues collectives for show fails). The comparison with one process built from the
same weights is computed here, outside the ranks (the torchtitan test pattern). Everything is
float64: a correct split differs from one process only by
summation order (~1e-15), so the default tolerance of `assert_close` (1e-9) catches a missing sum,
a wrong slice or a forgotten gradient all-reduce. Sizes are odd wherever the exercise allows it
(batch, sequence of the unsplit layers, input features); the split dimensions are t times an odd
number, since Megatron's layers need equal shards.

The checks live in five modules along the exercises' seams and are re-exported here, where the
notebook's test cells call them: `dlo.checks.day7_layers` (1, 2),
`dlo.checks.day7_model` (3, 6: the Llama's attention and its DTensor plan),
`dlo.checks.day7_sequence` (4, 5), `dlo.checks.day7_scale` (7: compute against communication) and
`dlo.checks.day7_volumes` (7b: a stage boundary's bytes, DDP's bucket); the layout search, once
exercise 8, is Day 10's exercise 6 (`dlo.checks.day10_layout`). The test cells call them through this
module, the day's one checks module (`dlo.registry`), which the grader imports; what the collectives
carried is held in `dlo.checks.day7_comms`, what the checks share in `dlo.checks.day7_shared`.
"""

from dlo.checks.day7_layers import check_tp_linears, check_tp_swiglu
from dlo.checks.day7_model import check_dtensor_plan, check_tp_attention
from dlo.checks.day7_scale import check_comm_compute
from dlo.checks.day7_sequence import check_sequence_parallel, check_vocab_parallel_cross_entropy
from dlo.checks.day7_volumes import check_pp_bucket

__all__ = ["check_comm_compute", "check_dtensor_plan", "check_pp_bucket", "check_sequence_parallel",
           "check_tp_attention", "check_tp_linears", "check_tp_swiglu", "check_vocab_parallel_cross_entropy"]
