"""slurm/search.sbatch on the two-node test cluster: `python -m dlo.tuning drive` submits a random search of
three trials as one 3-task array (sbatch --wait), each task writes its result, and the study's results are
those of the same search run in one process."""

import subprocess
import sys

import pytest

from dlo.tuning.search import Asha, random_search
from dlo.tuning.space import Space
from dlo.tuning.store import Study
from tests.slurm.conftest import REPO
from tests.tuning.toy import curve_trial

pytestmark = pytest.mark.slurm
CONFIG = """{"trial": "tests.tuning.toy:curve_trial", "seed": 2, "search": "random",
 "space": {"x": {"uniform": [0.0, 1.0]}}, "random": {"n": 3, "steps": 4}}"""


def test_a_three_task_array_runs_one_trial_per_task(slurm, tmp_path):
    (tmp_path / "study.json").write_text(CONFIG)
    study = tmp_path / "study"
    run = lambda *a: subprocess.run([sys.executable, "-m", "dlo.tuning", *map(str, a)], capture_output=True,  # noqa: E731
                                    text=True, cwd=REPO, env=slurm.env, timeout=600)
    assert run("init", study, tmp_path / "study.json").returncode == 0
    done = run("drive", study, "--sbatch", f"--output={tmp_path}/task-%a.out")
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("task-*.out")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert done.stdout.startswith("wave-0001.json: 3 jobs") and len(list(tmp_path.glob("task-*.out"))) == 3, logs
    assert all(f"array task {i} of job" in logs for i in range(3)), logs
    local = random_search(Study(tmp_path / "local"), curve_trial, Space({"x": {"uniform": [0.0, 1.0]}}), steps=4,
                          n=3, seed=2)
    assert [(r.trial, r.config, r.value) for r in Study(study).results()] == \
        [(r.trial, r.config, r.value) for r in local]


ASHA = """{"trial": "tests.tuning.toy:dying_curve_trial", "seed": 3, "search": "asha",
 "space": {"x": {"uniform": [0.0, 1.0]}}, "asha": {"min_steps": 1, "max_steps": 9, "eta": 3, "n_configs": 9}}"""


def test_asha_of_nine_trials_with_one_killed_resumes_to_the_local_best(slurm, tmp_path):
    (tmp_path / "study.json").write_text(ASHA)
    (tmp_path / "kill").write_text("a0002")
    study = tmp_path / "study"
    env = {**slurm.env, "DLO_TEST_KILL": str(tmp_path / "kill")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "dlo.tuning", *map(str, a)], capture_output=True,  # noqa: E731
                                    text=True, cwd=REPO, env=env, timeout=900)
    assert run("init", study, tmp_path / "study.json").returncode == 0
    done = run("drive", study, "--sbatch", f"--output={tmp_path}/task-%A-%a.out")
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("task-*.out")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert not (tmp_path / "kill").exists(), "the trial was never killed"
    waves = [line for line in done.stdout.splitlines() if line.startswith("wave-")]
    assert waves[0] == "wave-0001.json: 9 jobs" and len(waves) >= 3, done.stdout
    local = Study(tmp_path / "local")
    expected = Asha(Space({"x": {"uniform": [0.0, 1.0]}}), min_steps=1, max_steps=9, eta=3, n_configs=9,
                    seed=3).run(local, curve_trial, width=None)
    assert f"best: {expected.trial} {expected.config} loss {expected.value:.6g} at 9 steps" in done.stdout
