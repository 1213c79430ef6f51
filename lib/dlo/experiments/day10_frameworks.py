"""Day 10's frameworks section: the same data-parallel training through Hugging Face Accelerate, Lightning
Fabric and DeepSpeed's ZeRO, beside the course's own DDP (Day 4's bucketed engine) and one process on the
global batch.

Every engine trains Day 4's tiny MLP on Day 4's synthetic batches (`day4_data`: rank r's batch of step s is
drawn from (s, r)) with plain SGD for a few steps, in float64, inside one `dlo.distributed.launch`: the
frameworks attach to the process group the launcher already made (Accelerate reads RANK/WORLD_SIZE and uses
the initialised group; Fabric's environment sees LOCAL_RANK, so its `launch()` starts no process; DeepSpeed's
`init_distributed` keeps the group). Data parallelism with averaged gradients is then one process on the
concatenated batch, so each engine's weights are compared with that process's and with dlo's DDP.
The control is one process on rank 0's batch alone, which is what a rank would compute if its framework did
not average gradients: it must differ by far more than the tolerance, or the rows could not see a missing
all-reduce.

A framework that is not installed is skipped with a one-line reason: the course's lock has Accelerate and
Fabric (the `frameworks` extra); DeepSpeed is not in it (README, Day 10), so it runs only where a cluster
provides it. Nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from dlo import claims as C
from dlo import estimates as E
from dlo.distributed.ddp import DataParallelBucket
from dlo.experiments.day4_data import feature_batch, mlp
from dlo.presets import DAY4

# engine -> (import name, distribution name); DeepSpeed's three ZeRO stages are three engines of one package
PACKAGES = {"accelerate": ("accelerate", "accelerate"), "fabric": ("lightning_fabric", "lightning-fabric"),
            "deepspeed": ("deepspeed", "deepspeed")}
ENGINES = {"Accelerate DDP": "accelerate", "Fabric DDP": "fabric", "DeepSpeed ZeRO-1": "deepspeed",
           "DeepSpeed ZeRO-2": "deepspeed", "DeepSpeed ZeRO-3": "deepspeed",
           "DeepSpeed ZeRO-2 + optimizer offload": "deepspeed"}
REFERENCE = "dlo DDP (Day 4)"
TOLERANCE = 1e-12  # float64: rounding in a different reduction order is ~1e-16 of a weight; a missing average ~1e-2
# DeepSpeed reduces gradients in its "communication_data_type", fp32 at most (fp16, bf16 or fp32; the weights stay
# float64): float32 rounding of each step's gradient, ~1e-7 of a weight after a few steps
TOLERANCE_FP32_WIRE = 1e-5
CONTROL = "one process on rank 0's batch alone (no gradient average)"


def preset(steps: int = 3):
    """Day 4's tiny sizes (MLP 256-256x4, 32 samples per rank), `steps` SGD steps at its learning rate."""
    return replace(DAY4["tiny"], max_steps=steps)


def installed(packages=PACKAGES) -> dict[str, str | None]:
    """{package: its installed version, or None}: found without importing it (an import costs seconds)."""
    found = {}
    for name, (module, dist_name) in packages.items():
        found[name] = importlib.metadata.version(dist_name) if importlib.util.find_spec(module) else None
    return found


def skipped(found: dict[str, str | None]) -> list[str]:
    """One line per framework that will not run here, with why."""
    return [f"{name}: skipped: not installed ({_why_absent(name)})"
            for name, version in found.items() if version is None]


def _why_absent(package: str) -> str:
    if package == "deepspeed":
        return "not in the course's lock: source only, compiles C++ ops (README); runs where a cluster provides it"
    return "the course's lock has it: `make venv` installs it into an older .venv"


def engines(found: dict[str, str | None]) -> list[str]:
    """The engines whose package is installed (`installed()`), in `ENGINES`' order."""
    return [name for name, package in ENGINES.items() if found.get(package)]


@contextlib.contextmanager
def float64():
    """Default dtype float64 while the engines build and train: Fabric's 64-true precision casts a module's
    outputs back to the default dtype, which would round the loss to float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def flat(module) -> torch.Tensor:
    return parameters_to_vector(module.parameters()).detach().cpu()


def _train(P, forward, backward, step, rank):
    for s in range(P.max_steps):
        x, y = feature_batch(P, s, rank, "cpu")
        backward(F.cross_entropy(forward(x), y))
        step()


def _dlo(P, rank):
    net = DataParallelBucket(mlp(P, "cpu"), bucket_cap_mb=P.bucket_cap_mb)
    opt = torch.optim.SGD(net.parameters(), lr=P.lr)

    def backward(loss):
        loss.backward()
        net.finish_gradient_synchronization()
    _train(P, net, backward, lambda: (opt.step(), opt.zero_grad()), rank)
    return flat(net.module), type(net).__name__


def _accelerate(P, rank):
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)  # MULTI_CPU from WORLD_SIZE; the launcher's gloo group is kept
    net = mlp(P, "cpu")
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=P.lr))
    _train(P, model, acc.backward, lambda: (opt.step(), opt.zero_grad()), rank)
    return flat(net), f"{type(model).__name__} ({acc.distributed_type.value}, {acc.num_processes} processes)"


def _fabric(P, rank):
    from lightning_fabric import Fabric
    fab = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", precision="64-true")
    fab.launch()  # LOCAL_RANK is set: the processes exist, nothing is started
    net = mlp(P, "cpu")
    model, opt = fab.setup(net, torch.optim.SGD(net.parameters(), lr=P.lr))
    _train(P, model, fab.backward, lambda: (opt.step(), opt.zero_grad()), rank)
    return flat(net), f"{type(model).__name__} over {type(fab.strategy).__name__}"


def _deepspeed(P, rank, stage, offload=False):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # keeps the initialised group
    net = mlp(P, "cpu")
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": P.batch_per_rank, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,  # torch's SGD, not DeepSpeed's
              "zero_force_ds_cpu_optimizer": False}  # offload refuses a torch optimizer unless told
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=P.lr), config=config)
    _train(P, engine, engine.backward, engine.step, rank)
    with deepspeed.zero.GatheredParameters(list(net.parameters()), enabled=stage == 3):  # ZeRO-3 holds shards
        weights = flat(net)
    return weights, f"{type(engine.optimizer).__name__} (weights {str(weights.dtype).removeprefix('torch.')})"


def run_ranks(P, names) -> dict:
    """On every rank inside `dlo.distributed.launch`: dlo's DDP, then each engine in `names`, from the same
    initial weights and batches; {engine: (weights, what wrapped the model)}."""
    rank, out = dist.get_rank(), {}
    runners = {"Accelerate DDP": _accelerate, "Fabric DDP": _fabric,
               **{f"DeepSpeed ZeRO-{s}": (lambda P, r, s=s: _deepspeed(P, r, s)) for s in (1, 2, 3)},
               "DeepSpeed ZeRO-2 + optimizer offload": lambda P, r: _deepspeed(P, r, 2, offload=True)}
    with float64(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the frameworks' advice (srun seen, deprecations) is not today's subject
        out[REFERENCE] = _dlo(P, rank)
        for name in names:
            out[name] = runners[name](P, rank)
    return out


def one_process(P, ranks) -> torch.Tensor:
    """Weights after the same SGD steps in one process on `ranks`' batches concatenated (mean loss over all)."""
    with float64():
        net = mlp(P, "cpu")
        opt = torch.optim.SGD(net.parameters(), lr=P.lr)
        for s in range(P.max_steps):
            xs, ys = zip(*(feature_batch(P, s, r, "cpu") for r in ranks))
            F.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            opt.zero_grad()
        return flat(net)


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (float64)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max()).item()


def compare(P, R: list[dict]) -> dict:
    """Per engine, the largest gap over ranks to one process on the global batch and to dlo's DDP, and the
    control's gap (one process on rank 0's batch alone)."""
    ref = one_process(P, range(len(R)))
    rows = {name: {"wrapped as": R[0][name][1],
                   "vs one process": max(gap(r[name][0], ref) for r in R),
                   "vs dlo DDP": max(gap(r[name][0], r[REFERENCE][0]) for r in R)} for name in R[0]}
    return {"engines": rows, "control": gap(one_process(P, [0]), ref)}


def table(result: dict) -> list[dict]:
    return [{"engine": name, "wrapped as": v["wrapped as"], "max |w - w_1proc| / max |w|": v["vs one process"],
             "max |w - w_dlo| / max |w|": v["vs dlo DDP"]} for name, v in result["engines"].items()]


def _region(name: str) -> C.Region:
    if ENGINES.get(name) == "deepspeed":
        return C.at_most(TOLERANCE_FP32_WIRE, f"<= {TOLERANCE_FP32_WIRE:g} of the largest weight (float64 weights, "
                                              "gradients reduced in float32)")
    return C.at_most(TOLERANCE, f"<= {TOLERANCE:g} of the largest weight (float64)")


def claims(result: dict, world_size: int, steps: int, found: dict[str, str | None] | None = None) -> list[C.Claim]:
    """One row per engine but dlo's: its updates equal dlo's DDP and one process on the global batch; an engine
    whose package `found` lacks is a "not measurable here" row with the reason."""
    control = E.exact(result["control"], CONTROL)
    claim = "{}'s updates = dlo's DDP = one process ({} gloo ranks, {} SGD steps)"
    source = "the framework's documentation (data parallelism averages gradients); Day 4's DDP"
    absent = [C.not_measurable(claim.format(name, world_size, steps), source, "the same weights",
                               f"{package} is not installed here ({_why_absent(package)})", _region(name))
              for name, package in ENGINES.items() if found is not None and not found.get(package)]
    return [C.Claim(claim.format(name, world_size, steps), source, "the same weights", _region(name),
                    E.exact(max(v["vs one process"], v["vs dlo DDP"]),
                            "max over ranks of max |w - w_ref| / max |w_ref|, w_ref: one process on the global "
                            "batch and dlo's DDP, the same initial weights and batches"), control=control)
            for name, v in result["engines"].items() if name != REFERENCE] + absent


__all__ = ["CONTROL", "ENGINES", "PACKAGES", "REFERENCE", "TOLERANCE", "TOLERANCE_FP32_WIRE", "claims", "compare",
           "engines", "float64", "gap", "installed", "one_process", "preset", "run_ranks", "skipped", "table"]
