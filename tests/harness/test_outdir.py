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
    first = OwnedDir(tmp_path / "g")
    first.check()
    first.claim()
    (first.path / "scores.csv").write_text("old")
    first.record()
    again = OwnedDir(tmp_path / "g")
    again.check()
    again.claim()
    assert sorted(p.name for p in again.path.iterdir()) == [MARKER]
    again.discard()  # not created by this run: kept
    assert again.path.is_dir()


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
