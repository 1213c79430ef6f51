"""Fewer GPUs than the day's ranks (one GPU per student): `dlo.config.resolve` keeps the notebook's process
on the GPU at its profile and moves the day's launches to the tiny profile's gloo ranks on the CPU, never
to one rank that runs no collective; `Run.where()` says what runs where. The GPUs are mocked
(`torch.cuda.is_available`, `device_count`, `get_device_properties`) on the CPU build of torch, where
anything else that reaches CUDA raises "Torch not compiled with CUDA enabled": these tests would see it."""

import re
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

from dlo import claims as C
from dlo.config import get_preset, resolve
from dlo.experiments import day5_report, day7_report
from dlo.registry import DAYS

REPO = Path(__file__).resolve().parents[1]
MULTI_RANK = ("day4_ddp", "day5_fsdp", "day6_pipeline", "day7_tensor_parallel")


@pytest.fixture(autouse=True)
def _no_profile_from_the_environment(monkeypatch):
    for name in ("DLO_PROFILE", "DLO_DEVICE", "DLO_SMOKE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): n CUDA devices of 80 GiB as torch sees them (0: none)."""
    def mock(n: int):
        props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9, minor=0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: props)
    return mock


def where_rows(text: str) -> dict[str, list[str]]:
    """`Run.where()`'s table as {part: [ranks, backend, device, profile, sizes]}."""
    lines = text.splitlines()
    assert lines[2].startswith("-----")  # the title, the header, its rule
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines[3:6])}


@pytest.mark.parametrize("day", MULTI_RANK)
def test_one_gpu_never_shrinks_a_day_to_one_rank(day, gpus):
    """Before: world 1 on one GPU, so DDP, ZeRO/FSDP, the pipeline and TP ran no collective at all."""
    gpus(1)
    run = resolve(day, profile="full")
    assert run.world_size >= 2 and run.backend == "gloo"


@pytest.mark.parametrize("n_gpus", [1, 2, 8])
@pytest.mark.parametrize("day", MULTI_RANK)
def test_what_runs_where_at_the_full_profile(day, n_gpus, gpus):
    gpus(n_gpus)
    full, tiny = get_preset(day, "full"), get_preset(day, "tiny")
    run = resolve(day, profile="auto")  # auto: full, since a GPU is present
    assert (run.profile, run.device.type, run.preset) == ("full", "cuda", full)  # this process: the GPU, full
    ranks = run.ranks
    rows = where_rows(run.where())
    assert run.where().startswith(f"what runs where ({n_gpus} GPU{'s' * (n_gpus > 1)} visible):\n")
    assert rows["the notebook's own cells (run.preset)"] == ["1", "-", "cuda", "full", full.sizes()]
    if n_gpus >= full.world_size:  # the day's own ranks: one GPU each, the full sizes
        assert (ranks.world_size, ranks.backend, ranks.device, ranks.profile, ranks.why) == (
            full.world_size, "nccl", "cuda", "full", "")
        assert ranks.preset is run.preset
        assert rows["launches (run.ranks.preset)"] == [str(full.world_size), "nccl", "cuda, one GPU per rank", "full",
                                                       "as above"]
        assert "why:" not in run.where()
    else:  # fewer GPUs: the tiny profile's gloo ranks on the CPU
        assert (ranks.world_size, ranks.backend, ranks.device, ranks.profile, ranks.preset) == (
            tiny.world_size, "gloo", "cpu", "tiny", tiny)
        assert ranks.why == f"{full.world_size} NCCL ranks need {full.world_size} GPUs, {n_gpus} visible"
        assert rows["launches (run.ranks.preset)"] == [str(tiny.world_size), "gloo", "cpu", "tiny", tiny.sizes()]
        why = run.where().splitlines()[-1]
        assert why.startswith(f"why: {ranks.why}: the launches run on {tiny.world_size} CPU ranks at the tiny sizes")
        assert "not measurable here" in why
    assert rows["the exercises' checks"][:3] == ["2-3", "gloo", "cpu"]


def test_the_sizes_name_each_days_model(gpus):
    gpus(1)
    assert "ResNet-18 (width 64) on 224x224 images" in resolve("day4_ddp").where()
    assert "MLP 256-256x4" in resolve("day4_ddp").where()
    text = resolve("day7_tensor_parallel").where()
    assert "Llama llama3.2-3b, TP degrees (2, 4, 8)" in text and "Llama tiny, TP degrees (1, 2, 4)" in text


@pytest.mark.parametrize("day", MULTI_RANK)
def test_an_explicit_world_size_above_the_gpus_is_refused_or_cpu_ranks(day, gpus):
    gpus(2)
    full = get_preset(day, "full")
    with pytest.raises(ValueError, match=rf"world_size={full.world_size}\b") as e:  # pick_backend's one line
        resolve(day, profile="full", world_size=full.world_size)
    assert "\n" not in str(e.value)
    run = resolve(day, profile="full", device="cpu", world_size=full.world_size)  # asked for CPU ranks: as asked
    assert (run.world_size, run.backend, run.ranks.device, run.ranks.preset, run.ranks.why) == (
        full.world_size, "gloo", "cpu", full, "")
    run = resolve(day, profile="full", world_size=2)  # as many as there are GPUs: the full sizes on them
    assert (run.world_size, run.backend, run.ranks.device, run.ranks.preset) == (2, "nccl", "cuda", run.preset)


@pytest.mark.parametrize("day", MULTI_RANK)
def test_without_a_gpu_nothing_changes(day, gpus):
    gpus(0)
    run = resolve(day)  # tiny on the CPU
    tiny = get_preset(day, "tiny")
    assert (run.profile, run.device.type, run.world_size, run.backend) == ("tiny", "cpu", tiny.world_size, "gloo")
    assert (run.ranks.device, run.ranks.profile, run.ranks.why) == ("cpu", "tiny", "")
    assert run.ranks.preset is run.preset
    assert "as above" in run.where() and "why:" not in run.where()
    run = resolve(day, profile="full", device="cpu")  # the full sizes on CPU ranks, as asked
    assert (run.world_size, run.ranks.preset, run.ranks.profile) == (get_preset(day, "full").world_size, run.preset,
                                                                     "full")


def test_a_tiny_profile_on_one_gpu_runs_its_ranks_on_the_cpu(gpus):
    gpus(1)
    run = resolve("day7_tensor_parallel", profile="tiny")
    assert (run.device.type, run.world_size, run.backend, run.ranks.device) == ("cuda", 4, "gloo", "cpu")


def test_smoke_steps_and_overrides_reach_the_cpu_ranks_preset(gpus, monkeypatch):
    gpus(1)
    run = resolve("day6_pipeline", profile="full", max_steps=2)
    assert run.preset.reps == 2 and run.ranks.preset == get_preset("day6_pipeline", "tiny", 2)
    run = resolve("day4_ddp", profile="full", lr=0.5)
    assert run.preset.lr == run.ranks.preset.lr == 0.5
    monkeypatch.setenv("DLO_SMOKE", "1")
    run = resolve("day7_tensor_parallel")
    assert run.preset == DAYS["day7_tensor_parallel"].presets["full"].smoke()
    assert run.ranks.preset == DAYS["day7_tensor_parallel"].presets["tiny"].smoke() and run.world_size == 2


def test_setup_prints_what_runs_where_on_days_that_launch_ranks(gpus, tmp_path, capsys):
    import dlo

    gpus(1)
    run = dlo.setup("day6_pipeline", log_dir=str(tmp_path / "runs"))
    assert run.where() in capsys.readouterr().out
    dlo.setup("day1_optimizers", profile="tiny", device="cpu", log_dir=str(tmp_path / "runs"))
    assert "what runs where" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- Day 5's preflight

def test_day5_plans_the_gpus_only_when_its_ranks_are_on_them(gpus, monkeypatch):
    planned = []
    real = day5_report.plan
    monkeypatch.setattr(day5_report, "plan", lambda P, **kw: planned.append((P, kw)) or real(P, **kw))
    gpus(1)
    resolve("day5_fsdp", profile="full")  # CPU ranks: no GPU of the launch to plan
    assert planned == []
    gpus(8)
    run = resolve("day5_fsdp", profile="full")
    assert planned == [(run.ranks.preset, {"gpus": 8, "gpu_mem_gb": 80.0})]


def test_day5_refuses_weights_for_a_model_its_cpu_ranks_do_not_train(gpus, tmp_path):
    gpus(1)
    with pytest.raises(ValueError) as e:
        resolve("day5_fsdp", profile="full", weights_dir=str(tmp_path))
    assert str(e.value) == ("weights_dir is for llama3.2-3b, but the launch trains tiny: 8 NCCL ranks need 8 GPUs, "
                            "1 visible; leave weights_dir empty here")


# ----------------------------------------------------------------------------- the notebooks and their claims

def test_a_claims_table_of_cpu_ranks_says_so(gpus):
    """What the notebooks hand the reports is where the ranks ran (`run.ranks.device`), never the notebook's
    GPU: an MFU timed on CPU ranks is 'not measurable here' with the reason."""
    gpus(1)
    run = resolve("day7_tensor_parallel", profile="full")
    steps = [{"t": 2, "mfu": 0.4, "step_s": [1.0, 1.1, 1.2, 1.0]}]
    rows = day7_report.megatron_claims(steps, run.ranks.device, world_size=run.world_size)
    row = next(r for r in rows if "TP=2" in r.claim)
    assert row.verdict == C.NOT_MEASURABLE and row.reason == "GPU claim timed on cpu"
    row = next(r for r in rows if "TP=4" in r.claim)  # no t = 4 run: said so, not blamed on a missing run
    assert row.reason == "CPU run: no peak FLOP/s to compare with"
    train = {"mfu": None, "times_s": []}
    rows = day5_report.training_claims(train, {"ZeRO-3 (dlo)": [1.0], "FSDP2 (torch)": [1.0]}, run.ranks.device)
    assert rows[1].verdict == C.NOT_MEASURABLE and rows[1].reason == "no GPU peak here (cpu)"


def _launch_cells(day: str) -> list[str]:
    """The code cells from the day's main launch on: the ones that read its results R."""
    nb = nbformat.read(REPO / "solutions" / day / f"{day}.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, s in enumerate(code) if re.search(r"^R = dlo\.distributed\.launch\(", s, re.M))
    return code[first:]


@pytest.mark.parametrize("day", MULTI_RANK)
def test_the_notebooks_read_their_launches_with_the_ranks_preset_and_device(day):
    """Before: the launches took `P = run.preset` (the full sizes) and their claims `run.device` (the GPU), so a
    launch on CPU ranks would have been judged as a GPU run. Every launch cell passes `PR = run.ranks.preset`."""
    for src in _launch_cells(day):
        if "R[" not in src and "launch(" not in src:
            continue  # a cell of its own (Day 7's async TP, fixed gloo ranks; the full plan)
        used = re.findall(r"\brun\.(?:device|preset|profile)\b|\bP\b", src)
        assert not used, f"{day}: a cell that reads the launch uses {used}:\n{src}"
    nb = nbformat.read(REPO / "solutions" / day / f"{day}.ipynb", as_version=4)
    launches = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
                if "dlo.distributed.launch(" in line]
    assert launches and all("PR" in line for line in launches), launches


@pytest.mark.slow
def test_the_launches_run_on_cpu_ranks_from_the_full_profile_path(gpus, monkeypatch, tmp_path):
    """Each day's experiment launch, as its notebook makes it at the full profile on one (mocked) GPU, runs
    its collectives on the CPU ranks `resolve` chose (smoke: the fewest steps)."""
    from dlo.distributed import launch
    from dlo.experiments import day4, day5, day6, day7

    monkeypatch.setenv("DLO_SMOKE", "1")
    gpus(1)
    runs = {day: resolve(day, profile="full") for day in MULTI_RANK}
    gpus(0)  # the ranks are CPU processes; nothing below may need the mocked GPU
    calls = {"day4_ddp": (day4.run_all, tmp_path), "day5_fsdp": (day5.run_all, tmp_path, None, ""),
             "day6_pipeline": (day6.run_all,), "day7_tensor_parallel": (day7.run_all,)}
    for day, (fn, *rest) in calls.items():
        run = runs[day]
        R = launch(fn, run.world_size, run.ranks.preset, *rest, backend=run.backend, timeout=300)[0]
        assert (R["world"], R["device"]) == (run.world_size, "cpu") and run.world_size >= 2, day


def test_under_a_launcher_the_jobs_ranks_are_the_launch_not_cpu_stand_ins(gpus, monkeypatch):
    """Under srun the ranks exist already: the job's world (8 ranks of two 4-GPU nodes, each rank's own GPU)
    is the launch, not the preset's 4, and never the CPU ranks that stand in for GPUs a machine lacks."""
    gpus(4)
    for name, value in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                        "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
                        "SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}.items():
        monkeypatch.setenv(name, value)
    run = resolve("day4_ddp", profile="full")
    assert (run.world_size, run.backend, run.ranks.why) == (8, "nccl", "")
    assert run.ranks.preset is run.preset
