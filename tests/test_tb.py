"""dlo.tb: curves written with its writer (Run.writer's convention) read back and drawn as TensorBoard shows them."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import dlo.tb  # noqa: E402
from dlo.config import setup  # noqa: E402


def write_runs(root):
    for name, scale in (("sgd_b32/seed0", 1.0), ("adamw_b32/seed0", 0.5)):
        with dlo.tb.writer(root, name) as w:
            for step in range(5):
                w.add_scalar("loss", scale / (step + 1), step)
    with dlo.tb.writer(root, "lr_finder") as w:
        w.add_scalar("lr", 0.1, 0)
    assert dlo.tb.writer(root, "rank1", rank=1) is None and dlo.tb.writer(None, "no_log_dir") is None


def test_read_scalars_one_tag_overlays_every_run(tmp_path):
    write_runs(tmp_path)
    curves = dlo.tb.read_scalars(tmp_path, "loss")
    assert sorted(curves) == ["adamw_b32/seed0", "sgd_b32/seed0"]  # lr_finder has no 'loss'
    steps, values = curves["adamw_b32/seed0"]
    assert steps == [0, 1, 2, 3, 4] and values[0] == pytest.approx(0.5)


def test_a_rerun_replaces_its_own_curves_and_leaves_other_runs_alone(tmp_path, monkeypatch):
    """Each Validate re-ran the notebook into the same runs/ folder, and TensorBoard showed every step twice
    (issue 38); now a run folder's writer replaces the event files it got before the session began."""
    import os
    import time

    write_runs(tmp_path)
    (tmp_path / "sgd_b32" / "seed0" / "notes.txt").write_text("a student's file")
    for f in tmp_path.rglob("events.out.tfevents.*"):
        os.utime(f, (time.time() - 60, time.time() - 60))  # written by yesterday's session
    monkeypatch.delenv(dlo.tb.SESSION_ENV, raising=False)
    dlo.tb.start_session()  # today's (dlo.setup does this)
    with dlo.tb.writer(tmp_path, "sgd_b32/seed0") as w:  # the same configuration, run again
        for step in range(5):
            w.add_scalar("loss", 2.0, step)
    curves = dlo.tb.read_scalars(tmp_path, "loss")
    assert curves["sgd_b32/seed0"] == ([0, 1, 2, 3, 4], [2.0] * 5)
    assert curves["adamw_b32/seed0"][0] == [0, 1, 2, 3, 4]  # another run's curve untouched
    assert (tmp_path / "sgd_b32" / "seed0" / "notes.txt").exists()
    with dlo.tb.writer(tmp_path, "sgd_b32/seed0") as w:  # a second cell of the same session adds a tag
        w.add_scalar("lr", 0.1, 0)
    assert dlo.tb.read_scalars(tmp_path, "loss")["sgd_b32/seed0"] == ([0, 1, 2, 3, 4], [2.0] * 5)


def test_plot_scalars_draws_one_line_per_kept_run(tmp_path):
    write_runs(tmp_path)
    ax = dlo.tb.plot_scalars(tmp_path, "loss", keep=lambda name: name.startswith("sgd"))
    assert [line.get_label() for line in ax.get_lines()] == ["sgd_b32/seed0"]
    with pytest.raises(ValueError, match="no run"):
        dlo.tb.plot_scalars(tmp_path, "eval_acc")


def test_how_to_open_names_the_folder_and_the_tunnel(tmp_path):
    text = dlo.tb.how_to_open(tmp_path)
    assert f"--logdir {tmp_path.resolve()}" in text and "ssh -L 6006:localhost:6006" in text


def test_default_log_dir_does_not_repeat_the_day(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a notebook runs in its day folder
    run = setup("day1_optimizers", profile="tiny", device="cpu")
    assert run.log_dir == tmp_path.joinpath("runs").relative_to(tmp_path)
    assert "day1_optimizers" not in run.writer("sgd_b32").log_dir
