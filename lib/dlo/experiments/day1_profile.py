"""Day 1, section 9: a training step profiled with its data pipeline, the claims about the data-loading
bottleneck, and the sentence that says what the profiles measured.

The slow pipeline is built on purpose (a Dataset that decodes a `P.jpeg_size`-pixel JPEG per sample in
`__getitem__`): that its decode dominates the step is a choice of the notebook, shown "by
construction", not a measurement of FIDLE's 92%. What the profiles do test: the two fixes, decoding
once (the profile's share removed, and Amdahl's law for the speed-up) and decoding in worker processes
(FIDLE's advice, `num_workers`), whose workers need cores of their own beside the training loop.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from dlo import claims as C
from dlo import estimates as E

FIDLE, LIPPE = "FIDLE seq. 16 (PyTorch profiler)", "Lippe 2024 (profiling)"
WORKERS_SHARE = 0.1  # the share of a step the DataLoader may keep when its decode is hidden (fixed or in workers)


def profile_steps(model, optimizer, loader, *, device, active: int = 6, trace_dir=None, name: str = "step") -> dict:
    """Profile `active` SGD-style training steps (after one skipped and one warm-up step) of `model`
    on `loader`, each labelled forward / backward / optimizer with record_function. Returns
    {"spans", "steps", "share" (per step, of the DataLoader's __next__), "step_ms" (per step)} and
    writes the Chrome trace to `trace_dir` (TensorBoard's profiler plugin, Perfetto) when given."""
    from dlo.profiling import lane_shares, quiet_profiler, spans, steps
    from dlo.train import cycle

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    handler = tensorboard_trace_handler(str(trace_dir), worker_name=name) if trace_dir else None
    batches = iter(cycle(loader))
    with quiet_profiler(), profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=active),
                                   on_trace_ready=handler) as prof:
        for _ in range(active + 2):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))  # DataLoader.__next__
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            prof.step()
    events = prof.events()
    sp, st = spans(events), steps(events)
    return {"spans": sp, "steps": st, "share": lane_shares(sp, st, "data loading"),
            "step_ms": [s.duration_us / 1e3 for s in st]}


def interleaved_steps(make_model, loaders: dict, *, device, reps: int = 6) -> tuple[dict, dict]:
    """Step times of each pipeline in `loaders` ({name: DataLoader}) taken side by side, outside the
    profiler: round r runs one training step (next batch, forward, backward, SGD step) of every
    pipeline, each with its own `make_model()`, so a phase in which the machine is busier hits every
    pipeline of that round alike (profiles taken one after the other do not share it). Returns
    ({name: Timing}, {name: [per round, the share of the step spent fetching the batch]})."""
    import time

    from dlo.measure import time_interleaved
    from dlo.train import cross_entropy_step, cycle

    step, fns, fetch = cross_entropy_step(), {}, {}
    for name, loader in loaders.items():
        model = make_model().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        fetch[name], batches = [], iter(cycle(loader))

        def one_step(m=model, o=opt, it=batches, log=fetch[name]):
            t0 = time.perf_counter()
            batch = tuple(t.to(device) for t in next(it))
            log.append(time.perf_counter() - t0)
            step(m, o, batch)
        fns[name] = one_step
    times = time_interleaved(fns, device=device, warmup=2, reps=reps)
    shares = {name: [f / t for f, t in zip(fetch[name][2:], times[name].times_s)] for name in fns}  # 2 warm-up rounds
    return times, shares


def profiling_claims(before: dict, after: dict, on_gpu: bool = False, *, workers: dict | None = None,
                     num_workers: int = 2, jpeg_size: int | None = None, times: tuple | None = None,
                     fetch_share: list[float] | None = None) -> list[C.Claim]:
    """Claims about the data-loading bottleneck from `profile_steps` results: `before` (decode per
    sample), `after` (decoded once) and `workers` (the decode in `num_workers` processes). The measured
    speed-up is the paired ratio per round of `times` = (slow, fixed) Timings of `interleaved_steps`
    when given, else the ratio of the two profiles' medians (unpaired: taken at different times); Amdahl's
    prediction uses `fetch_share` (the slow pipeline's per-round fetch shares from the same rounds) when
    given, so prediction and measurement come from the same moments, else the profile's share. On a
    GPU the "GPU idle" row reads the GPU-kernel lane of the slow pipeline's trace; on a CPU it and the
    memory-snapshot row are kept as "not measurable here"."""
    from dlo.profiling import DEVICE_LANE, lane_shares

    threads = torch.get_num_threads()
    where = dict(device="cuda" if on_gpu else "cpu", threads=threads)  # one process, its threads
    share_b, share_a = (C.timed(E.median_interval(p["share"]), **where) for p in (before, after))
    if times is not None:  # paired: both pipelines' steps of one round share the machine's load
        rounds = [a / b for a, b in zip(times[0].times_s, times[1].times_s)]
        fix = E.median_interval(rounds, how=f"slow / fixed step, median of {len(rounds)} paired interleaved rounds")
    else:
        fix = E.ratio(E.median_interval(before["step_ms"]), E.median_interval(after["step_ms"]),
                      how="ratio of median profiled steps")
    speedup = C.timed(fix, **where)
    amdahl = 1 / (1 - (E.median_interval(fetch_share).value if fetch_share else share_b.value))
    size = f"{jpeg_size}-px " if jpeg_size else ""
    rows = [
        C.by_construction("a per-sample decode in __getitem__ dominates the step", FIDLE,
                          "92.2% of the step in the DataLoader",
                          f"the notebook chose the {size}JPEGs so that their decode dominates: a demonstration "
                          "of what the profiler shows, not a test of FIDLE's 92%", measured=share_b,
                          region=C.at_least(0.5, ">= 50%")),
        C.Claim("decoding once (tensors in memory) removes the bottleneck", FIDLE, "high time cost on input data "
                "loading: fix the input", C.at_most(WORKERS_SHARE, f"<= {WORKERS_SHARE:.0%}"), share_a),
        C.Claim("the fix speeds the step up by 1 / (1 - share)", "Amdahl's law", f"{amdahl:.2g}x",
                C.approx(amdahl, rel=0.25), speedup),
    ]
    if workers is not None:  # FIDLE's advice itself; the workers need cores beside the training loop's:
        # its torch threads on a CPU, which computes there; one on a GPU, where the loop only launches kernels
        loop = 1 if on_gpu else threads
        share_w = C.timed(E.median_interval(workers["share"]), device=where["device"], threads=loop + num_workers)
        rows.append(C.Claim(f"decoding in {num_workers} worker processes hides the decode", FIDLE,
                            "you could try to set num_workers", C.at_most(WORKERS_SHARE, f"<= {WORKERS_SHARE:.0%}"),
                            share_w))
    if on_gpu:
        busy = C.timed(E.median_interval(lane_shares(before["spans"], before["steps"], DEVICE_LANE),
                                         how="median share of the step with a GPU kernel running"), **where)
        rows.append(C.Claim("GPU idle while the CPU loads data", FIDLE, "GPU 0 has low utilization",
                            C.at_most(0.5, "kernels <= 50% of the step"), busy))
    else:
        rows += [C.not_measurable("GPU idle while the CPU loads data", FIDLE, "GPU 0 has low utilization",
                                  "no GPU here: on a GPU the trace's CUDA lane measures it"),
                 C.not_measurable("a memory snapshot shows the biggest tensors and when they live", LIPPE,
                                  "memory profiling", "no CUDA allocator on a CPU: on a GPU section 9.2 writes "
                                  "the snapshot")]
    return rows


def describe(profiles: dict[str, dict]) -> str:
    """What the profiles measured, in words: each pipeline's median DataLoader share and step time, which
    pipeline was fastest, and whether the slow one's step was mostly data loading. Generated from the
    numbers, so the text says what the table shows, whatever it shows."""
    med = {name: (statistics.median(p["share"]), statistics.median(p["step_ms"])) for name, p in profiles.items()}
    parts = [f'"{name}": {share:.1%} of a {ms:.1f} ms step in the DataLoader' for name, (share, ms) in med.items()]
    fastest = min(med, key=lambda n: med[n][1])
    slow, (share, _) = next(iter(med.items()))
    verdict = ("most of each step waits for data: the compute bars are short islands between data-loading bars"
               if share >= 0.5 else "data loading is not the larger part of the step here: the compute bars "
               "dominate the timeline")
    return (f"Measured here (medians over the profiled steps): {'; '.join(parts)}. With \"{slow}\", {verdict}. "
            f"The fastest pipeline on this machine was \"{fastest}\".")
