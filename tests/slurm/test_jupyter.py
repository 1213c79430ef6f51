"""slurm/jupyter.sbatch: JupyterLab starts on a node, its log gives one SSH tunnel command and one URL,
the server answers there with nbgrader's extension and the student settings, and scancel leaves nothing."""

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200, url
        return r.read().decode()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_lab_on_a_node_answers_then_scancel_leaves_nothing(slurm, tmp_path):
    log, notebooks, config = tmp_path / "lab.out", tmp_path / "nb", tmp_path / "jupyter-config"
    notebooks.mkdir()
    (notebooks / "hello.ipynb").write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                                       "nbformat_minor": 5}))
    env = {"NOTEBOOK_DIR": str(notebooks), "JUPYTER_CONFIG_DIR": str(config), "LOGIN_HOST": "login.example"}
    job = slurm.sbatch("--gres=gpu:1", f"--output={log}", "slurm/jupyter.sbatch", env=env)  # as its header says
    url = None
    for _ in range(300):  # the server's start (a hang guard)
        text = log.read_text() if log.exists() else ""
        found = re.search(r"^    (http://localhost:(\d+)/lab\?token=\w+)$", text, re.M)
        if found and "Jupyter Server" in text and "is running at" in text:
            url, port = found.group(1), found.group(2)
            break
        assert slurm.jobs(job)[0]["JobState"] in ("PENDING", "RUNNING"), text
        time.sleep(1)
    assert url, log.read_text()
    [tunnel] = re.findall(r"^    (ssh .*)$", text, re.M)
    assert tunnel == f"ssh -N -L {port}:127.0.0.1:{port} root@login.example"  # NodeAddr of n1/n2 here

    # through the tunnel's far end: the node's address and the port
    here = url.replace("localhost", "127.0.0.1")
    page = _get(here)
    page_config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                  page, re.S).group(1))
    assert "@jupyter/nbgrader" in [e["name"] for e in page_config["federated_extensions"]]  # nbgrader's lab extension
    assert "@jupyter/nbgrader:formgrader" in page_config["disabledExtensions"]  # the student settings: no Formgrader
    token = here.split("token=")[1]
    contents = json.loads(_get(f"http://127.0.0.1:{port}/api/contents?token={token}"))
    assert [c["name"] for c in contents["content"]] == ["hello.ipynb"]  # NOTEBOOK_DIR served
    server = [int(p) for p in re.findall(r"^server pid (\d+)$", text, re.M)]

    slurm.run("scancel", job)
    [state] = slurm.wait(job, timeout=120)
    assert state["JobState"] == "CANCELLED"
    assert server and not any(_alive(p) for p in server), "the server survived scancel"
    assert re.search(r", GPUs \d$", text, re.M), "the student's GPU, as SLURM gave it (slurm/env.sh's line)"
