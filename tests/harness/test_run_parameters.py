"""`dlo run`: -p values typed by the parameters cell, presets validated before any kernel starts, and
a notebook whose kernel died reported as failed with the cell named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

import dlo
from dlo.config import resolve
from dlo.harness.run import BadParameter, build_parameters, typed_value
from dlo.registry import DAYS, PARAMETERS

REPO = Path(__file__).resolve().parents[2]
PARAMS = 'profile: str = "auto"\nmax_steps: int = 0\nlr: float = 0.1\nverbose: bool = False\nname: str = "x"\n'


def dlo_cli(*args, root=REPO, days=()):
    """`dlo ARGS` at `root`, a course whose days are `days` ($DLO_DAYS) when given, else the registry's."""
    return subprocess.run([sys.executable, "-m", "dlo.cli", "--root", str(root), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DLO_PROFILE": "tiny",
                                                       **({"DLO_DAYS": " ".join(days)} if days else {})})


@pytest.fixture
def nb(tmp_path):
    path = tmp_path / "day" / "day.ipynb"
    path.parent.mkdir()
    nbformat.write(new_notebook(cells=[new_code_cell("import math"),
                                       new_code_cell(PARAMS, metadata={"tags": ["parameters"]})],
                                metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}}), path)
    return path


def test_values_take_the_annotated_type(nb):
    params = build_parameters(nb, "tiny", [("max_steps", "7"), ("lr", "3"), ("verbose", "TRUE"), ("name", "12")])
    assert params == {"profile": "tiny", "max_steps": 7, "lr": 3.0, "verbose": True, "name": "12"}
    assert type(params["lr"]) is float and type(params["name"]) is str


@pytest.mark.parametrize("name,text,message", [
    ("max_steps", "notanumber", "max_steps is an int: 'notanumber' is not"),
    ("max_steps", "2.5", "max_steps is an int: '2.5' is not"),
    ("lr", "fast", "lr is a float: 'fast' is not"),
    ("verbose", "maybe", "verbose is a bool: 'maybe' is not (true or false)"),
])
def test_a_value_of_the_wrong_type_is_one_line(nb, name, text, message):
    with pytest.raises(BadParameter) as exc:
        build_parameters(nb, "tiny", [(name, text)])
    assert str(exc.value) == message


def test_untyped_values_keep_their_best_guess():
    assert typed_value("x", "3", None) == 3 and typed_value("x", "0.5", None) == 0.5
    assert typed_value("x", "true", None) is True and typed_value("x", "abc", None) == "abc"


@pytest.mark.parametrize("day,kwargs,match", [
    ("day1_optimizers", dict(profile="full", device="cpu", max_steps=2), r"max_steps=2: Day 1 needs >= 6 steps"),
    ("day3_checkpointing", dict(profile="tiny", max_steps=1), r"resume experiment needs >= 2 steps"),
    ("day1_optimizers", dict(profile="huge"), r"unknown profile 'huge'"),
    ("day4_ddp", dict(profile="tiny", world_size=-1), r"world_size must be >= 0"),
    ("day2_mixed_precision", dict(profile="tiny", max_steps=-3), r"max_steps must be >= 0"),
    ("day2_mixed_precision", dict(profile="tiny", data_dir="/nonexistent"), r"data_dir='/nonexistent' is not a folder"),
    ("day2_mixed_precision", dict(profile="tiny", lr_typo=1.0), r"Day2Preset has no field\(s\) \['lr_typo'\]"),
    ("day5_fsdp", dict(profile="tiny", device="cpu", world_size=100), r"world_size=100 is larger than the 32 rows"),
    ("day5_fsdp", dict(profile="tiny", weights_dir="/nonexistent"), r"weights_dir /nonexistent is not a folder"),
])
def test_impossible_combinations_are_refused(day, kwargs, match, tmp_path):
    """`resolve` refuses them (`dlo run` before a notebook starts), and `dlo.setup` the same way, with
    the same exception, before it makes a folder."""
    with pytest.raises(ValueError, match=match):
        resolve(day, **kwargs)
    with pytest.raises(ValueError, match=match):
        dlo.setup(day, log_dir=str(tmp_path / "logs"), **kwargs)
    assert not (tmp_path / "logs").exists()


def test_the_resolved_run():
    run = resolve("day5_fsdp", profile="tiny", device="cpu", weights_dir="", max_steps=3, lr=0.5)
    assert (run.world_size, run.backend, run.params) == (2, "gloo", {"weights_dir": ""})
    assert (run.preset.max_steps, run.preset.lr) == (3, 0.5)  # overrides reach the preset


def test_a_max_steps_override_carries_what_depends_on_it():
    resolve("day1_optimizers", profile="full", device="cpu", max_steps=20)  # warmup 200 -> 2
    from dlo.config import get_preset
    p = get_preset("day1_optimizers", "full", 20)
    assert (p.max_steps, p.warmup_steps, p.lr_finder_steps) == (20, 2, 10)
    p = get_preset("day3_checkpointing", "full", 10)
    assert 1 <= p.save_every <= p.interrupt_at < p.max_steps == 10


def test_cli_runs_the_days_preflight_before_any_kernel_starts(tmp_path):
    out, missing = tmp_path / "out", tmp_path / "no-weights"
    proc = dlo_cli("run", "day5_fsdp", "--out", str(out), "-p", "weights_dir", str(missing))
    assert proc.returncode == 2 and proc.stderr.strip() == f"dlo run: day5_fsdp: weights_dir {missing} is not a folder"
    assert not out.exists()


def test_cli_refuses_before_any_kernel_starts(tmp_path):
    out = tmp_path / "out"
    proc = dlo_cli("run", "day1_optimizers", "--out", str(out), "-p", "max_steps", "notanumber")
    assert proc.returncode == 2 and proc.stderr.strip() == "dlo run: day1_optimizers: max_steps is an int: " \
                                                          "'notanumber' is not"
    proc = dlo_cli("run", "day1_optimizers", "--profile", "full", "--out", str(out), "-p", "device", "cpu",
                   "-p", "max_steps", "2")
    assert proc.returncode == 2 and proc.stderr.startswith("dlo run: day1_optimizers: ")
    assert "max_steps=2: Day 1 needs >= 6 steps" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()  # nothing ran, nothing written
    proc = dlo_cli("run", "day1_optimizers", "--out", str(out), "-p", "lr_typo", "1")  # an unknown name: exit 2 too
    assert proc.returncode == 2 and proc.stderr.startswith("dlo run: day1_optimizers: no parameter 'lr_typo'; its "
                                                           "parameters are: ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.slow
def test_a_dead_kernel_is_a_failure_with_its_cell_named(tmp_path):
    root = tmp_path / "course"
    path = root / "solutions" / "crash" / "crash.ipynb"
    path.parent.mkdir(parents=True)
    cells = [new_code_cell("import os, signal"), new_code_cell(PARAMS, metadata={"tags": ["parameters"]}),
             new_code_cell("print('fine')"), new_code_cell("os.kill(os.getpid(), signal.SIGKILL)  # out of memory"),
             new_code_cell("print('never')")]
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}), path)
    proc = dlo_cli("run", "crash", "--out", str(tmp_path / "out"), root=root, days=("crash",))
    assert proc.returncode == 1
    assert "kernel died in cell 3 `os.kill(os.getpid(), signal.SIGKILL)  # out of memory`" in proc.stdout
    executed = json.loads((tmp_path / "out" / "crash" / "crash.ipynb").read_text())
    dead = next(c for c in executed["cells"] if "os.kill" in "".join(c["source"]))
    assert dead["metadata"]["papermill"]["status"] == "failed"
    assert dead["outputs"][-1]["ename"] == "DeadKernelError"


@pytest.mark.parametrize("day", list(DAYS))
def test_papermill_reads_every_parameter_of_every_day(day):
    # papermill skips a line with a second "=" (e.g. ">=" in its comment): -p could not set it
    import papermill

    declared = papermill.inspect_notebook(str(REPO / "solutions" / day / f"{day}.ipynb"))
    assert set(PARAMETERS) | set(DAYS[day].parameters) <= set(declared)
