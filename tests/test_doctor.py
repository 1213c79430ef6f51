"""dlo.doctor: one line per topic, FIX with the fix when something is missing, bad input refused first."""


from dlo import doctor
from dlo.cli import main as cli_main
from tests.data.folders import write_cifar_release, write_tokens

H100 = ("NVIDIA H100", 79.6, (9, 0))


def test_this_machine_reports_every_topic(capsys):
    assert cli_main(["doctor", "day4_ddp"]) in (0, 1)  # FIX lines are findings about the machine, not errors
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out][:5] == ["torch", "gpus", "triton", "bwrap", "data"]
    assert all(line.startswith(("ok ", "FIX")) for line in out)


def test_triton_compiles_for_the_gpu_found_and_says_when_it_cannot():
    ok, _, text = doctor.triton_line([H100])
    assert ok and "sm_90" in text
    ok, _, text = doctor.triton_line([("old", 4.0, (1, 0))])  # no such architecture: ptxas refuses
    assert not ok and "cannot compile for sm_10" in text


def test_plan_fits_four_h100_but_not_one_small_gpu():
    assert all(ok for ok, _, _ in doctor.plan_lines(["day4_ddp"], [H100] * 4))
    [(ok, topic, text)] = doctor.plan_lines(["day4_ddp"], [("small", 1.0, (8, 0))])
    assert not ok and topic == "plan day4_ddp" and "does not fit 1 x 1 GiB" in text


def test_data_folder_without_cifar_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_PROFILE", "tiny")
    ok, _, text = doctor.data_line(tmp_path)
    assert not ok and "cifar-10-batches-bin" in text
    (tmp_path / "cifar-10-batches-bin").mkdir()  # an empty folder is not CIFAR-10 (it was "ok")
    assert not doctor.data_line(tmp_path)[0]
    write_cifar_release(tmp_path)
    write_tokens(tmp_path)
    assert doctor.data_line(tmp_path)[0]


def test_bad_input_is_one_line_before_any_check(tmp_path, capsys):
    assert cli_main(["doctor", "day9_nothing"]) == 2
    assert cli_main(["doctor", "--data-dir", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 2
