"""dlo.experiments.day4: model and batch choices, one 2-rank run of the ResNet path (the tiny
notebook covers the MLP path end to end), the bytes the compression hooks send, heartbeats, the
planner against a hand count; the bandwidth sweep's warm-up, the bytes on the wire, the 1-bit Adam
experiment, the profiler timeline, the overlap's launch proxy and exposed time, the bucket sweep, and
the claims' verdicts on synthetic results."""

import dataclasses

import pytest
import torch

from dlo import claims as C
from dlo.claims import AGREES, BY_CONSTRUCTION, DISAGREES, NOT_MEASURABLE, NOT_TESTED
from dlo.distributed import launch
from dlo.experiments import day4 as E
from dlo.experiments import day4_data as D4
from dlo.experiments import day4_overlap as O4
from dlo.experiments import day4_report as R4
from dlo.models.resnet import resnet18
from dlo.plan import GIB
from dlo.presets import Day4Preset

RESNET = Day4Preset(model="resnet18", image_size=16, width=4, batch_per_rank=3, max_steps=2, bucket_cap_mb=0.01)


def test_resnet18_has_the_papers_size():
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512  # ResNet-18, 1000 classes
    assert resnet18(10, 4)(torch.randn(2, 3, 17, 17)).shape == (2, 10)  # odd sizes pool to 1x1


def test_models_and_batches():
    cpu = torch.device("cpu")
    x, y = E.batch(RESNET, 0, 1, cpu)
    assert x.shape == (3, 3, 16, 16) and y.shape == (3,) and E.model(RESNET, cpu)(x).shape == (3, 10)
    tiny = Day4Preset()
    x, y = E.batch(tiny, 0, 0, cpu)
    assert x.shape == (tiny.batch_per_rank, tiny.d_in) and E.model(tiny, cpu)(x).shape == (tiny.batch_per_rank, 10)
    assert torch.equal(E.batch(tiny, 3, 1, cpu)[0], E.batch(tiny, 3, 1, cpu)[0])  # seeded
    assert not torch.equal(E.batch(tiny, 3, 0, cpu)[0], E.batch(tiny, 3, 1, cpu)[0])  # ranks differ
    stream = E.batches(tiny, 1, cpu)
    assert torch.equal(next(stream)[0], E.batch(tiny, 0, 1, cpu)[0]) and torch.equal(next(stream)[0],
                                                                                     E.batch(tiny, 1, 1, cpu)[0])
    with pytest.raises(ValueError, match="resnet18"):
        E.model(dataclasses.replace(tiny, model="vit"), cpu)


def _resnet_worker(P, log_dir):
    device = E.rank_device()
    return (E.step_times(P, device, E.wrappers(P, device)), O4.overlap(P, device, log_dir), E.compression(P, device),
            O4.exposed_comm(P, device))


def test_resnet_comparison_overlap_and_compression_on_two_ranks(tmp_path):
    times, ov, comp, exposed = launch(_resnet_worker, 2, dataclasses.replace(RESNET, compress_steps=3, wire_calls=2),
                             tmp_path, timeout=120)[0]
    assert set(times) == {"naive DDP (dlo)", "bucketed DDP (dlo)", "torch DDP"}
    # the control of the throughput rows: dlo's engines make torch DDP's updates (the GPU's path runs it too)
    assert all(times[k]["update gap"] < 1e-3 for k in ("naive DDP (dlo)", "bucketed DDP (dlo)"))
    assert all(v["time_s"] > 0 and v["samples/s"] > 0 for v in times.values())
    # 0.01 MB buckets: several, one launch each, all issued during backward
    assert ov["buckets"] > 2 and ov["all-reduces"] == ov["buckets"] and ov["during backward"] >= 1
    # the launch proxy: every gradient byte is launched once; the last bucket (the first layers) starts in
    # backward's last gradient node, with nothing left to overlap
    n_params = sum(p.numel() for p in E.model(RESNET, "cpu").parameters())
    assert ov["bytes"] == 4 * n_params and 1 <= ov["with backward left"] < ov["all-reduces"]
    assert 0 < ov["bytes with backward left"] < ov["bytes"]
    # exposed communication: the three versions timed in the same rounds
    assert set(exposed) == set(O4.VERSIONS) and all(len(t) == RESNET.max_steps and min(t) > 0 for t in exposed.values())
    assert list((tmp_path / "profile").glob("rank0*.json"))
    # CommCounter sees the hooks' all-reduces: fp32 sends every gradient byte, fp16 half of them,
    # PowerSGD (compressing from step 2) low-rank factors only
    n_bytes = 4 * sum(p.numel() for p in E.model(RESNET, "cpu").parameters())
    assert comp["fp32 (no compression)"]["bytes/step"] == n_bytes
    assert comp["fp16 compress"]["bytes/step"] == n_bytes // 2
    assert 0 < comp["PowerSGD"]["bytes/step"] < n_bytes // 2
    assert "bf16 compress" not in comp  # gloo has no bf16 sum: the notebook shows it as not measurable
    # PowerSGD's P and Q all-reduces run in callbacks, usually on gloo's threads: CommCounter (a dispatch
    # mode of the calling thread) then sees only its first all-reduce; when gloo has finished before the
    # callback is attached, it runs on the calling thread and is seen too (under load: 24040 of 24040 B).
    # The rank's TCP sockets see all three either way (their counters are the process's own: other tests
    # running beside this one do not move them)
    ps = comp["PowerSGD"]
    assert all(ps["bytes/step"] <= ps["formula bytes"] <= b for b, _ in ps["wire sent/step"])
    # fp32: the gradients once at N = 2 (a ring sends 2(N-1)/N n), plus gloo's message headers: a few
    # hundred bytes per all-reduce, one per bucket (~208 B measured)
    assert all(n_bytes <= b < n_bytes + 512 * ov["all-reduces"]
               for b, _ in comp["fp32 (no compression)"]["wire sent/step"])
    # PowerSGDState's own count of what it all-reduced in the counted step: Vogels et al.'s formula exactly
    assert ps["state bytes/step"] == ps["formula bytes"]


def test_ddp_step_says_what_it_does(tmp_path, monkeypatch):
    beat = tmp_path / "beat"
    monkeypatch.setenv("DLO_HEARTBEAT_FILE", str(beat))
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = D4.ddp_step("compression, fp16")
    for _ in range(11):
        out = step(net, opt, (torch.randn(2, 4), torch.tensor([0, 2])))
    assert beat.read_text() == "compression, fp16: step 10" and out["loss"].dim() == 0


def test_plan_matches_a_hand_count():
    P = dataclasses.replace(Day4Preset(), d_in=8, hidden=16, layers=1, batch_per_rank=5, bn_batch=3,
                            bucket_cap_mb=25.0, msg_sizes=(1024, 4096))
    rows = {r["config"]: r for r in E.plan(P, gpus=3, gpu_mem_gb=1.0)}
    n = 4 * (8 * 16 + 16 + 16 * 10 + 10)  # MLP 8 -> 16 -> 10, fp32
    three = rows["throughput: naive + bucketed + torch DDP"]
    # three replicas; SGD momentum (one buffer each), our bucket and torch DDP's bucket (one copy each)
    assert (three["params"], three["grads"], three["optimizer"]) == (3 * n, 3 * n, 3 * n + n + n)
    assert three["world"] == 3 and three["gpu"] == GIB and three["main"]
    # what autograd saves for the MLP at batch 5: the input (5, 8) for the first matmul, the ReLU's
    # output (5, 16; also the second matmul's input, counted once), log-softmax's output (5, 10),
    # the int64 targets (5,) and nll_loss's fp32 total weight (a 0-dim tensor); weights excluded
    assert three["activations"] == 4 * 5 * 8 + 4 * 5 * 16 + 4 * 5 * 10 + 8 * 5 + 4
    assert rows["bus bandwidth: 0 MiB all-reduce"]["activations"] == 4096
    bn = rows["SyncBatchNorm: MLP"]
    assert bn["params"] == n + 4 * 2 * 16  # BatchNorm1d's weight and bias


# ----------------------------------------------------------------------------- bytes, warm-up, 1-bit Adam, claims

def _measurements_worker(P):
    import time as _time

    import torch.distributed as dist

    from dlo.distributed.collectives import bus_bandwidth
    from dlo.experiments import day4_comm

    real, calls = dist.all_reduce, [0]

    def slow_first(*args, **kwargs):  # a first call that pays a set-up cost, as a fresh process group does
        calls[0] += 1
        if calls[0] == 1:
            _time.sleep(2.0)
        return real(*args, **kwargs)

    dist.all_reduce = slow_first
    try:
        bw = bus_bandwidth([1024, 4096], reps=1, trials=3, device="cpu")
    finally:
        dist.all_reduce = real
    device = E.rank_device()
    return {"bw": bw, "ring": day4_comm.ring_sent(dist.get_world_size() * 8),
            "wire": day4_comm.wire_bytes(1 << 20, calls=2, trials=3), "onebit": E.onebit_adam(P, device)}


def test_bandwidth_warm_up_bytes_on_the_wire_and_onebit_adam_on_two_ranks():
    P = dataclasses.replace(Day4Preset(), hidden=32, layers=2, onebit_steps=4, onebit_warmup=2, onebit_seeds=1,
                            onebit_chunk=64)
    res = launch(_measurements_worker, 2, P, timeout=120)[0]
    # the slow first call falls in the untimed round: no kept time carries its 2 s (a 4 KB all-reduce
    # on loopback takes microseconds; the margin is for a loaded machine, not a performance bar)
    assert all(len(r["times_s"]) == 3 and max(r["times_s"]) < 1.0 for r in res["bw"])
    assert res["ring"] == 1.0  # the ring's sends carry 2(N-1)/N n = n at N = 2
    # gloo's all-reduce at N = 2: n per rank on its sockets, plus gloo's message headers (a few hundred
    # bytes per call; not n/2 of a half-ring, not 2n of sending everything), in every trial
    assert all(1.0 <= x < 1.01 for x in res["wire"]["ratio"]), res["wire"]["ratio"]
    assert all(0 <= e < 0.01 * (1 << 20) for e in res["wire"]["excess per call"]) and min(res["wire"]["segments"]) > 0
    ob = res["onebit"]
    one, fp32 = ob["1-bit Adam"]["sent"][0], ob["Adam (fp32 all-reduce)"]["sent"][0]
    assert one[:2] == fp32[:2] and one[-1] < fp32[-1] / 20  # warm-up at full precision, then ~1/32 + 1/64
    assert len(ob["frozen variance, no BatchNorm"]["losses"]) == 1 and len(ob["1-bit Adam"]["losses"][0]) == 4


def _wire_worker():
    from dlo.experiments import day4_comm

    return day4_comm.wire_bytes(3 << 18, calls=2, trials=3)  # 768 KiB: the headers are < 0.2%


def test_gloos_all_reduce_sends_to_one_neighbour_at_three_ranks():
    # gloo's own all-reduce read on each rank's TCP sockets, one per peer: 2(N-1)/N n = 4/3 n per rank, all of
    # it on one connection (a ring), the other connection (and the store's socket) carrying only what the
    # control window cancels; a tree or reduce + broadcast would spread it over both peers
    for wire in launch(_wire_worker, 3, timeout=120):
        for peers in wire["peers"]:
            assert peers[0] == pytest.approx(4 / 3, rel=0.01) and abs(sum(peers[1:])) < 0.01, peers


def test_timeline_sorts_profiler_events_into_lanes():
    from types import SimpleNamespace as NS

    def ev(name, start, end, parent=None):
        return NS(name=name, time_range=NS(start=start, end=end), cpu_parent=parent)

    step = ev("ProfilerStep#2", 1000, 9000)
    events = [step, ev("aten::linear", 1100, 1500, step), ev("aten::add", 1200, 1300, ev("aten::linear", 0, 0)),
              ev("autograd::engine::evaluate_function: AddmmBackward0", 2000, 3000),
              ev("c10d::allreduce_", 2500, 2600), ev("gloo:all_reduce", 2600, 6000),
              ev("Optimizer.step#SGD.step", 7000, 8000)]
    rows = O4.timeline(events)
    assert [(r["lane"], r["name"]) for r in rows] == [
        ("forward", "aten::linear"), ("backward", "AddmmBackward0"), ("all-reduce launch", "c10d::allreduce_"),
        ("all-reduce transfer", "gloo:all_reduce"), ("optimizer", "Optimizer.step#SGD.step")]
    assert rows[0]["start_ms"] == 0.1 and rows[3]["end_ms"] == 5.0


def _results(wire3_ratio=1.3337, onebit_final=(0.3, 0.31, 0.29), diverged=True, ring=1.0, gpu=False, seeds=3):
    """run_all's results as plain data, the numbers chosen per test (the logic is under test, not them);
    `seeds` of the 1-bit Adam and BatchNorm runs (paired by seed)."""
    n = 1_000_000
    fp32 = {"bytes/step": 4 * n, "sent/step": 4.0 * n, "final loss": 1.0, "losses": [1.0]}
    sent_fp32, sent_1bit = [4.0 * n] * 10, [4.0 * n] * 2 + [4.0 * n * (1 / 32 + 1 / 1024)] * 8
    nan = float("nan")
    final = {"Adam (fp32 all-reduce)": [0.3, 0.3, 0.3], "1-bit Adam": list(onebit_final),
             "frozen variance, fp32 momentum": [0.3, 0.305, 0.298], "Adam, no BatchNorm": [0.4, 0.42, 0.41],
             "frozen variance, no BatchNorm": [nan, nan, 0.9] if diverged else [0.401, 0.418, 0.412]}

    def run(name, losses_end):
        return {"sent": [sent_1bit if name == "1-bit Adam" else sent_fp32] * seeds,
                "losses": [[2.0] * 10 + [v] * 10 for v in losses_end[:seeds]]}

    ob = {name: run(name, vals) for name, vals in final.items()}
    ob.update(warmup=2, steps=10, chunk=1024)

    def bn(accs):  # per seed: the accuracy, and which of the 512 shared test examples were right
        return {"test acc": accs[:seeds], "n": 512, "correct": [[1] * round(512 * a) + [0] * (512 - round(512 * a))
                                                              for a in accs[:seeds]]}

    R = {"world": 2, "device": "cuda:0" if gpu else "cpu", "ring sent": ring,
         "compression": {"fp32 (no compression)": fp32,
                         "fp16 compress": {**fp32, "bytes/step": 2 * n, "sent/step": 2.0 * n},
                         "PowerSGD": {**fp32, "bytes/step": 4000, "sent/step": 4000.0, "formula bytes": 20_000,
                                      "state bytes/step": 20_000}},
         "throughput": {"bucketed DDP (dlo)": {"times_s": [0.010, 0.011, 0.012] * 3, "update gap": 3e-8},
                        "naive DDP (dlo)": {"times_s": [0.02] * 9, "update gap": 0.0},
                        "torch DDP": {"times_s": [0.0095, 0.0105, 0.0112] * 3}},
         "overlap": {"all-reduces": 4, "during backward": 4, "with backward left": 3, "bytes": 4 * n,
                     "bytes with backward left": 3 * n},
         # paired rounds: the overlap hides ~2 ms of the ~3 ms the same all-reduces take after backward
         "exposed": {"overlapped": [0.011, 0.012, 0.0115] * 3, "after backward": [0.013, 0.014, 0.0136] * 3,
                     "no all-reduce": [0.010, 0.011, 0.0106] * 3},
         "onebit": ob, "bn_batch": 2,
         "batchnorm": {"local BatchNorm": bn([0.25, 0.3, 0.28]), "SyncBatchNorm (dlo)": bn([0.69, 0.66, 0.7])},
         "sync_bn_gap": {"output": 2e-7, "input grad": 4e-7, "running mean": 1e-8, "running var": 3e-8}}
    if not gpu:
        R["wire"] = {"world": 2, "ratio": [1.0011, 1.0012, 1.0011, 1.0013], "excess per call": [600.0] * 4,
                     "peers": [[1.0011, 0.0], [1.0012, 0.0], [1.0011, 0.0001], [1.0013, 0.0]]}
        # PowerSGD's step on the rank's sockets: its three all-reduces at N = 2 and gloo's 576 B header each
        R["compression"]["PowerSGD"].update({"formula parts": {"uncompressed": 4000, "P": 10_000, "Q": 6000},
                                             "wire sent/step": [(20_000 + 3 * 576 + k, 14) for k in range(4)]})
    wire3 = None if gpu else {"world": 3, "ratio": [wire3_ratio + 0.0005 * k for k in range(4)],
                              "excess per call": [600.0] * 4,
                              "peers": [[wire3_ratio + 0.0005 * k, 0.0002] for k in range(4)]}
    return R, wire3


def _verdicts(R, wire3=None, scale=None) -> dict:
    return {c.claim: c.verdict for c in R4.claims(R, wire3, scale)}


def _find(v: dict, text: str) -> str:
    (hit,) = [x for k, x in v.items() if text in k]
    return hit


def test_claims_measure_the_ring_instead_of_assuming_it():
    v = _verdicts(*_results())
    # at N = 2 every all-reduce algorithm sends n per rank: shown, not evidence
    assert _find(v, "the exercise's ring") == BY_CONSTRUCTION
    assert _find(v, "on the wire (N=2") == BY_CONSTRUCTION and _find(v, "on the wire (N=3") == AGREES
    # the course's ring counted by CommCounter restates its own code (it sends to rank + 1 only): never
    # evidence for the paper, whatever N (it agreed at N = 3 before)
    R, wire3 = _results(ring=4 / 3)
    R["world"] = 3
    assert _find(_verdicts(R, wire3), "the exercise's ring") == BY_CONSTRUCTION
    # per connection, gloo's own all-reduce on its TCP sockets: a ring at N = 3 puts all of its 4/3 n on one
    # neighbour; reduce + broadcast (or a tree) moves the same total over two connections and is caught;
    # at N = 2 there is one connection only
    R, wire3 = _results()
    v = _verdicts(R, wire3)
    assert _find(v, "per connection, N=2") == BY_CONSTRUCTION and _find(v, "per connection, N=3") == AGREES
    wire3["peers"] = [[1.0, 1 / 3]] * 4  # reduce to rank 0 + broadcast, seen from rank 0
    assert _find(_verdicts(R, wire3), "per connection, N=3") == DISAGREES
    assert not any("busbw" in k for k in v)  # busbw / algbw is 2(N-1)/N by definition: not a measurement
    # a backend sending everything to everyone (2n per rank at N = 3) is caught on the wire
    assert _find(_verdicts(*_results(wire3_ratio=2.0)), "on the wire (N=3") == DISAGREES
    R, _ = _results(gpu=True)  # NCCL: nothing goes through TCP sockets
    v = _verdicts(R)
    assert _find(v, "on the wire") == NOT_MEASURABLE and _find(v, "to one neighbour") == NOT_MEASURABLE
    # and PowerSGD's bytes would rest on PowerSGDState's own bookkeeping alone (the code under test)
    assert _find(v, "PowerSGD all-reduces") == NOT_MEASURABLE


def test_claims_on_compression_and_onebit_adam():
    v = _verdicts(*_results())
    assert _find(v, "fp16 compression halves") == BY_CONSTRUCTION  # a cast to 2 bytes
    # PowerSGD judged on the sockets (less gloo's headers), not on PowerSGDState's own count: the state agreeing
    # with the formula while the sockets send more (e.g. matrices left uncompressed) disagrees
    assert _find(v, "PowerSGD all-reduces") == AGREES
    (c,) = [c for c in R4.claims(*_results()) if c.claim.startswith("PowerSGD all-reduces")]
    assert "TCP socket counters" in c.row()["how"] and "the one all-reduce on the training thread" in c.row()["how"]
    R, _ = _results()
    R["compression"]["PowerSGD"]["wire sent/step"] = [(24_000 + 3 * 576, 14)] * 4
    assert _find(_verdicts(R), "PowerSGD all-reduces") == DISAGREES
    # the engine's own format restated: shown, not evidence
    assert _find(v, "97% less communication than fp32") == BY_CONSTRUCTION
    assert _find(v, "94% less communication than fp16") == BY_CONSTRUCTION
    assert _find(v, "bounds the saving") == BY_CONSTRUCTION
    assert _find(v, "the proxy for overlap") == BY_CONSTRUCTION  # hooks fire in backward whatever happens
    assert _find(v, "0.9x torch DDP") == NOT_MEASURABLE  # a GPU claim; here 2 ranks + the kernel share the CPU
    assert _find(v, "freezing it costs nothing") == AGREES
    # the control: frozen without normalisation, two of three seeds diverge (inf), as the notebook says
    assert _find(v, "without normalisation layers") == AGREES
    assert _find(_verdicts(*_results(diverged=False)), "without normalisation layers") == DISAGREES  # costs nothing
    R, _ = _results()
    R["onebit"]["Adam, no BatchNorm"]["losses"][0][-1] = float("inf")  # the baseline itself diverged
    assert _find(_verdicts(R), "without normalisation layers") == NOT_MEASURABLE
    assert _find(v, "converges like Adam") == AGREES
    assert _find(_verdicts(*_results(onebit_final=(0.45, 0.5, 0.48))), "converges like Adam") == DISAGREES
    assert _find(v, "3.3x higher throughput") == NOT_MEASURABLE and _find(v, "0/1 Adam") == NOT_TESTED
    assert _find(v, "scales nearly linearly") == NOT_MEASURABLE  # CPU ranks share the cores
    assert _find(v, "SyncBatchNorm (dlo's, held to torch's BatchNorm above) beats") == AGREES  # 3 paired seeds
    (c,) = [c for c in R4.claims(*_results()) if c.claim.startswith("0/1 Adam")]
    assert c.verdict == NOT_TESTED and "not implemented in this course" in c.row()["how"]


def test_dlos_engines_are_judged_against_torchs_not_against_themselves():
    """Issue 34: rows that time dlo's DDP or train with dlo's SyncBatchNorm are labelled "(dlo)", not "(ours)",
    and rest on controls whose measured side is torch's: torch DDP's weights after the same steps, torch's
    BatchNorm on the global batch. Each control can fail."""
    R, wire3 = _results()
    v = _verdicts(R, wire3)
    assert _find(v, "naive DDP (dlo) makes torch DDP's updates") == AGREES
    assert _find(v, "bucketed DDP (dlo) makes torch DDP's updates") == AGREES
    assert _find(v, "dlo's SyncBatchNorm computes BatchNorm over the global batch") == AGREES
    assert not any("(ours)" in k for k in v)
    (row,) = [c.row() for c in R4.claims(R, wire3) if c.claim.startswith("dlo's bucketed DDP (DataParallelBucket)")]
    assert "course's bar" in row["source"]  # 0.9x is this course's bar, not Li et al.'s
    R["throughput"]["naive DDP (dlo)"]["update gap"] = 0.02  # e.g. gradients summed, not averaged
    R["sync_bn_gap"]["running var"] = 0.5  # e.g. per-rank statistics
    v = _verdicts(R, wire3)
    assert _find(v, "naive DDP (dlo) makes") == DISAGREES and _find(v, "over the global batch") == DISAGREES


def _controls_worker(P, _log_dir):
    from dlo.distributed.ddp import DataParallelNaive
    from dlo.experiments import day4_controls as K

    class LocalOnly(DataParallelNaive):  # a planted fault: every rank keeps its own gradients
        def finish_gradient_synchronization(self):
            pass

    device = torch.device("cpu")
    versions = {"local only": LocalOnly, "naive DDP (dlo)": E.wrappers(P, device)["naive DDP (dlo)"],
                "torch DDP": E.wrappers(P, device)["torch DDP"]}
    E.FOLDERS["local only"] = "local_only"  # this rank process's copy
    times = E.step_times(P, device, versions)
    local_bn = K.convert_sync_batchnorm
    K.convert_sync_batchnorm = lambda m: m  # a planted fault: plain BatchNorm, per-rank statistics
    try:
        planted = K.sync_bn_gap(16, 3, device)
    finally:
        K.convert_sync_batchnorm = local_bn
    return {k: v["update gap"] for k, v in times.items() if "update gap" in v}, K.sync_bn_gap(16, 3, device), planted


def test_the_controls_hold_dlos_engines_and_catch_a_planted_fault(tmp_path):
    gaps, sync, planted = launch(_controls_worker, 2, dataclasses.replace(Day4Preset(), max_steps=5), tmp_path,
                                 timeout=120)[0]
    assert gaps["naive DDP (dlo)"] < 1e-6 and gaps["local only"] > 1e-3
    assert max(sync.values()) < 1e-5 and min(planted[k] for k in ("output", "running var")) > 1e-2


def test_one_seed_has_no_interval_but_a_divergence_is_definite():
    R, wire3 = _results(diverged=False, seeds=1)  # dlo.claims rules 1 and 2: paired seeds, >= 3 of them
    rows = {c.claim: c.row()["verdict"] for c in R4.claims(R, wire3, None)}
    for text in ("without normalisation layers", "converges like Adam", "freezing it costs nothing",
                 "local BatchNorm at"):
        assert _find(rows, text) == "not measurable here (one seed)", text
    R["onebit"]["1-bit Adam"]["losses"] = [[2.0, float("inf")]]  # one seed that diverged: not noise
    assert _find(_verdicts(R, wire3), "converges like Adam") == DISAGREES


def test_batchnorm_rows_pair_each_seed_on_the_shared_test_examples():
    R, _ = _results()
    rows = R4.batchnorm_rows(R["batchnorm"])
    assert [r["seed"] for r in rows] == [0, 1, 2] and rows[0]["local BatchNorm acc"] == 0.25
    assert rows[0]["sync - local [95%, McNemar]"].startswith("0.439 [")  # (353 - 128) / 512: discordant only


def test_exposed_communication_is_wall_clock_judged_against_the_cores(monkeypatch):
    R, wire3 = _results()
    monkeypatch.setattr(C, "cpu_cores", lambda: 2)  # 2 ranks x (compute + gloo's thread) + the kernel > 2 cores
    rows = {c.claim: c.row()["verdict"] for c in R4.claims(R, wire3, None)}
    assert _find(rows, "hides communication").startswith("not measurable here (2 rank(s) x 2 thread(s) + kernel")
    monkeypatch.setattr(C, "cpu_cores", lambda: 16)  # enough cores: the paired rounds decide
    assert _find(_verdicts(R, wire3), "hides communication") == AGREES
    ex = R["exposed"]
    ex["overlapped"], ex["after backward"] = ex["after backward"], ex["overlapped"]  # the overlap made it slower
    assert _find(_verdicts(R, wire3), "hides communication") == DISAGREES
    table = {r["quantity"]: r["ms [95%]"] for r in O4.exposed_rows(R["exposed"])}
    assert table["hidden by the overlap: after - overlapped"].startswith("-2")


def test_bucket_sweep_counts_buckets_and_prices_them_with_the_fit():
    from dlo.distributed.collectives import allreduce_time

    P = dataclasses.replace(Day4Preset(), d_in=64, hidden=64, layers=2)  # 3 linear layers, 2.6 to 16.6 KB each
    rows = O4.bucket_sweep(P, 2, alpha=1e-4, beta=1e-9, caps_mb=(0.001, 25.0))  # a bucket per layer, one
    small, big = rows
    n_bytes = 4 * sum(p.numel() for p in E.model(P, "cpu").parameters())
    assert big["all-reduces/step"] == 1 and small["all-reduces/step"] >= 3
    assert big["predicted comm ms"] == pytest.approx(1e3 * allreduce_time(n_bytes, 2, 1e-4, 1e-9))
    assert small["predicted comm ms"] > big["predicted comm ms"]  # more messages, more alphas, same bytes
    with pytest.raises(ValueError, match="bucket caps"):
        O4.bucket_sweep(P, 2, 1e-4, 1e-9, caps_mb=(0.0,))


def test_scaling_claim_on_gpus(monkeypatch):
    monkeypatch.setattr(C, "cpu_cores", lambda: 16)  # a GPU node: 4 ranks + the kernel fit its cores
    R, _ = _results(gpu=True)
    scale = {1: {"torch DDP": {"times_s": [0.100, 0.101, 0.099, 0.100, 0.102, 0.1]}},
             4: {"torch DDP": {"times_s": [0.104, 0.105, 0.103, 0.104, 0.106, 0.104]}}}
    assert _find(_verdicts(R, None, scale), "scales nearly linearly") == AGREES
