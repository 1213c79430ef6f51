"""`dlo plan DAY`: the full profile's memory per rank, worked out without a GPU.

A day's planner builds its full-size models on the meta device (shapes, no storage), and for the
distributed days shards them at the real world size inside `fake_world(n)` — a "fake" process
group in this one process whose collectives do nothing, so `fully_shard`, DTensor and DeviceMesh
behave as on n ranks and report the per-rank shapes. It returns one row per configuration (see
`ROW_KEYS`, bytes per rank) beside the GPU memory; `check_fits` turns a row that cannot fit into a
one-line error before any process starts.

A day's planner is a function `plan(preset, *, gpus: int, gpu_mem_gb: float) -> list[dict]` that the
registry names (`dlo.registry.DAYS[day].planner`); `dlo.registry.plan_day(day)` runs it on the day's
`full` preset, and `dlo plan DAY` prints the rows and fails when a row marked `main` (the configuration
the notebook cannot do without; the first row when none is marked) does not fit. This module holds
the planners' building blocks and imports no day (the days import it).

How the columns are counted (bytes per rank):
- params, grads: every element of the model built on the meta device, in its training dtype (fp32
  master weights and gradients also under mixed precision);
- optimizer: `dlo.accounting.optimizer_bytes` (AdamW and LAMB two fp32 moments, SGD with momentum one
  buffer, plain SGD none) plus what the day keeps beside them (a DDP bucket, a calibration buffer);
- activations: what autograd saves for backward, counted by `dlo.measure.SavedTensorMeter` on
  meta tensors (exact for the shapes, no memory used), at its peak over forward and backward; on
  fake CPU tensors (`fake_cpu`) where the meta device would take another path (autocast, fused
  attention); dropout as a GPU runs it (`gpu_kernels`: a 1-byte mask);
- transient: where a planner runs the whole step op by op (`step_memory`: every tensor an operator
  allocates, alive until its last reference dies, `dlo.measure.AllocationMeter`), what the step holds
  at its peak beyond the four columns above: the logits the training loop keeps through backward, the
  loss's gradient buffers (as large as the logits), a gradient being formed, the optimizer's temporaries.
  The total is then at least the step's peak (`max_memory_allocated` on a GPU); the columns are the
  lesson's numbers (model state, saved activations) and do not all peak at the same moment.
  Not counted: the CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding and
  fragmentation, hence the planner's margin to the GPU's memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dlo.measure import fmt_bytes

GIB = 2 ** 30

# A planner's row: bytes per rank of each kind, and whether the sum fits the GPU.
ROW_KEYS = ("config", "world", "params", "grads", "optimizer", "activations", "transient", "total", "gpu", "fits",
            "note")

class DoesNotFit(ValueError):
    """A planned configuration needs more memory per rank than the GPU has."""


def row(config: str, world_size: int, *, params: int, grads: int, optimizer: int, activations: int,
        gpu_mem_gb: float, note: str = "", main: bool = False, peak: int = 0) -> dict:
    """One planner row; `transient`, `total` and `fits` are derived here so every day computes them
    alike. `peak`: the step's peak bytes where the planner ran it (`step_memory`), whose excess over
    the four columns is `transient`. `main` marks a configuration the day cannot do without (`dlo plan`
    fails when it does not fit)."""
    transient = max(0, peak - (params + grads + optimizer + activations))
    total = params + grads + optimizer + activations + transient
    gpu = int(gpu_mem_gb * GIB)
    out = {"config": config, "world": world_size, "params": params, "grads": grads, "optimizer": optimizer,
           "activations": activations, "transient": transient, "total": total, "gpu": gpu, "fits": total <= gpu,
           "note": note}
    if main:
        out["main"] = True
    return out


def main_configs(rows: list[dict]) -> list[str]:
    """The configurations `dlo plan` requires to fit: the rows marked main, else the first row."""
    marked = [r["config"] for r in rows if r.get("main")]
    return marked or [r["config"] for r in rows[:1]]


def split_evenly(what: str, sizes: dict[str, int], world_size: int) -> None:
    """ValueError (one line) unless every size in `sizes` ({name: size}) divides by `world_size`: a planner
    does not plan for a batch that a data-parallel world cannot share out evenly."""
    bad = {name: n for name, n in sizes.items() if n % world_size}
    if bad:
        counts = [g for g in range(1, max(sizes.values()) + 1) if all(n % g == 0 for n in sizes.values())]
        raise ValueError(f"{', '.join(f'{name} of {n}' for name, n in bad.items())} cannot be split evenly over "
                         f"{world_size} GPUs ({what}); plan for {', '.join(map(str, counts[:8]))}"
                         f"{' ...' if len(counts) > 8 else ''} GPUs")


def param_bytes(model) -> int:
    """Bytes of a model's parameters (a tied weight once: parameters() yields it once), meta or real."""
    from dlo.measure import tensor_bytes

    return tensor_bytes(model.parameters())


def fake_cpu(model):
    """Make a meta-device `model` compute as on the CPU without memory: its parameters and buffers
    become fake CPU tensors (torch's FakeTensorMode: shapes, dtypes and the CPU's dispatch, autocast
    and attention kernels included, no storage), in place. Returns the mode; create inputs and run
    the model inside `with mode:`. Use it where the meta device would take another path than a real
    device: autocast (meta tensors have no autocast) and scaled_dot_product_attention (the math
    path on meta, which saves the (T, T) scores that the fused kernels of a GPU do not keep)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, fakes = FakeTensorMode(), {}

    def fake(t):
        if id(t) not in fakes:  # a tied weight stays one tensor
            # torch.empty of a large size maps pages that are never touched: no real memory is used
            f = mode.from_tensor(torch.empty(t.shape, dtype=t.dtype))
            fakes[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return fakes[id(t)]

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, fake(p))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, fake(b))
    return mode


class _GpuKernels(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        return func(*args, **kwargs)


def _dropout(input, p=0.5, training=True, inplace=False):
    import torch

    if not training or p == 0.0:
        return input
    out = torch.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def gpu_kernels():
    """A context in which dropout saves what it saves on a GPU: there `F.dropout` is ATen's fused
    `native_dropout`, which keeps a 1-byte bool mask for backward; on a CPU (and on the meta device)
    it multiplies by a noise tensor of the input's dtype and keeps that (4 bytes in fp32,
    `dlo.activation_memory.dropout_mask_bytes`). The planners count under it."""
    return _GpuKernels()


def activation_bytes(forward, exclude=()) -> int:
    """Peak bytes autograd saves over one forward and backward of `forward()` (meta tensors welcome),
    with dropout's masks as a GPU keeps them (`gpu_kernels`)."""
    from dlo.measure import saved_bytes

    with gpu_kernels():
        return saved_bytes(forward, exclude=exclude)["peak_saved_bytes"]


def first_step(optimizer) -> None:
    """Make `optimizer`'s state as its first step would (AdamW's moments appear then), without a forward:
    every step a plan counts is a later one, which starts with that state. On fake or meta tensors."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_memory(step, exclude=()) -> dict:
    """One call of `step()` (a training step: forward, backward, maybe the optimizer) counted op by op
    on fake or meta tensors, as a GPU would run it (`gpu_kernels`): "saved", the peak of the bytes
    autograd saves (`dlo.measure.SavedTensorMeter`, leaving out `exclude`: the parameters and buffers);
    "allocated", the peak of the bytes operators allocate and hold beyond what existed before the call
    (`dlo.measure.AllocationMeter`: a storage lives until its last tensor dies, as in the CUDA
    allocator's `memory_allocated`). The step's peak is what existed before (parameters, optimizer
    state, the batch) plus "allocated"."""
    from dlo.measure import AllocationMeter, SavedTensorMeter

    with gpu_kernels(), SavedTensorMeter(exclude=exclude) as saved, AllocationMeter() as allocated:
        step()
    return {"saved": saved.peak, "allocated": allocated.peak}


def format_rows(rows: list[dict]) -> str:
    """The rows as a table, bytes in binary units."""
    from dlo.tables import format_table

    shown = [{k: (fmt_bytes(v) if k in ("params", "grads", "optimizer", "activations", "transient", "total", "gpu")
                  else v)
              for k, v in r.items()} for r in rows]
    return format_table(shown, [k for k in ROW_KEYS if any(k in r for r in rows)])


def check_fits(rows: list[dict], configs: list[str] | None = None) -> None:
    """DoesNotFit (one line) for the first row of `configs` (default: all) that needs more than the GPU."""
    for r in rows:
        if (configs is None or r["config"] in configs) and not r["fits"]:
            raise DoesNotFit(f"{r['config']} at {r['world']} rank(s) needs {fmt_bytes(r['total'])} per rank "
                             f"(params {fmt_bytes(r['params'])}, grads {fmt_bytes(r['grads'])}, optimizer "
                             f"{fmt_bytes(r['optimizer'])}, activations {fmt_bytes(r['activations'])}, transient "
                             f"{fmt_bytes(r['transient'])}) but the GPU "
                             f"has {fmt_bytes(r['gpu'])}")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of `world_size` ranks in this one process (torch's "fake" backend: every
    collective returns at once), so sharding code runs as rank `rank` of a real world size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process")
    if not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank {rank} outside a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def device_memory_gb(device=None) -> float:
    """Memory of the CUDA `device` in GiB; elsewhere 80, the A100/H100 the full profile is planned for."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return 80.0
    return torch.cuda.get_device_properties(device).total_memory / GIB
