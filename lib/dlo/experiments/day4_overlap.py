"""Day 4: what overlapping the bucket all-reduces with backward hides (Li et al. 2020, Sec. 3.2.3).

- `overlap` (in a rank): one bucketed step profiled, the fastest of a few; the all-reduces its hooks
  launch, the bytes of each (`CommCounter`, in launch order) and which of them start while backward
  still has gradient nodes to run: the CPU-countable proxy of overlap (a launch is not a hidden
  transfer); the events as `timeline` rows (all-reduces beside backward, Li et al. 2020, Fig. 2),
  drawn by `plot_timeline`;
- `exposed_comm` (in a rank): the step time of bucketed DDP with its all-reduces launched from the
  hooks (overlapped), of the same buckets all launched after backward (`overlap=False`), and of the
  same step without any all-reduce (`no_sync` throughout), interleaved step by step, every step
  ending at a barrier so that the ranks stay in step: per round, exposed communication is
  T_overlapped - T_local, communication without overlap T_after - T_local, and what the overlap hides
  T_after - T_overlapped (paired rounds: a slow phase of the machine hits all three);
- `bucket_sweep` (in the notebook): bytes per bucket against the all-reduces per step and the time
  the alpha-beta model (the notebook's own fit) predicts for them, from the bucket layout on the
  meta device; not graded, a model;
- `exposed_rows`, `overlap_claims`: the table and the claims table's rows.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from dlo import claims as C
from dlo import estimates as E
from dlo.distributed.current import heartbeat
from dlo.distributed.ddp import DataParallelBucket
from dlo.experiments.day4_data import batch, ddp_step, model
from dlo.measure import CommCounter, time_interleaved
from dlo.profiling import quiet_profiler

LI_OVERLAP = "Li et al. 2020 (PyTorch DDP), Sec. 3.2.3; seed 003"
VERSIONS = ("overlapped", "after backward", "no all-reduce")
LANES = ("forward", "backward", "all-reduce launch", "all-reduce transfer", "optimizer")


def timeline(events) -> list[dict]:
    """A profiled step's events as plain rows {"lane", "name", "start_ms", "end_ms"} from the step's
    start: forward ops, backward nodes ("autograd::engine::evaluate_function: ..."), the bucket
    all-reduces as launched by the hooks (c10d::allreduce_) and as run by the backend's threads
    (gloo:all_reduce / nccl:all_reduce), and the optimizer step."""
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    t0 = min(e.time_range.start for e in (steps or events))
    backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    first_bwd = min((e.time_range.start for e in backward), default=float("inf"))
    rows = []
    for e in events:
        name, parent = e.name, e.cpu_parent.name if e.cpu_parent is not None else ""
        if name.startswith("autograd::engine::evaluate_function"):
            lane, name = "backward", name.split(": ", 1)[-1]
        elif name == "c10d::allreduce_":
            lane = "all-reduce launch"
        elif name.endswith(":all_reduce") and not name.startswith("c10d"):
            lane = "all-reduce transfer"
        elif name.startswith("Optimizer.step"):
            lane = "optimizer"
        elif parent.startswith("ProfilerStep") and name.startswith("aten::") and e.time_range.end <= first_bwd:
            lane = "forward"
        else:
            continue
        rows.append({"lane": lane, "name": name, "start_ms": (e.time_range.start - t0) / 1e3,
                     "end_ms": (e.time_range.end - t0) / 1e3})
    return rows


def plot_timeline(ax, rows: list[dict], title: str = "") -> None:
    """One lane per kind of event (`timeline` rows), time in ms from the step's start."""
    colors = {"forward": "tab:blue", "backward": "tab:green", "all-reduce launch": "tab:red",
              "all-reduce transfer": "tab:orange", "optimizer": "tab:purple"}
    lanes = [lane for lane in LANES if any(r["lane"] == lane for r in rows)]
    for y, lane in enumerate(lanes):
        spans = [(r["start_ms"], max(r["end_ms"] - r["start_ms"], 0.01)) for r in rows if r["lane"] == lane]
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colors[lane], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title, fontsize=9)


def overlap(P, device, log_dir, steps: int = 3) -> dict:
    """Profile `steps` bucketed steps (after one warm-up step) and keep the fastest (on a shared
    machine a step can lose the CPU for tens of ms): its all-reduce launches, the bytes of each, how
    many start before backward's last op ends ("during backward") and before its last gradient node
    starts ("with backward left", the bytes of those too); its events for a timeline."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    heartbeat("overlap: profiling bucketed steps")
    net = DataParallelBucket(model(P, device), bucket_cap_mb=P.bucket_cap_mb)
    opt = torch.optim.SGD(net.parameters(), lr=P.lr)
    step = ddp_step("overlap")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    handler = tensorboard_trace_handler(str(Path(log_dir) / "profile"), worker_name=f"rank{dist.get_rank()}")
    with quiet_profiler(), profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                   on_trace_ready=handler) as prof:
        for s in range(1 + steps):
            # the bytes of each launch, counted in the warm-up step only: a dispatch mode would show every
            # all-reduce twice in the profiled steps; the hooks fire in the same order at every step
            with CommCounter() if s == 0 else contextlib.nullcontext() as comm:
                step(net, opt, batch(P, s, dist.get_rank(), device))
            if s == 0:
                sizes = [c.nbytes for c in comm.calls if c.kind == "all_reduce"]
            prof.step()
    events = prof.events()
    fastest = min((e for e in events if e.name.startswith("ProfilerStep")),
                  key=lambda e: e.time_range.end - e.time_range.start)
    events = [e for e in events if fastest.time_range.start <= e.time_range.start <= fastest.time_range.end]
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    backward_end, last_node = max(e.time_range.end for e in nodes), max(e.time_range.start for e in nodes)
    # c10d::allreduce_ is the launch from the hook (one per bucket); the backend's own event
    # (gloo:all_reduce, nccl:all_reduce) is the transfer it queues, so counting both would double
    starts = sorted(e.time_range.start for e in events if e.name == "c10d::allreduce_")
    if len(sizes) != len(starts):
        raise RuntimeError(f"overlap: {len(starts)} profiled all-reduces, {len(sizes)} counted")
    left = [t < last_node for t in starts]
    return {"all-reduces": len(starts), "during backward": sum(t < backward_end for t in starts),
            "with backward left": sum(left), "bytes": sum(sizes),
            "bytes with backward left": sum(b for b, x in zip(sizes, left) if x), "buckets": len(net.buckets),
            "timeline": timeline(events)}


def exposed_comm(P, device) -> dict:
    """Step times of `VERSIONS` of bucketed DDP on one fixed batch per rank, interleaved step by step
    (P.max_steps paired rounds after 2 warm-up rounds), each step ending at a barrier (its time is in
    every version alike, and cancels in the differences): {version: [seconds per round]}."""
    heartbeat("exposed communication: timing")
    b, fns = batch(P, 0, dist.get_rank(), device), {}
    for name in VERSIONS:
        net = DataParallelBucket(model(P, device), bucket_cap_mb=P.bucket_cap_mb, overlap=name != "after backward")
        net.require_backward_grad_sync = name != "no all-reduce"  # what no_sync clears: local gradients only
        opt = torch.optim.SGD(net.parameters(), lr=P.lr, momentum=0.9)
        step = ddp_step(f"exposed communication, {name}")

        def fn(net=net, opt=opt, step=step):
            step(net, opt, b)
            dist.barrier()
        fns[name] = fn
    return {name: t.times_s for name, t in time_interleaved(fns, device=device, reps=P.max_steps).items()}


def paired(times: dict, a: str, b: str, how: str) -> E.Estimate:
    """Median over paired rounds of times[a] - times[b] in ms, with its order-statistics interval."""
    return E.median_interval([1e3 * (x - y) for x, y in zip(times[a], times[b])], how)


def exposed_rows(times: dict) -> list[dict]:
    """The step time of each version, and the three paired differences (ms, medians of the rounds)."""
    n = len(times["overlapped"])
    rows = [{"quantity": f"step, {v}", "ms [95%]": str(E.median_interval([1e3 * t for t in times[v]]))}
            for v in VERSIONS]
    rows += [{"quantity": q, "ms [95%]": str(paired(times, a, b, f"paired, {n} rounds"))}
             for q, a, b in (("exposed communication: overlapped - no all-reduce", "overlapped", "no all-reduce"),
                             ("communication after backward: after - no all-reduce", "after backward",
                              "no all-reduce"),
                             ("hidden by the overlap: after - overlapped", "after backward", "overlapped"))]
    return rows


def overlap_claims(R: dict) -> list[C.Claim]:
    """What the overlap hides (wall clock: paired rounds, judged by `C.timed`) and the launch proxy
    (counted: the hooks fire during backward whatever happens, so it is shown by construction)."""
    N, dev = R["world"], R["device"].split(":")[0]
    times, ov = R["exposed"], R["overlap"]
    hidden = paired(times, "after backward", "overlapped", f"T_after - T_overlapped, paired rounds, median of "
                                                            f"{len(times['overlapped'])}")
    # on a CPU gloo moves the bytes on its own thread: overlap needs a core for it beside each rank's
    # compute (2 threads per rank), and the notebook's kernel waits beside the ranks
    threads = 2 if dev == "cpu" else 1
    share = ov["bytes with backward left"] / max(1, ov["bytes"])
    return [
        C.Claim("launching the bucket all-reduces during backward hides communication: the step is faster than "
                "with the same all-reduces after backward (dlo's bucketed DDP, both ways)", LI_OVERLAP,
                "T_overlapped < T_after",
                C.at_least(0.0, "> 0 ms"), C.timed(hidden, device=dev, world_size=N, threads=threads, kernel=True)),
        C.by_construction("the proxy for overlap: the bucket all-reduces start while backward still runs", LI_OVERLAP,
                          "all buckets but the last",
                          "the gradient hooks fire during backward and the buckets follow the reverse parameter "
                          "order, so every bucket but the first layer's starts with backward left to run; a launch "
                          "is not a hidden transfer (that is the row above)",
                          E.exact(share, f"profiler + CommCounter: {ov['with backward left']} of {ov['all-reduces']} "
                                         f"all-reduces, {ov['bytes with backward left']:,} of {ov['bytes']:,} B "
                                         f"launched before backward's last gradient node; "
                                         f"{ov['during backward']} before backward ends"))]


def bucket_sweep(P, world_size: int, alpha: float, beta: float, caps_mb=(0.01, 0.05, 0.25, 1.0, 25.0)) -> list[dict]:
    """Per bucket cap: the buckets of `DataParallelBucket` on the day's model (meta device, a fake
    process group of `world_size` ranks), the all-reduces per step (one per bucket), the alpha-beta time
    of all of them (ring) and of the last one, which starts when backward ends and cannot overlap."""
    from dlo.distributed.collectives import allreduce_time
    from dlo.plan import fake_world

    if not caps_mb or min(caps_mb) <= 0:
        raise ValueError(f"bucket_sweep: need bucket caps > 0 MB, got {caps_mb}")
    rows = []
    with fake_world(world_size):
        for cap in caps_mb:
            sizes = [bk.buffer.numel() * bk.buffer.element_size()
                     for bk in DataParallelBucket(model(P, "meta"), bucket_cap_mb=cap).buckets]
            rows.append({"bucket_cap_mb": cap, "all-reduces/step": len(sizes), "largest bucket B": max(sizes),
                         "predicted comm ms": 1e3 * sum(allreduce_time(s, world_size, alpha, beta) for s in sizes),
                         "last bucket ms (cannot overlap)": 1e3 * allreduce_time(sizes[-1], world_size, alpha, beta)})
    return rows


