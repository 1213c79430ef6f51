"""What each day reads from data_dir, checked in one place: a data_dir given but wrong is refused in one
line by `dlo.config.resolve` (so by `dlo.setup` and by `dlo run` before any cell), never a silent
fallback; `dlo data check` and `dlo doctor --data-dir` say the same, one line each."""

import re

import pytest

import dlo
from dlo import doctor
from dlo.cli import main as cli_main
from dlo.config import resolve
from dlo.data import check
from dlo.data.layout import KINDS, DataError
from dlo.registry import DAYS
from tests.data.folders import write_cifar_python, write_cifar_release, write_tokens
from tests.harness.test_run_parameters import REPO, dlo_cli

IMAGE_DAYS = ["day1_optimizers", "day2_mixed_precision", "day8_quantization_pruning", "day11_learning_faster"]


def _cifar_loaders(short: str) -> list[str]:
    """`module.fn(` for each function of a day's experiments modules that takes `(P, data_dir` when one of those
    modules loads CIFAR-10 (`cifar10(data_dir`, Day 11's `tasks`) or hands `data_dir` to a CIFAR trial
    (`dlo.tuning.trials`: Day 11's searches): `day11.tasks(P, run.data_dir, ...)` in a notebook reads CIFAR-10."""
    paths = sorted((REPO / "lib" / "dlo" / "experiments").glob(f"{short}*.py"))
    texts = {p.stem: p.read_text() for p in paths}
    if not any("cifar10(data_dir" in t or '"data_dir": data_dir' in t for t in texts.values()):
        return []
    return [f"{stem}.{fn}(" for stem, t in texts.items() for fn in re.findall(r"^def (\w+)\(P, data_dir", t, re.M)]


def test_the_registry_names_what_each_notebook_reads():
    """DaySpec.data is the one place: the notebooks that load CIFAR-10 from run.data_dir (themselves, or through
    a function of their experiments that calls cifar10(data_dir)) are exactly the "cifar10" days, the one that
    hands run.data_dir to its ranks (token_batches) the "tokens" day."""
    for name, spec in DAYS.items():
        source = (REPO / "solutions" / name / f"{name}.ipynb").read_text()
        assert set(spec.data) <= set(KINDS)
        loaders = ["dlo.data.cifar10(run.data_dir", *(f"{f}P, run.data_dir" for f in _cifar_loaders(spec.short))]
        cifar = any(x in source for x in loaders)
        assert ("cifar10",) == spec.data if cifar else "cifar10" not in spec.data, name
        rest = source
        for x in loaders:
            rest = rest.replace(x, "")
        reads = re.search(r"run\.data_dir(?!\s*=)", rest) is not None
        assert reads == ("tokens" in spec.data), name


def test_python_version_of_cifar_is_refused_by_resolve_and_setup(tmp_path):
    write_cifar_python(tmp_path)
    for day in IMAGE_DAYS:
        with pytest.raises(DataError, match=r"holds cifar-10-batches-py, CIFAR-10's Python version; the course "
                                            r"reads the binary version: on a login node \(compute nodes are offline\)"
                                            r" download https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"):
            resolve(day, profile="tiny", data_dir=str(tmp_path))
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        dlo.setup("day1_optimizers", profile="tiny", data_dir=str(tmp_path), log_dir=str(tmp_path / "logs"))
    assert not (tmp_path / "logs").exists()
    resolve("day4_ddp", profile="tiny", data_dir=str(tmp_path))  # a day that reads nothing from it: any folder


def test_every_wrong_cifar_folder_is_one_line_that_says_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty has no cifar-10-batches-bin/ .*tar xzf cifar-10-binary.tar.gz -C"):
        check.check_kind("cifar10", tmp_path / "empty", None)
    (tmp_path / "tar").mkdir()
    (tmp_path / "tar" / "cifar-10-binary.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match="holds cifar-10-binary.tar.gz, not unpacked: tar xzf"):
        check.check_kind("cifar10", tmp_path / "tar", None)
    folder = write_cifar_release(tmp_path / "short", short="data_batch_3.bin")
    with pytest.raises(DataError, match=r"data_batch_3.bin has 30,726,927 bytes, not 30,730,000 \(10000 records"):
        check.check_kind("cifar10", tmp_path / "short", None)
    (folder / "test_batch.bin").unlink()
    with pytest.raises(DataError, match=r"lacks test_batch.bin of CIFAR-10's binary version"):
        check.check_kind("cifar10", tmp_path / "short", None)
    write_cifar_release(tmp_path / "good")
    assert "50,000 training and 10,000 test images" in check.check_kind("cifar10", tmp_path / "good", None)
    for day in IMAGE_DAYS:
        assert resolve(day, profile="tiny", data_dir=str(tmp_path / "good")).data_dir == tmp_path / "good"


def test_day5_without_tokens_is_refused_not_synthetic(tmp_path):
    with pytest.raises(DataError, match=r"has no tokens.npy \(Day 5's token ids\): make it on a login node .* with "
                                        r"`dlo data tokens CORPUS --tokenizer tokenizer.json --out"):
        resolve("day5_fsdp", profile="tiny", data_dir=str(tmp_path))
    write_tokens(tmp_path, vocab=300)  # ids up to 299: not the tiny Llama's 256
    with pytest.raises(DataError, match=r"ids in \[0, 299\], outside the vocabulary of tiny \[0, 256\)"):
        resolve("day5_fsdp", profile="tiny", data_dir=str(tmp_path))
    write_tokens(tmp_path, n=40)  # one window of the tiny preset: 64 + 2 tokens
    with pytest.raises(DataError, match="holds 40 tokens, fewer than the 66"):
        resolve("day5_fsdp", profile="tiny", data_dir=str(tmp_path))
    write_tokens(tmp_path)
    assert resolve("day5_fsdp", profile="tiny", data_dir=str(tmp_path)).data_dir == tmp_path


def test_run_refuses_the_python_version_before_any_cell(tmp_path):
    """The quality bar: a data_dir holding cifar-10-batches-py makes `dlo run day1_optimizers` exit 2 with
    one line before any cell runs."""
    write_cifar_python(tmp_path / "data")
    out = tmp_path / "out"
    proc = dlo_cli("run", "day1_optimizers", "--out", str(out), "-p", "data_dir", str(tmp_path / "data"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("dlo run: day1_optimizers: ") and "cifar-10-batches-py" in proc.stderr
    assert "binary version" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_data_check_says_ok_or_fix_per_day(tmp_path, capsys):
    write_cifar_release(tmp_path)
    assert cli_main(["data", "check", str(tmp_path), "--profile", "tiny"]) == 1  # no tokens.npy for Day 5
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["FIX" if d == "day5_fsdp" else "ok", d] for d in DAYS]
    assert "reads nothing from data_dir" in out[2] and "has no tokens.npy" in out[4]
    write_tokens(tmp_path)
    assert cli_main(["data", "check", str(tmp_path), "day5_fsdp", "day1_optimizers", "--profile", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "1,000 token ids (uint16) in [0, 256) for tiny" in out[0]
    assert cli_main(["data", "check", str(tmp_path), "day5_fsdp"]) == 1  # the full profile's windows: 8192 tokens
    window = DAYS["day5_fsdp"].presets["full"].seq_len + 2
    assert f"holds 1000 tokens, fewer than the {window}" in capsys.readouterr().out


def test_data_check_bad_input_is_one_line(tmp_path, capsys):
    assert cli_main(["data", "check", str(tmp_path / "missing")]) == 2
    assert cli_main(["data", "check", str(tmp_path), "day9"]) == 2
    assert cli_main(["data", "check", str(tmp_path), "--weights-dir", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 3
    assert captured.err.splitlines()[0] == f"dlo data: DIR {tmp_path / 'missing'} is not a folder"


def test_doctor_reports_the_python_version_and_missing_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_PROFILE", "tiny")
    write_cifar_python(tmp_path)
    ok, topic, text = doctor.data_line(tmp_path)
    assert not ok and topic == "data"
    assert text.startswith(", ".join(IMAGE_DAYS) + ": ")
    assert "CIFAR-10's Python version" in text and "day5_fsdp: " in text and "has no tokens.npy" in text
    ok, _, text = doctor.data_line(tmp_path, ["day5_fsdp"])  # only the days asked for
    assert not ok and text.startswith("day5_fsdp: ") and "cifar" not in text
    write_cifar_release(tmp_path)
    write_tokens(tmp_path)
    ok, _, text = doctor.data_line(tmp_path)
    readers = "day1_optimizers, day2_mixed_precision, day5_fsdp, day8_quantization_pruning, day11_learning_faster"
    assert ok and f"what {readers} read(s)" in text
    assert doctor.data_line(None) == (True, "data", "no --data-dir: notebooks use deterministic synthetic data "
                                                    "(data_dir \"\")")


def test_doctor_checks_weights_when_asked(tmp_path, capsys):
    assert cli_main(["doctor", "day4_ddp", "--weights-dir", str(tmp_path)]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[1] == "data")
    assert line.startswith("FIX") and f"weights: {tmp_path} has no config.json" in line
    assert cli_main(["doctor", "--weights-dir", str(tmp_path / "missing")]) == 2
