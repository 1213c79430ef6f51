"""The Day 1 grid trained: one run after another, or shared over the cores a CPU has.

The runs of the grid (`day1.grid`) are independent trials: each seeds its own weights, data order and
gradient-noise probe from (run.seed + its seed), so they need not run in order. On a CPU they are shared
over W processes (`dlo.distributed.launch`: rank r trains runs r, r + W, ...), each with one intra-op
thread as the notebook has on the tiny profile: the same records as one after another, in about 1/W of
the time when W cores are free. That is what lets the notebook that runs last in `make run` use the cores
the others freed (issue 38: one thread alone on a 2-core machine left half of it idle). On a GPU the runs
take turns on it.
"""

from __future__ import annotations

import time

import torch

from dlo import tb
from dlo.cpus import usable_cores
from dlo.experiments import day1
from dlo.experiments.day1_noise import NoiseProbe


def workers_for(device, runs: int) -> int:
    """Processes for `runs` runs on `device`: the usable cores on a CPU (a busy core is shared, not spun on:
    one thread each), one on a GPU (the runs take turns on it)."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(usable_cores(), runs))


def train_one(P, cfg: day1.Config, s: int, seed: int, train_ds, test_ds, device, log_dir) -> tuple[dict, object]:
    """Run (cfg, seed s of the notebook) with its TensorBoard folder `<cfg.name>/seed<s>`, and its noise
    probe when it is the SGD small-batch run (section 8.5): (record, probe or None)."""
    writer = tb.writer(log_dir, f"{cfg.name}/seed{s}")
    probe = NoiseProbe(P, train_ds, seed + s, device) if cfg == day1.Config("sgd", P.small_batch) else None
    try:
        record = day1.train_config(P, cfg, seed + s, train_ds, test_ds, device, writer=writer, progress=False,
                                   probe=probe)
    finally:
        if writer is not None:
            writer.close()
    record["seed"] = s  # seeds 0, 1, ... of this notebook (seed + s underneath)
    return record, probe


def _share(P, configs, seed, train_ds, test_ds, device, log_dir) -> list[tuple[int, dict, object]]:
    """On rank r of W: runs r, r + W, ... (a line each when it ends: what the notebook shows)."""
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    out = []
    for i in range(r, len(configs), w):
        cfg, s = configs[i]
        t0 = time.perf_counter()
        record, probe = train_one(P, cfg, s, seed, train_ds, test_ds, device, log_dir)
        if probe is not None:
            probe.ds = None  # the training set stays here: the notebook has it
        out.append((i, record, probe))
        print(f"run {i + 1}/{len(configs)} {cfg.name} seed {s}: {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def train_grid(P, configs: list, seed: int, train_ds, test_ds, device, log_dir, workers: int = 1,
               progress=None) -> tuple[list[dict], dict]:
    """Every (config, seed s) of `configs`: (records in the order of `configs`, {s: noise probe of the SGD
    small-batch run}). `workers` > 1: shared over that many processes (records identical to one process's);
    `progress`: a tqdm-like wrapper of the sequential loop."""
    if workers <= 1:
        loop = progress(configs, desc="training runs") if progress else configs
        pairs = [train_one(P, cfg, s, seed, train_ds, test_ds, device, log_dir) for cfg, s in loop]
    else:
        from dlo.distributed import launch

        parts = launch(_share, workers, P, configs, seed, train_ds, test_ds, str(device), log_dir, backend="gloo",
                       timeout=None)
        done = sorted((item for part in parts for item in part), key=lambda item: item[0])
        pairs = [(record, probe) for _, record, probe in done]
        for probe in (p for _, p in pairs if p is not None):
            probe.ds = train_ds
    probes = {record["seed"]: probe for record, probe in pairs if probe is not None}
    return [record for record, _ in pairs], probes
