"""`dlo setup student|instructor`: the role's Jupyter settings, written into one config folder, safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest

from dlo.cli import main
from dlo.harness import setup as S

LAB = "labconfig/page_config.json"
FORMGRADER = "jupyter_server_config.d/nbgrader.server_extensions.formgrader.json"


def disabled(cfg):
    return json.loads((cfg / LAB).read_text())["disabledExtensions"]


def test_student_hides_the_instructor_tools(tmp_path, capsys):
    cfg = tmp_path / "cfg"
    assert main(["setup", "student", "--config-dir", str(cfg)]) == 0
    off = disabled(cfg)
    assert off["@jupyter/nbgrader:create-assignment"] and off["@jupyter/nbgrader:formgrader"]
    assert not off["@jupyter/nbgrader:validate-assignment"] and not off["@jupyter/nbgrader:assignment-list"]
    ext = json.loads((cfg / FORMGRADER).read_text())["ServerApp"]["jpserver_extensions"]
    assert ext == {"nbgrader.server_extensions.formgrader": False}
    assert "c.Execute.timeout = 1800" in (cfg / "nbgrader_config.py").read_text()
    assert (cfg / "exchange").is_dir()
    out = capsys.readouterr().out
    assert "created" in out
    assert f"JUPYTER_CONFIG_DIR={cfg.resolve()}" in out  # a --config-dir says how Jupyter will find it


def test_idempotent_and_role_switch_rewrites_only_its_keys(tmp_path, capsys):
    cfg = tmp_path / "cfg"
    (cfg / "labconfig").mkdir(parents=True)
    (cfg / LAB).write_text(json.dumps({"disabledExtensions": {"other:plugin": True}, "theme": "dark"}))
    S.setup("student", cfg_dir=cfg)
    before = {p: p.read_text() for p in cfg.rglob("*") if p.is_file()}
    capsys.readouterr()
    S.setup("student", cfg_dir=cfg)
    assert {p: p.read_text() for p in cfg.rglob("*") if p.is_file()} == before
    assert "created" not in capsys.readouterr().out.split("exchange")[0]
    S.setup("instructor", cfg_dir=cfg)
    page = json.loads((cfg / LAB).read_text())
    assert page["theme"] == "dark" and page["disabledExtensions"]["other:plugin"] is True  # kept
    assert not any(v for k, v in page["disabledExtensions"].items() if k.startswith("@jupyter/nbgrader"))


def test_foreign_nbgrader_config_is_left_alone(tmp_path, capsys):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    mine = "c = get_config()\nc.Exchange.root = '/srv/exchange'\n"
    (cfg / "nbgrader_config.py").write_text(mine)
    assert S.setup("student", cfg_dir=cfg) == 2
    err = capsys.readouterr().err
    assert "not written by `dlo setup`" in err and "c.Execute.timeout = 1800" in err and "nothing was written" in err
    assert (cfg / "nbgrader_config.py").read_text() == mine
    assert not (cfg / "labconfig").exists()


def test_bad_input_is_one_line_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="cell-timeout"):
        S.setup("student", cfg_dir=tmp_path / "cfg", cell_timeout=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="not a folder"):
        S.setup("student", cfg_dir=tmp_path / "cfg", exchange=tmp_path / "file")
    assert not (tmp_path / "cfg").exists()


def test_nbgrader_reads_the_timeout_from_a_copied_day_folder(tmp_path):
    """nbgrader, started in a folder with no nbgrader_config.py, sees the setup's timeout (its default: 30 s)."""
    cfg, day = tmp_path / "cfg", tmp_path / "copy" / "day1"
    day.mkdir(parents=True)
    S.setup("student", cfg_dir=cfg)
    code = ("from nbgrader.apps import NbGrader\nfrom nbgrader.preprocessors import Execute\n"
            "app = NbGrader(); app.load_config_file(); print(Execute(config=app.config).timeout)")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg), "JUPYTER_PREFER_ENV_PATH": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=day, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "1800"


def test_normalise_metadata_is_what_the_kernel_reports():
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"display_name": "Python 3", "language": "python",
                                                           "name": "python3"}, "language_info": {"name": "python"}})
    assert S.normalise_metadata(nb) is True
    assert nb.metadata["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    assert nb.metadata["language_info"]["version"] == sys.version.split()[0]
    assert S.normalise_metadata(nb) is False
    assert "version" not in S.comparable_metadata(nb.metadata)["language_info"]


def test_validate_runs_what_the_grader_runs_not_the_experiments_after_it(tmp_path):
    """Validate ran a whole day, experiments included (Day 1: 20 min on a busy node, 34 s to grade): now
    the cells up to the last graded one, as `dlo grade`; each later code cell gets a note, and never runs."""
    from nbgrader.utils import compute_checksum

    cfg, day = tmp_path / "cfg", tmp_path / "day"
    day.mkdir()
    S.setup("student", cfg_dir=cfg)
    ran = day / "experiment-ran"

    def cell(source, **meta):
        c = nbformat.v4.new_code_cell(source)
        if meta:
            c.metadata["nbgrader"] = {"schema_version": 3, "locked": False, "solution": False, "grade": False,
                                      **meta}
            c.metadata["nbgrader"]["checksum"] = compute_checksum(c)
        return c
    nb = nbformat.v4.new_notebook(cells=[
        cell("def double(x):\n    return 2 * x", grade_id="ex1", solution=True),
        cell("assert double(3) == 6", grade_id="test_ex1", grade=True, points=1, locked=True),
        cell(f"open({str(ran)!r}, 'w').write('the experiment ran')"),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, day / "toy.ipynb")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg), "JUPYTER_PREFER_ENV_PATH": "0"}
    code = ("from nbgrader.apps import NbGrader\nfrom nbgrader.validator import Validator\n"
            "app = NbGrader(); app.load_config_file()\n"
            "import json; print(json.dumps(Validator(config=app.config).validate('toy.ipynb')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=day, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result.get("failed") and not result.get("changed"), result
    assert not ran.exists(), "an experiment after the last graded cell ran under Validate"
    assert "over TCP" not in out.stderr, out.stderr[-2000:]  # its kernel on Unix sockets (dlo.harness.kernels)


def test_the_terminal_keeps_the_course_environment(tmp_path):
    """A hub's JupyterLab terminal was a login shell: /etc/profile reset PATH, and jupyter, nbgrader and dlo
    were not found (issue 38). The terminal `dlo setup` configures, started with the server's environment,
    finds them."""
    cfg = tmp_path / "cfg"
    S.setup("student", cfg_dir=cfg)
    conf = json.loads((cfg / "jupyter_server_config.d" / "dlo-terminal.json").read_text())
    shell = conf["ServerApp"]["terminado_settings"]["shell_command"]
    assert "-l" not in shell and "--login" not in shell
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}
    found = subprocess.run([*shell, "-c", "command -v dlo nbgrader jupyter"], env=env, capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert [line.rsplit("/", 1)[0] for line in found.stdout.split()] == [f"{sys.prefix}/bin"] * 3, found
