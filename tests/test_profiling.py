"""dlo.profiling: lanes, merged busy time and per-step shares on hand-made events and on a real
profile of a loop whose "data loading" is a known sleep; EncodedImages round-trips its images."""

import time

import pytest
import torch
from torch.profiler import profile, record_function, schedule

from dlo.profiling import EncodedImages, Span, busy_us, lane_shares, merged, quiet_profiler, spans, steps


def _x(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_chrome_trace_events_are_sorted_into_lanes():
    events = [_x("ProfilerStep#3", 0, 100), _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 60),
              _x("forward", 60, 20), _x("aten::mm", 61, 5), _x("backward", 80, 15), _x("optimizer", 95, 5),
              _x("volta_sgemm", 70, 4, cat="kernel")]
    sp = spans(events)
    assert [s.lane for s in sp] == ["data loading", "forward", "GPU kernels", "backward", "optimizer"]
    st = steps(events)
    assert len(st) == 1 and st[0].duration_us == 100
    assert lane_shares(sp, st, "data loading") == [0.6]


def test_nested_and_overlapping_events_count_once():
    assert merged([(0, 10), (5, 15), (20, 30), (21, 22)]) == [(0, 15), (20, 30)]
    sp = [Span("a", "x", 0, 10), Span("a", "y", 5, 15), Span("b", "z", 0, 100)]
    assert busy_us(sp, "a") == 15 and busy_us(sp, "a", 10, 12) == 2


def test_a_real_profile_finds_the_slow_loader():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.004)  # the per-sample decode
            return torch.randn(8), i % 2

    loader = torch.utils.data.DataLoader(Slow(), batch_size=4)
    model = torch.nn.Linear(8, 2)
    with quiet_profiler(), profile(schedule=schedule(wait=1, warmup=1, active=3, repeat=1)) as prof:
        it = iter(loader)
        for _ in range(5):
            x, y = next(it)
            with record_function("forward"):
                torch.nn.functional.cross_entropy(model(x), y)
            prof.step()
    ev = prof.events()
    sp, st = spans(ev), steps(ev)
    assert len(st) == 3
    for s in st:  # each step's loader slept 4 x 4 ms: a lower bound whatever the machine's load
        assert busy_us(sp, "data loading", s.start_us, s.end_us) >= 4 * 4000
    assert min(lane_shares(sp, st, "data loading")) > max(lane_shares(sp, st, "forward"))


def test_encoded_images_decode_back_to_the_images():
    gen = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(3, 3, 4, 4, generator=gen), size=(8, 8), mode="bilinear")
    ds = EncodedImages(smooth, torch.arange(3), size=32, quality=95)
    x, y = ds[1]
    assert x.shape == (3, 8, 8) and int(y) == 1
    assert (x - smooth[1]).abs().mean() < 0.05  # JPEG is lossy, not wrong
    dec = ds.decoded()
    assert torch.equal(dec.tensors[0][1], x)
    with pytest.raises(ValueError, match="N labels"):
        EncodedImages(smooth, torch.arange(2))
