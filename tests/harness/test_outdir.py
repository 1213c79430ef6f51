"""An output folder `dlo grade` owns: refused when it holds anything else, reused by deleting only
what the marker lists, and gone (with the parents it needed) when a run fails."""

from __future__ import annotations

import json

import pytest

from dlo.harness.outdir import MARKER, NotOurs, OwnedDir


def test_a_new_folder_is_claimed_and_recorded(tmp_path):
    out = OwnedDir(tmp_path / "runs" / "grade-1")
    out.check()
    out.claim()
    (out.path / "course").mkdir()
    (out.path / "course" / "a.txt").write_text("a")
    out.record()
    marker = json.loads((out.path / MARKER).read_text())
    assert marker["files"] == ["course/a.txt"] and marker["dirs"] == ["course"]


def test_a_failed_run_leaves_nothing(tmp_path):
    out = OwnedDir(tmp_path / "runs" / "grade-1")
    out.check()
    out.claim()
    (out.path / "partial.csv").write_text("x")
    out.discard()
    assert not list(tmp_path.iterdir())  # neither grade-1 nor the runs/ it created


def test_reuse_deletes_only_listed_files(tmp_path):
    part = lambda name: name == "part-1-of-2"  # noqa: E731 - a shard's part folder, kept beside a merge
    first = OwnedDir(tmp_path / "g", keep=part)
    first.check()
    first.claim()
    (first.path / "scores.csv").write_text("old")
    first.record()
    (first.path / "part-1-of-2").mkdir()
    (first.path / "part-1-of-2" / "scores.csv").write_text("a shard's")  # not listed: must survive
    again = OwnedDir(tmp_path / "g", keep=part)
    again.check()
    again.claim()
    assert sorted(p.name for p in again.path.iterdir()) == [MARKER, "part-1-of-2"]
    assert (again.path / "part-1-of-2" / "scores.csv").read_text() == "a shard's"
    again.discard()  # not created by this run: kept
    assert again.path.is_dir()


def test_a_run_killed_outright_can_be_resumed(tmp_path):
    """SIGKILL between two record()s: results written inside our own folders are not strangers."""
    first = OwnedDir(tmp_path / "g")
    first.check()
    first.claim()
    (first.path / "results").mkdir()
    first.record()
    (first.path / "results" / "ann").mkdir()
    (first.path / "results" / "ann" / "day1.json").write_text("{}")  # written, then the process was killed
    OwnedDir(tmp_path / "g").check()
    (first.path / "notes.txt").write_text("mine")                    # beside our folders: still refused
    with pytest.raises(NotOurs, match="notes.txt"):
        OwnedDir(tmp_path / "g").check()


@pytest.mark.parametrize("setup", ["foreign", "stranger", "file"])
def test_refusals_touch_nothing(tmp_path, setup):
    target = tmp_path / "g"
    if setup == "file":
        target.write_text("a file")
    else:
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        if setup == "stranger":
            (target / MARKER).write_text(json.dumps({"made_by": "dlo grade", "files": ["scores.csv"], "dirs": []}))
    before = sorted((str(p), p.is_file() and p.read_bytes()) for p in tmp_path.rglob("*"))
    with pytest.raises(NotOurs):
        OwnedDir(target).check()
    assert sorted((str(p), p.is_file() and p.read_bytes()) for p in tmp_path.rglob("*")) == before
