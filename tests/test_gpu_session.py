"""bench/gpu_session.py, the GPU session's runner, on stand-in steps (a line of Python each, no GPU, seconds):
the steps start in their order, each is written to the session's JSON as soon as it ends (a run cut off
keeps them), a failing step is recorded and the next still runs, a step past its timeout is stopped, one
that no longer fits the session's budget is skipped and says so, an exclusive step runs alone, and a
second session resumes the first's unfinished steps only. The real steps run in the dry run
(`bash bench/gpu_check.sh --cpu`) and on a GPU node."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.claims import SHARE_ENV

BENCH = Path(__file__).resolve().parents[1] / "bench"
_spec = importlib.util.spec_from_file_location("gpu_session", BENCH / "gpu_session.py")
gs = sys.modules["gpu_session"] = importlib.util.module_from_spec(_spec)  # a script of bench/, not a module of dlo
_spec.loader.exec_module(gs)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", "import json, os, sys, time, glob\n" + code]


def session(tmp_path: Path, steps, *options: str) -> dict:
    out = tmp_path / "out"
    rc = gs.main(["--cpu", "--out", str(out), "--work", str(tmp_path / "work"), *options], steps=steps)
    data = json.loads(next(out.glob("*_cpu_gpu-session.json")).read_text())
    data["rc"] = rc
    data["by_name"] = {s["name"]: s for s in data["steps"]}
    return data


def test_steps_in_order_each_recorded_as_it_ends_failures_timeouts_and_budget(tmp_path):
    out = tmp_path / "out"
    earlier_recorded = (f"d = json.load(open(glob.glob('{out}/*_gpu-session.json')[0]))\n"
                        "s = {r['name']: r['status'] for r in d['steps']}\n"
                        "sys.exit(0 if s['measures'] == 'ok' and s['breaks'] == 'failed' and s['after'] == 'running'"
                        " and s['late'] == 'pending' else 1)")
    steps = [
        gs.Step("measures", "numbers", 0.1, 30, cmd=py("json.dump({'mfu': 0.41, 'peak': 7}, "
                                                       "open(os.environ['DLO_STEP_RESULT'], 'w'))")),
        gs.Step("breaks", "a failure", 0.1, 30, cmd=py("print('the cause, in its log')\n"
                                                       "json.dump({'failure': 'no CUDA'}, "
                                                       "open(os.environ['DLO_STEP_RESULT'], 'w'))\nsys.exit(3)")),
        gs.Step("after", "runs after a failure", 0.1, 30, cmd=py(earlier_recorded)),
        gs.Step("hangs", "stopped at its timeout", 0.1, 0.5, cmd=py("time.sleep(60)")),
        gs.Step("late", "does not fit", 10_000, 30, cmd=py("pass")),
        gs.Step("gpu", "CUDA only", 0.1, 30, cpu=False, cmd=py("pass")),
        gs.Step("last", "still runs", 0.1, 30, cmd=py("pass")),
    ]
    data = session(tmp_path, steps, "--budget", "60")
    s = data["by_name"]
    assert [s[n]["status"] for n in s] == ["ok", "failed", "ok", "timeout", "skipped", "skipped", "ok"]
    assert s["measures"]["numbers"] == {"mfu": 0.41, "peak": 7}
    assert s["breaks"]["reason"] == "no CUDA" and s["breaks"]["rc"] == 3 and "the cause" in s["breaks"]["log_tail"]
    assert "out of time" in s["late"]["reason"] and s["gpu"]["reason"].startswith("no GPU")
    assert s["hangs"]["seconds"] < 30 and "stopped after" in s["hangs"]["reason"]
    started = [s[n]["started_s"] for n in ("measures", "breaks", "after", "hangs", "last")]
    assert started == sorted(started)
    assert data["session"]["finished"] and data["rc"] == 1 and data["summary"] == {"ok": 3, "failed": 1, "timeout": 1,
                                                                                   "skipped": 2}
    logs = next((tmp_path / "out").glob("*_gpu-session-logs.txt")).read_text()
    assert "== breaks: failed" in logs and "the cause, in its log" in logs


def test_jobs_side_by_side_and_an_exclusive_step_alone(tmp_path):
    nap = py("time.sleep(0.8)")
    steps = [gs.Step("a", "", 0.1, 30, cmd=nap), gs.Step("b", "", 0.1, 30, cmd=nap),
             gs.Step("alone", "", 0.1, 30, cmd=nap, exclusive=True), gs.Step("c", "", 0.1, 30, cmd=nap),
             gs.Step("d", "", 0.1, 30, cmd=py(f"print(os.environ['{gs.SHARE_ENV}'])"))]
    s = session(tmp_path, steps, "--budget", "60", "--jobs", "2")["by_name"]
    assert s["a"]["beside"] == ["b"] and s["b"]["beside"] == ["a"] and s["alone"]["beside"] == []
    assert s["alone"]["started_s"] >= max(s["a"]["started_s"], s["b"]["started_s"]) + 0.7  # waited for both
    assert s["c"]["started_s"] >= s["alone"]["started_s"] + 0.7 and s["c"]["beside"] == ["d"]
    assert s["d"]["log_tail"].splitlines()[-1].isdigit()  # its share of the cores
    assert gs.SHARE_ENV == SHARE_ENV


def test_a_second_session_runs_only_what_the_first_did_not_finish(tmp_path):
    marker = tmp_path / "ran"
    mark = py(f"open('{marker}', 'a').write(sys.argv[0] + os.environ['DLO_STEP_RESULT'] + '\\n')")
    steps = [gs.Step("done", "", 0.1, 30, cmd=mark), gs.Step("broke", "", 0.1, 30, cmd=py("sys.exit(1)")),
             gs.Step("cut", "", 10_000, 30, cmd=mark)]
    first = session(tmp_path / "1", steps, "--budget", "60")
    assert [r["status"] for r in first["steps"]] == ["ok", "failed", "skipped"]
    old = next((tmp_path / "1" / "out").glob("*_gpu-session.json"))
    steps[2].budget = 0.1
    second = session(tmp_path / "2", steps, "--budget", "60", "--resume", str(old))
    assert [r["status"] for r in second["steps"]] == ["ok", "failed", "ok"]
    assert second["by_name"]["done"]["from"] == old.name and "from" not in second["by_name"]["cut"]
    assert len(marker.read_text().splitlines()) == 2  # "done" ran once, in the first session


def test_the_entry_point_lists_its_steps_and_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--list"], capture_output=True, text=True, timeout=120,
                          cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[0] for ln in proc.stdout.splitlines()] == [s.name for s in gs.STEPS]
    names = [s.name for s in gs.STEPS]
    assert names[:5] == ["env", "doctor", "launch", "sandbox", "day5_3b"] and len(names) == len(set(names))
    assert sum(1 for n in names if n.startswith("smoke_")) == len(gs.DAYS_BY_RISK)
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_session.py"), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={"PATH": str(tmp_path)})  # no nvidia-smi on this PATH
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gpu_session: no GPU here (nvidia-smi not found): --cpu runs the dry run"]
    with pytest.raises(SystemExit, match="no step nope"):
        gs.main(["--cpu", "--only", "nope", "--out", str(tmp_path)])
