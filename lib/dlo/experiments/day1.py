"""Day 1 experiments: the optimizer grid at equal samples, its claims, and the plan of the full profile
(the gradient noise scale is `day1_noise`, the profiled data-loading bottleneck `day1_profile`).

Every run of the grid sees the same number of *samples* (epochs): the small-batch runs take
`P.max_steps` steps, a run at batch B takes `P.max_steps * P.small_batch / B`. That is the
comparison the linear scaling rule is about (Goyal et al. 2017: "same accuracy after the same number
of epochs"); comparing at equal steps would hand the large batch k times the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlo import claims as C
from dlo import estimates as E
from dlo.accounting import optimizer_bytes
from dlo.models.small import SmallCNN
from dlo.plan import activation_bytes, param_bytes, row

# optimizer of the notebook -> its state per fp32 parameter (SGD has Nesterov momentum)
OPTIMIZERS = {"sgd": "sgd_momentum", "adamw": "adamw", "lamb": "lamb"}


# ----------------------------------------------------------------------------- the training grid

@dataclass(frozen=True)
class Config:
    """One configuration of the grid: optimizer, batch, warmup or not, lr scaled with the batch or not,
    global-norm clipping at P.clip or none."""

    opt: str
    batch: int
    warmup: bool = True
    scale_lr: bool = True
    clip: bool = True

    @property
    def name(self) -> str:  # the TensorBoard run folder: one per configuration
        suffix = ("" if self.warmup else "_nowarmup") + ("" if self.scale_lr else "_unscaled") + \
            ("" if self.clip else "_noclip")
        return f"{self.opt}_b{self.batch}{suffix}"


def steps_for(P, batch: int) -> int:
    """Steps at `batch` that see as many samples as P.max_steps steps at P.small_batch (at least 1)."""
    return max(1, round(P.max_steps * P.small_batch / batch))


def lr_for(P, cfg: Config) -> float:
    """The preset's small-batch lr, scaled by k = batch / small_batch: linearly for SGD (Goyal et al.),
    by sqrt(k) for the adaptive AdamW and LAMB (You et al. 2019); unscaled when cfg.scale_lr is False."""
    base = {"sgd": P.sgd_lr, "adamw": P.adamw_lr, "lamb": P.lamb_lr}[cfg.opt]
    k = cfg.batch / P.small_batch if cfg.scale_lr else 1.0
    return base * (k if cfg.opt == "sgd" else math.sqrt(k))


def make_optimizer(P, name: str, params, lr: float) -> torch.optim.Optimizer:
    from dlo.optim import LAMB

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=P.momentum, nesterov=True, weight_decay=P.sgd_weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=P.adamw_weight_decay)
    if name == "lamb":
        return LAMB(params, lr=lr, weight_decay=P.lamb_weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")


def grid(P) -> list[tuple[Config, int]]:
    """(config, seed) pairs: the SGD linear-scaling runs, their control, AdamW and LAMB at both batches
    over P.seeds seeds (every compared pair is paired by seed: dlo.estimates rule 2); LAMB without
    warmup with seed 0 (a curve to look at, no claim). SGD at the large batch also runs warmup x clipping
    as a 2 x 2: clipping bounds every early update, which is much of warmup's job, so warmup is judged
    on the unclipped pair and clipping on its own arm (both without warmup)."""
    S, L = P.small_batch, P.large_batch
    sgd = [Config("sgd", S), Config("sgd", L), Config("sgd", L, scale_lr=False), Config("sgd", L, warmup=False),
           Config("sgd", L, clip=False), Config("sgd", L, warmup=False, clip=False)]
    adaptive = [Config(o, b) for o in ("adamw", "lamb") for b in (S, L)]
    return [(c, s) for s in range(P.seeds) for c in sgd + adaptive] + [(Config("lamb", L, warmup=False), 0)]


def train_config(P, cfg: Config, seed: int, train_ds, test_ds, device, writer=None, progress: bool = True,
                 probe=None) -> dict:
    """Train a fresh SmallCNN (initial weights from `seed`) with cfg at equal samples; warmup + cosine
    schedule (warmup: P.warmup_steps small-batch steps' worth of samples), global-norm clipping at
    P.clip unless cfg.clip is False.
    BatchNorm's running statistics are recomputed on training images before the test (see
    `recalibrate_batchnorm`). Returns the run's record: accuracy and loss on test_ds (and before the
    recalibration), the mean training loss of the last steps, the early loss peak, time, history.
    `probe(step, model)` (e.g. `day1_noise.NoiseProbe`) is called before every optimizer step and
    once after the last (step = steps), before the recalibration."""
    from dlo.schedules import warmup_cosine
    from dlo.train import cross_entropy_step, evaluate, make_loader, train

    steps = steps_for(P, cfg.batch)
    # the same warmup in samples at every batch (Goyal et al. warm up over epochs), at least 1 step
    warm_len = min(max(1, round(P.warmup_steps * P.small_batch / cfg.batch)), steps - 1)
    warm = warm_len if cfg.warmup and P.warmup_steps else 0
    lr = lr_for(P, cfg)
    torch.manual_seed(seed)
    # channels_last (NHWC): the layout oneDNN's CPU convolutions and pools and the GPU's tensor cores run
    # fastest in (the grid's max-pools take twice as long in NCHW on a CPU); the images stay NCHW tensors
    model = SmallCNN(width=P.width).to(device, memory_format=torch.channels_last)
    opt = make_optimizer(P, cfg.opt, model.parameters(), lr)
    loader = make_loader(train_ds, cfg.batch, seed=seed)
    clip = P.clip if cfg.clip else None
    step_fn = None if probe is None else _probed(cross_entropy_step(clip), probe)
    hist = train(model, opt, loader, steps=steps, device=device, clip=None if probe else clip, step_fn=step_fn,
                 writer=writer, eval_data=test_ds, tag=f"{cfg.name} seed {seed}", progress=progress,
                 lr_fn=lambda s: warmup_cosine(s, base_lr=lr, warmup_steps=warm, total_steps=steps))
    if probe is not None:
        probe(steps, model)
    stale_acc = hist["eval_acc"]
    recalibrate_batchnorm(model, train_ds, device, P.bn_samples)
    hist["eval_loss"], hist["eval_acc"] = evaluate(model, test_ds, device)
    # the early window is the same with or without warmup: twice the warmup's length, from step 1
    early = hist["loss"][1: 1 + 2 * max(warm_len, 1)] or hist["loss"]  # (step 0: the same init for all)
    tail = hist["loss"][-max(1, steps // 8):]  # the last eighth of the run: training loss at the end
    return {"name": cfg.name, "config": cfg, "seed": seed, "lr": lr, "steps": steps, "warmup": warm,
            "samples": steps * cfg.batch, "acc": hist["eval_acc"], "loss": hist["eval_loss"],
            "stale_acc": stale_acc, "train_loss": sum(tail) / len(tail),
            "early_peak": max(early) if all(map(math.isfinite, early)) else math.inf,  # inf: diverged early
            "time_s": hist["time_s"], "hist": hist}


def _probed(step_fn, probe):
    """step_fn with probe(i, model) called before its i-th call (0-based)."""
    calls = iter(range(1 << 62))

    def step(model, optimizer, batch):
        probe(next(calls), model)
        return step_fn(model, optimizer, batch)
    return step


def recalibrate_batchnorm(model, train_ds, device, n: int) -> None:
    """Recompute BatchNorm's running statistics of the trained weights on the first n training images
    (a cumulative average, torch.optim.swa_utils.update_bn). The running averages of training lag the
    weights by ~1/momentum steps, and a run at batch k*B takes k times fewer steps: without this,
    the large batch is judged on statistics of older weights, not on what it learned (test loss 2.26
    against a training loss ~1.0 at b256 on the tiny profile)."""
    from torch.optim.swa_utils import update_bn

    from dlo.train import make_loader

    sub = torch.utils.data.Subset(train_ds, range(min(n, len(train_ds))))
    update_bn(make_loader(sub, 256, seed=0, shuffle=False, drop_last=False), model, device=torch.device(device))


def step_times(P, train_ds, device, reps: int = 8) -> dict:
    """Interleaved timings of one SGD training step at the small and at the large batch: round r times
    one step of each, so `times[S].times_s[r]` and `times[L].times_s[r]` are a pair (`step_cost_ratio`)."""
    from dlo.measure import time_interleaved
    from dlo.train import cross_entropy_step

    fns, step = {}, cross_entropy_step(P.clip)
    for b in (P.small_batch, P.large_batch):
        model = SmallCNN(width=P.width).to(device)
        opt = make_optimizer(P, "sgd", model.parameters(), P.sgd_lr)
        batch = tuple(t[:b].to(device) for t in train_ds.tensors)
        fns[b] = lambda m=model, o=opt, x=batch: step(m, o, x)
    return time_interleaved(fns, device=device, warmup=2, reps=reps)


# ----------------------------------------------------------------------------- claims

def _paired(a: list[dict], b: list[dict], key: str) -> dict[int, tuple[float, float]]:
    """seed -> (a, b) values of `key` for the seeds both ran, refusing runs of different sample counts."""
    if {r["samples"] for r in a} != {r["samples"] for r in b}:
        raise ValueError(f"compare at equal samples (epochs): {a[0]['name']} saw {a[0]['samples']} samples, "
                         f"{b[0]['name']} {b[0]['samples']}")
    by_seed = {r["seed"]: r[key] for r in b}
    return {r["seed"]: (r[key], by_seed[r["seed"]]) for r in a if r["seed"] in by_seed}


def gap(a: list[dict], b: list[dict], n_test: int, key: str = "acc") -> E.Estimate:
    """a - b of `key`, paired by seed (the t-interval holds the training noise and the test images'
    noise of each seed); fewer than 3 seeds give no interval ("not measurable here", dlo.estimates rule 2).
    How the estimate was obtained names the `n_test` test images for the accuracy, the training loss
    for another key (the early peak). A run whose early loss was not finite (early_peak inf: it
    diverged) has no peak to subtract: the estimate then says which arm diverged, as its reason."""
    pairs = list(_paired(a, b, key).values())
    on = f"{n_test} test images" if key == "acc" else f"the training loss ({key})"  # what was measured
    how = f"paired over {len(pairs)} seeds, {on}"
    diverged = [f"{arm[0]['name']}: {sum(not math.isfinite(p[i]) for p in pairs)} of {len(pairs)} seeds"
                for i, arm in enumerate((a, b)) if any(not math.isfinite(p[i]) for p in pairs)]
    if diverged:  # e.g. the unclipped run without warmup blew up: shown, not averaged
        return E.Estimate(math.nan, math.nan, math.nan, len(pairs), how, E.REPEATS,
                          f"loss not finite early ({'; '.join(diverged)})", pairing=E.PAIRED_BY_SEED)
    return E.paired_difference(*zip(*pairs), how=how)


def gap_of_gaps(a: tuple[list[dict], list[dict]], b: tuple[list[dict], list[dict]], n_test: int) -> E.Estimate:
    """(a[0] - a[1]) - (b[0] - b[1]) of the accuracy, paired by seed: how much more a loses than b
    going from one batch to the other (LAMB vs AdamW, b256 vs b32)."""
    da, db = ({s: x - y for s, (x, y) in _paired(*arm, "acc").items()} for arm in (a, b))
    seeds = sorted(set(da) & set(db))
    return E.paired_difference([da[s] for s in seeds], [db[s] for s in seeds],
                               how=f"paired over {len(seeds)} seeds, {n_test} test images")


def grid_claims(results: list[dict], P, n_test: int, times: dict | None = None, tol: float = 0.02,
                device="cpu") -> list[C.Claim]:
    """The claims table of the grid from its run records (see `train_config`) and `step_times`
    (timed on `device` with this process's torch threads)."""
    R: dict[str, list[dict]] = {}
    for r in results:
        R.setdefault(r["name"], []).append(r)
    S, L = P.small_batch, P.large_batch
    k = L // S
    goyal, lamb = "Goyal et al. 2017", "You et al. 2019"
    nowarm, nowarm_noclip, warm_noclip = (R[f"sgd_b{L}{sfx}"] for sfx in ("_nowarmup", "_nowarmup_noclip",
                                                                          "_noclip"))
    rows = [
        C.Claim(f"linear scaling: SGD b{L} (lr x{k}, warmup) = b{S} accuracy at equal epochs", goyal,
                "same accuracy", C.between(-tol, tol, f"gap within +-{tol:.0%}"),
                gap(R[f"sgd_b{L}"], R[f"sgd_b{S}"], n_test)),
        C.Claim(f"control: lr x{k} beats the unscaled lr at b{L}", goyal, "the scaled lr is needed",
                C.at_least(0.0, "gap > 0"), gap(R[f"sgd_b{L}"], R[f"sgd_b{L}_unscaled"], n_test)),
        # Goyal et al. do not clip: warmup is judged on the unclipped pair, clipping on its own arm
        C.Claim(f"warmup: without it, early loss peaks higher (SGD b{L}, no clipping)", goyal, "early instability",
                C.at_least(0.0, "peak gap > 0"), gap(nowarm_noclip, warm_noclip, n_test, "early_peak")),
        C.Claim(f"warmup: without it, accuracy ends lower (SGD b{L}, no clipping)", goyal, "worse result",
                C.at_most(0.0, "gap < 0"), gap(nowarm_noclip, warm_noclip, n_test)),
        C.Claim(f"clipping at {P.clip:g} alone lowers the early loss peak (SGD b{L}, no warmup)", "Pascanu et al. 2013",
                "clipping bounds exploding updates", C.at_most(0.0, "peak gap < 0"),
                gap(nowarm, nowarm_noclip, n_test, "early_peak")),
        C.Claim(f"LAMB loses less than AdamW going b{S} -> b{L}", lamb, "large batches stay efficient",
                C.at_least(0.0, "gap > 0"),
                gap_of_gaps((R[f"lamb_b{L}"], R[f"lamb_b{S}"]), (R[f"adamw_b{L}"], R[f"adamw_b{S}"]), n_test)),
    ]
    if times is not None:  # a GPU-utilisation claim: judged on a GPU only (dlo.claims rule 3)
        rows.append(C.Claim(f"one b{L} step costs less than {k} b{S} steps", goyal,
                            "large batches use the hardware better", C.at_least(1.0, "ratio > 1"),
                            C.timed(step_cost_ratio(times, S, L), device=str(device), gpu_claim=True,
                                    threads=torch.get_num_threads())))
    rows.append(C.not_measurable("linear scaling up to batch 8k on ImageNet (ResNet-50, 8 to 256 GPUs)", goyal,
                                 "23.74% vs 23.60% top-1 error", "needs ImageNet and 256 GPUs: the full profile "
                                 "tests the same rule on CIFAR-10 at batch 4096"))
    return rows


def step_cost_ratio(times: dict, small: int, large: int) -> E.Estimate:
    """k small steps over one large step (k = large / small), paired per interleaved round of `step_times`:
    the median of the rounds' ratios with its order-statistics interval (a slow phase of the machine
    hits both steps of a round alike and cancels)."""
    k = large // small
    pairs = list(zip(times[small].times_s, times[large].times_s))
    return E.median_interval([k * a / b for a, b in pairs],
                             how=f"{k} x b{small} / b{large} step, median of {len(pairs)} paired interleaved rounds")


# ----------------------------------------------------------------------------- plan of the full profile

def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """One row per optimizer and batch of the training grid (fp32 SmallCNN; activations counted on
    the meta device over forward + backward), and the AdamW step benchmark over P.bench_numel fp32
    parameters (param, gradient, two moments). Single process: `gpus` does not change the rows."""
    with torch.device("meta"):
        model = SmallCNN(width=P.width)
    n = param_bytes(model)
    exclude = [*model.parameters(), *model.buffers()]
    acts = {}
    for b in (P.small_batch, P.large_batch):
        with torch.device("meta"):
            x, y = torch.randn(b, 3, P.image_size, P.image_size), torch.randint(0, 10, (b,))
        acts[b] = activation_bytes(lambda x=x, y=y: F.cross_entropy(model(x), y), exclude=exclude)
    rows = [row(f"{name} b{b}", 1, params=n, grads=n, optimizer=optimizer_bytes(state, n),
                activations=acts[b], gpu_mem_gb=gpu_mem_gb, main=b == P.large_batch,
                note=f"SmallCNN width {P.width}, {P.image_size}x{P.image_size} images")
            for name, state in OPTIMIZERS.items() for b in (P.small_batch, P.large_batch)]
    bench = 4 * P.bench_numel
    rows.append(row("AdamW step benchmark", 1, params=bench, grads=bench,
                    optimizer=optimizer_bytes("adamw", bench), activations=0, gpu_mem_gb=gpu_mem_gb,
                    note=f"{P.bench_numel:,} fp32 parameters in 32 tensors"))
    return rows
