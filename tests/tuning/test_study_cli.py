"""`python -m dlo.tuning` and slurm/search.sbatch without SLURM: the driver submits each wave to a stand-in
`sbatch` that runs the array's tasks through the real batch script one by one; a task killed in the first wave
is handed out again, and the study ends with the best trial of the same search run in one process."""

import os
import subprocess
import sys
from pathlib import Path

from dlo.tuning.search import Asha
from dlo.tuning.space import Space
from dlo.tuning.store import Study
from tests.tuning.toy import curve_trial

REPO = Path(__file__).resolve().parents[2]
CONFIG = """\
trial: tests.tuning.toy:curve_trial
metric: loss
seed: 5
search: asha
space: {x: {uniform: [0.0, 1.0]}}
asha: {min_steps: 1, max_steps: 9, eta: 3, n_configs: 9}
"""
FAKE_SBATCH = """#!/bin/bash
# sbatch --wait --array=0-N [options] SCRIPT STUDY WAVE: the tasks one after another; task $KILL dies at once
array=""; args=()
for a in "$@"; do case $a in --array=*) array=${a#--array=} ;; --*) ;; *) args+=("$a") ;; esac; done
echo "$array" >> "$ARRAYS"
status=0
for i in $(seq 0 "${array#*-}"); do
    if [ -f "$KILL" ] && [ "$(cat "$KILL")" = "$i" ]; then rm "$KILL"; status=1; continue; fi
    SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_JOB_ID=7 bash "${args[0]}" "${args[1]}" "${args[2]}" >> "$LOG" 2>&1 || status=1
done
exit $status
"""


def _tuning(*args, env=None, check=True):
    done = subprocess.run([sys.executable, "-m", "dlo.tuning", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def test_driver_runs_waves_through_the_batch_script_and_survives_a_killed_task(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH)
    (fake / "sbatch").chmod(0o755)
    (tmp_path / "kill").write_text("4")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "DLO_ENV": sys.prefix, "KILL": str(tmp_path / "kill"),
           "LOG": str(tmp_path / "tasks.log"), "ARRAYS": str(tmp_path / "arrays")}
    (tmp_path / "study.yaml").write_text(CONFIG)
    study = tmp_path / "study"
    _tuning("init", study, tmp_path / "study.yaml")
    out = _tuning("drive", study, env=env).stdout
    arrays = (tmp_path / "arrays").read_text().split()
    assert arrays[0] == "0-8" and len(arrays) == 4, out        # 9 configs; then a0004 again with 2 promotions; ...
    assert "a0004 at 1 steps" in (tmp_path / "tasks.log").read_text()
    local = Study(tmp_path / "local")
    expected = Asha(Space({"x": {"uniform": [0.0, 1.0]}}), min_steps=1, max_steps=9, eta=3, n_configs=9,
                    seed=5).run(local, curve_trial, width=None)
    assert f"best: {expected.trial} {expected.config} loss {expected.value:.6g} at 9 steps" in out
    assert sorted((r.trial, r.steps) for r in Study(study).results()) == \
        sorted((r.trial, r.steps) for r in local.results())
    again = _tuning("drive", study, env=env).stdout            # a finished study: no wave, the same best
    assert not again.startswith("wave") and f"best: {expected.trial}" in again


def test_bad_config_and_index_are_refused_in_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text(CONFIG.replace("trial: tests.tuning.toy:curve_trial\n", ""))
    done = _tuning("init", tmp_path / "s", tmp_path / "bad.yaml", check=False)
    assert done.returncode == 2 and done.stderr.strip() == \
        "python -m dlo.tuning init: study config has no 'trial'; see python -m dlo.tuning --help"
    (tmp_path / "ok.yaml").write_text(CONFIG.replace("curve_trial", "no_such_trial"))
    done = _tuning("init", tmp_path / "s", tmp_path / "ok.yaml", check=False)
    assert done.returncode == 2 and "no_such_trial" in done.stderr and len(done.stderr.splitlines()) == 1
    (tmp_path / "ok.yaml").write_text(CONFIG)
    _tuning("init", tmp_path / "s", tmp_path / "ok.yaml")
    count, wave = _tuning("next", tmp_path / "s", "--width", 4).stdout.split()
    assert count == "4"
    done = _tuning("work", tmp_path / "s", wave, 4, check=False)
    assert done.returncode == 2 and "index 4 is outside 0..3" in done.stderr


def test_the_batch_script_parses_and_refuses_a_plain_job():
    subprocess.run(["bash", "-n", str(REPO / "slurm" / "search.sbatch")], check=True)
    done = subprocess.run(["bash", str(REPO / "slurm" / "search.sbatch"), "a", "b"], capture_output=True, text=True,
                          cwd=REPO, env={k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"})
    assert done.returncode == 2 and "not an array task" in done.stderr
