"""dlo.tracking: a run's parameters, metrics, code version and environment come back from its JSON-lines
file; a killed run's partial line is skipped; a run is never overwritten; the table ranks runs by a metric."""

import subprocess

import pytest

from dlo.errors import BadInput
from dlo.tracking import Run, code_version, format_table, read_run, runs_table


def test_round_trip_and_table(tmp_path):
    for name, lr, losses in (("a", 0.1, [2.0, 1.5]), ("b", 0.01, [2.0, 0.9, 1.1])):
        with Run(tmp_path, name, params={"lr": lr, "width": 8}) as run:
            for step, loss in enumerate(losses):
                run.log(step, loss=loss, acc=1 - loss / 3)
    run = read_run(tmp_path / "b.jsonl")
    assert run["params"] == {"lr": 0.01, "width": 8} and run["status"] == "finished"
    assert run["metrics"]["loss"] == [(0, 2.0), (1, 0.9), (2, 1.1)]
    assert run["env"]["torch"] and run["env"]["python"] and "commit" in run["code"]
    rows = runs_table(tmp_path, "loss")
    assert [(r["name"], r["best loss"], r["last loss"], r["lr"]) for r in rows] == [("b", 0.9, 1.1, 0.01),
                                                                                  ("a", 1.5, 1.5, 0.1)]
    text = format_table(rows)
    assert text.splitlines()[0].split()[:3] == ["name", "status", "commit"] and "0.9" in text


def test_a_failed_and_a_killed_run(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with Run(tmp_path, "boom") as run:
            run.log(0, loss=1.0)
            raise ZeroDivisionError
    assert read_run(tmp_path / "boom.jsonl")["status"] == "failed: ZeroDivisionError"
    killed = Run(tmp_path, "killed")
    killed.log(0, loss=3.0)
    with open(killed.path, "a") as f:
        f.write('{"event": "metrics", "step": 1, "metr')             # the kill came mid-write
    with pytest.warns(UserWarning, match="partial last line"):
        run = read_run(killed.path)
    assert run["status"] == "running" and run["metrics"]["loss"] == [(0, 3.0)]
    with pytest.raises(BadInput, match="never overwritten"):
        Run(tmp_path, "killed")
    with pytest.raises(BadInput, match="plain file name"):
        Run(tmp_path, "../x")


def test_code_version_names_the_commit_and_uncommitted_changes(tmp_path):
    assert code_version(tmp_path) == {"commit": None, "dirty": None}
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "train.py").write_text("lr = 0.1\n")
    git("add", "train.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert code_version(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "train.py").write_text("lr = 0.2\n")
    assert code_version(tmp_path)["dirty"] is True
