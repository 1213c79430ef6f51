"""Reading a torch.profiler trace: spans by lane, a timeline figure, the share of a step each lane takes.

A profile is a list of timed events (`prof.events()` of `torch.profiler.profile`, or the
`traceEvents` of the Chrome-trace JSON it exports, the file TensorBoard's profiler plugin and
Perfetto open). Reading one means sorting its events into a few *lanes* a person can reason about
(data loading, forward, backward, optimizer, communication, GPU kernels), drawing them on a common
time axis, and asking what fraction of each training step a lane occupies: FIDLE's profiler
recommendation "92.2% of the step time is in DataLoader" is `lane_shares(..., "data loading")`.

Also here: `quiet_profiler()`, which keeps Kineto's start/stop lines out of a notebook's output,
and `EncodedImages`, a dataset that decodes a JPEG per sample, the usual data-loading bottleneck.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

# lane -> regular expression on event names; the first lane that matches an event gets it. The
# record_function labels "forward", "backward", "optimizer" are the ones a profiled step sets itself.
LANES: dict[str, str] = {
    "data loading": r"DataLoader.*__next__",
    "forward": r"^forward$",
    "backward": r"^backward$|^autograd::engine::evaluate_function",
    "optimizer": r"^optimizer$|^Optimizer\.step",
    "communication": r"^c10d::|^nccl:|^gloo:",
}
DEVICE_LANE = "GPU kernels"  # events that ran on a CUDA device (kernels, memcpy), whatever their name
STEP = re.compile(r"^ProfilerStep(#\d+|\*)$")  # "ProfilerStep*" in prof.events(), "#N" in traces


@dataclass(frozen=True)
class Span:
    """One event of a lane, in microseconds since the profile's origin."""

    lane: str
    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def _records(events):
    """(name, start_us, end_us, on_device) of FunctionEvents or Chrome-trace complete ("X") events."""
    for e in events:
        if isinstance(e, dict):
            if e.get("ph") == "X" and "dur" in e:
                start = float(e["ts"])
                yield e["name"], start, start + float(e["dur"]), e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        else:
            on_device = getattr(e, "device_type", None) not in (None, torch.autograd.DeviceType.CPU)
            yield e.name, float(e.time_range.start), float(e.time_range.end), on_device


def spans(events, lanes: dict[str, str] | None = None, device_lane: str | None = DEVICE_LANE) -> list[Span]:
    """Sort profiler events into lanes (`LANES` by default); events no lane matches are dropped.
    Events on a GPU go to `device_lane` (None: drop them)."""
    patterns = [(lane, re.compile(p)) for lane, p in (LANES if lanes is None else lanes).items()]
    out = []
    for name, start, end, on_device in _records(events):
        if on_device:
            if device_lane is not None:
                out.append(Span(device_lane, name, start, end))
            continue
        lane = next((lane for lane, pat in patterns if pat.search(name)), None)
        if lane is not None:
            out.append(Span(lane, name, start, end))
    return sorted(out, key=lambda s: s.start_us)


def steps(events) -> list[Span]:
    """The `ProfilerStep#N` spans `prof.step()` marks: one per profiled training step, in order."""
    return sorted((Span("step", n, s, e) for n, s, e, dev in _records(events) if not dev and STEP.match(n)),
                  key=lambda s: s.start_us)


def merged(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint sorted intervals: nested events count once."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_us(spans_: list[Span], lane: str, start: float = -np.inf, end: float = np.inf) -> float:
    """Microseconds of [start, end] during which `lane` had at least one event running."""
    cut = [(max(s.start_us, start), min(s.end_us, end)) for s in spans_ if s.lane == lane]
    return sum(b - a for a, b in merged((a, b) for a, b in cut if b > a))


def lane_shares(spans_: list[Span], steps_: list[Span], lane: str) -> list[float]:
    """Per profiled step, the fraction of its wall time during which `lane` was running."""
    if not steps_:
        raise ValueError("no ProfilerStep spans: call prof.step() after every step and keep >= 1 active step")
    return [busy_us(spans_, lane, st.start_us, st.end_us) / st.duration_us for st in steps_]


def plot_timeline(spans_: list[Span], steps_: list[Span] | None = None, ax=None, title: str = "",
                  lanes: list[str] | None = None):
    """A Gantt-like figure: one row per lane, a bar per (merged) event, milliseconds from the first
    step (or event); step boundaries as dotted lines. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    lanes = lanes or [lane for lane in [*LANES, DEVICE_LANE] if any(s.lane == lane for s in spans_)]
    lanes += sorted({s.lane for s in spans_} - set(lanes))
    origin = min([s.start_us for s in steps_ or spans_] or [0.0])
    colours = plt.get_cmap("tab10")
    for row, lane in enumerate(lanes):
        bars = [((a - origin) / 1e3, (b - a) / 1e3) for a, b in merged((s.start_us, s.end_us)
                                                                       for s in spans_ if s.lane == lane)]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colours(row % 10))
    for st in steps_ or []:
        ax.axvline((st.start_us - origin) / 1e3, color="grey", ls=":", lw=1)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", title=title)
    return ax


# Kineto prints these from C++ on fd 2 each time a profiler starts or stops.
_NOISE = re.compile(r"^(USDT|STAGE):.*SyncActivityProfilerHandler|^\s*$")


@contextlib.contextmanager
def quiet_profiler():
    """Capture what native code writes to fd 2 while the block runs and pass on everything except
    Kineto's start/stop/stage lines (`with quiet_profiler(), torch.profiler.profile(...) as prof:`);
    the profiler's Python warnings (start/stop chatter too) are not shown either."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines() if not _NOISE.match(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


# ----------------------------------------------------------------------------- a slow data pipeline

class EncodedImages(Dataset):
    """An image dataset stored the way photos are: one JPEG per sample at `size` x `size` pixels.

    `__getitem__` decodes the JPEG and resizes it back to the training size, the per-sample work of
    a typical ImageNet loader; with `num_workers=0` the training loop waits for it at every batch.
    `decoded()` is the fix that trades memory for time: decode everything once, keep the tensors.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int = 384, quality: int = 90):
        from PIL import Image

        if images.dim() != 4 or images.shape[1] != 3 or len(images) != len(labels):
            raise ValueError(f"need images (N, 3, H, W) and N labels, got {tuple(images.shape)}, {len(labels)}")
        self.labels, self.hw = labels, tuple(images.shape[2:])
        # uint8 pixels need a range: the data set's own (kept to undo the mapping after decoding)
        self.lo, self.hi = float(images.min()), float(images.max())
        pixels = ((images - self.lo) / (self.hi - self.lo) * 255).round().clamp(0, 255).to(torch.uint8)
        self.jpegs = []
        for img in pixels.permute(0, 2, 3, 1).numpy():  # (H, W, 3) each
            buf = io.BytesIO()
            Image.fromarray(img).resize((size, size), Image.BICUBIC).save(buf, format="JPEG", quality=quality)
            self.jpegs.append(buf.getvalue())

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        img = Image.open(io.BytesIO(self.jpegs[i])).convert("RGB").resize(self.hw[::-1], Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)  # (3, H, W)
        return x / 255 * (self.hi - self.lo) + self.lo, self.labels[i]

    def decoded(self) -> TensorDataset:
        """Every sample decoded once, as tensors: the same values, no per-sample work left."""
        xs, ys = zip(*(self[i] for i in range(len(self))))
        return TensorDataset(torch.stack(xs), torch.stack(ys))
