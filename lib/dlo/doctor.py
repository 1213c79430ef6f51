"""`dlo doctor [DAY ...] [--data-dir DIR]`: what this machine (a cluster node, a laptop) offers the
course, one line each, `ok` or `FIX` with the fix: torch and its CUDA/NCCL (FIX where nvidia-smi lists a GPU
that torch cannot use: a CPU build, a driver too old for the CUDA build, or torch's own reason), the GPUs and
their memory, Triton and whether it compiles for the GPU present, whether Triton's JIT can build its launcher
here (compiler, Python headers, libcuda), bwrap (the grading sandbox), the data folder, and whether each day's
`dlo plan` fits the GPUs found. Exit status 1 when a line says FIX, 2 on bad input.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dlo.errors import BadInput

Line = tuple[bool, str, str]  # (ok, topic, what was found or the fix)


def torch_line() -> Line:
    import torch

    from dlo.nvidia import unused_gpu

    if not torch.cuda.is_available():
        reason = unused_gpu(ask_torch=True)  # doctor is a process of its own: asking torch cannot harm a fork
        if reason:
            return False, "torch", reason
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return True, "torch", f"{torch.__version__} ({build}; no GPU visible: the tiny profile runs on the CPU)"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
    if nccl is None:
        return False, "torch", f"{torch.__version__}, CUDA {torch.version.cuda} without NCCL: Days 4-7 need it; " \
                               "install the CUDA build of environment.yml (requirements/gpu.txt)"
    return True, "torch", f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def gpus() -> list[tuple[str, float, tuple[int, int]]]:
    """(name, memory in GiB, compute capability) of every visible GPU."""
    import torch

    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [(p.name, p.total_memory / 2 ** 30, (p.major, p.minor)) for p in props]


def gpu_line(found) -> Line:
    from dlo.nvidia import driver

    listed = driver()
    if not found:
        if listed:  # the torch line says why torch sees none of them
            return True, "gpus", f"none visible to torch; nvidia-smi lists {len(listed.gpus)} ({listed.gpus[0]}, " \
                                 f"driver {listed.version})"
        return True, "gpus", "none (full profile and Days 4-7 at scale need GPU nodes: sbatch --gres=gpu:N)"
    text = ", ".join(f"{i}: {name} {mem:.0f} GiB sm_{cc[0]}{cc[1]}" for i, (name, mem, cc) in enumerate(found))
    return True, "gpus", text + (f" (driver {listed.version})" if listed else "")


def triton_line(found) -> Line:
    """Compile a small kernel ahead of time for the GPU present (sm_80 without one): the course's kernels
    need Triton's compiler and ptxas, which a broken install or an unsupported GPU lacks."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return False, "triton", f"not importable ({exc}): pip install -e . installs the pinned version"

    def _double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    _double = JITFunction(_double)  # not triton.jit: under TRITON_INTERPRET=1 that gives no compilable kernel

    cc = found[0][2] if found else (8, 0)
    arch = cc[0] * 10 + cc[1]
    try:
        src = ASTSource(fn=_double, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                        constexprs={"BLOCK": 128})
        # A cache of its own: the check compiles for real (never a cached result), and two doctors at once
        # (a test suite's workers, a class on one node) never compile the same key into one folder, which
        # Triton does not survive (triton-lang/triton#11512: a just-published file not found; test_doctor
        # failed so once in make test)
        with tempfile.TemporaryDirectory(prefix="dlo-doctor-triton-") as cache, triton.knobs.cache.scope():
            triton.knobs.cache.dir = cache
            triton.compile(src, target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # noqa: BLE001 - any compiler failure is the finding itself
        return False, "triton", f"{triton.__version__} cannot compile for sm_{arch}: {str(exc).splitlines()[0][:150]}"
    where = f"the GPU (sm_{arch})" if found else "sm_80 (no GPU here: the kernels run in the interpreter)"
    return True, "triton", f"{triton.__version__}, compiles for {where}"


def jit_line(found) -> Line:
    """Whether Triton's JIT can build its CUDA launcher here (what a kernel's first launch on a GPU builds,
    unlike `triton_line`'s compile ahead of time): on a GPU it is built, else its prerequisites are checked as
    Triton finds them (dlo.kernels.runtime.jit_missing). Without an NVIDIA GPU the kernels are interpreted."""
    from dlo.kernels.runtime import JITUnavailable, build_launcher, c_compiler, jit_missing, libcuda_dirs
    from dlo.nvidia import driver

    if not found and driver() is None:
        return True, "jit", "not needed: no NVIDIA GPU here (the kernels run in Triton's interpreter)"
    missing = jit_missing()
    if missing:
        return False, "jit", "Triton cannot build its CUDA launcher: " + "; ".join(missing)
    uses = f"{c_compiler()}, Python.h, libcuda.so.1 in {libcuda_dirs()[0]}"
    if not found:
        return True, "jit", f"its prerequisites are here ({uses}); not built: torch sees no GPU"
    try:
        build_launcher()
    except JITUnavailable as exc:
        return False, "jit", str(exc)
    return True, "jit", f"builds Triton's CUDA launcher ({uses})"


def bwrap_line() -> Line:
    from dlo.grading import jail

    found = jail.probe()
    if found == "bwrap":
        return True, "bwrap", "runs with the grader's flags: student code is graded in a sandbox"
    return False, "bwrap", f"{found}; without it `dlo grade` runs student code unconfined"


def data_line(data_dir: Path | None, days=None, weights_dir: Path | None = None) -> Line:
    """What the days (default: every day) read from `data_dir`, and Day 5's checkpoint when asked for, at
    the profile this machine runs, checked as `dlo.setup` and `dlo data check` check them (`dlo.data.check`):
    one line, FIX with each problem's fix (the Python version of CIFAR-10, a missing tokens.npy, ...)."""
    from dlo.config import resolve_profile
    from dlo.data import check

    if data_dir is None and weights_dir is None:
        return True, "data", "no --data-dir: notebooks use deterministic synthetic data (data_dir \"\")"
    profile = resolve_profile("auto")
    found = check.lines(data_dir, days, profile) if data_dir is not None else []
    if weights_dir is not None:
        found.append(check.weights_line(weights_dir, profile))
    return check.summary(found, data_dir)


def plan_lines(days: list[str], found) -> list[Line]:
    """Each day's `dlo plan` on the GPUs found: their count and the smallest memory."""
    from dlo import plan
    from dlo.registry import plan_day

    if not found:
        return [(True, "plan", "no GPU: skipped (dlo plan DAY --gpus N --gpu-mem GB plans for a GPU node)")]
    mem = min(m for _, m, _ in found)
    lines = []
    for day in days:
        rows = plan_day(day, len(found), mem)
        try:
            plan.check_fits(rows, plan.main_configs(rows))
        except plan.DoesNotFit as exc:
            lines.append((False, f"plan {day}", f"does not fit {len(found)} x {mem:.0f} GiB: {exc}"))
            continue
        lines.append((True, f"plan {day}", f"fits {len(found)} GPU(s) of {mem:.0f} GiB"))
    return lines


def report(days: list[str], data_dir: Path | None, weights_dir: Path | None = None) -> list[Line]:
    found = gpus()
    return [torch_line(), gpu_line(found), triton_line(found), jit_line(found), bwrap_line(),
            data_line(data_dir, days, weights_dir), *plan_lines(days, found)]


def main(days: list[str], data_dir: Path | None, weights_dir: Path | None = None) -> int:
    """`dlo doctor`: the lines, then exit status 1 when one says FIX."""
    from dlo.registry import DAYS

    unknown = [d for d in days if d not in DAYS]
    if unknown:
        raise BadInput(f"no plan for {', '.join(unknown)}; days: {', '.join(DAYS)}")
    if data_dir is not None and not data_dir.is_dir():
        raise BadInput(f"--data-dir {data_dir} is not a folder")
    if weights_dir is not None and not weights_dir.is_dir():
        raise BadInput(f"--weights-dir {weights_dir} is not a folder")
    lines = report(days or list(DAYS), data_dir, weights_dir)
    width = max(len(topic) for _, topic, _ in lines)
    for ok, topic, text in lines:
        print(f"{'ok ' if ok else 'FIX'}  {topic:<{width}}  {text}")
    return 0 if all(ok for ok, _, _ in lines) else 1

