"""Ahead-of-time compilation of the Triton kernels for the GPUs they target, on a machine without one.

Each kernel module declares `compile_cases()` next to its launcher: one `CompileCase` per block
configuration a GPU launch can pick and per dtype the launcher accepts, with the arguments the
launcher passes (tensors as their torch dtype, ints and floats as example values). From those this
module builds the signature and specialization a GPU launch would get, compiles with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` (Triton's bundled ptxas) and
reads the resources: registers, spills and stack from `ptxas -v`, shared memory from the metadata,
the tensor-core instruction from the PTX.

The compiler needs `triton.jit` functions, but under TRITON_INTERPRET=1 (the test suite on CPU) the
decorator returns interpreter objects, so compilation always runs in a child process with the
interpreter off: `compile_all()` (or `python -m dlo.kernels.aot --out FILE`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch

# Per-block and per-SM limits of the CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability" (8.0, 9.0, 10.0): shared memory per block (opt-in maximum) 163 / 227 / 227 KiB,
# per SM 164 / 228 / 228 KiB, 64 K 32-bit registers, 2048 threads (64 warps) and 32 blocks per SM.
# `devices` names the dlo.hardware.PEAKS rows the roofline uses for that target.
TARGETS = {
    80: dict(gpu="A100", smem_block=163 * 1024, smem_sm=164 * 1024, devices=("A100 80GB SXM",)),
    90: dict(gpu="H100/H200", smem_block=227 * 1024, smem_sm=228 * 1024, devices=("H100 SXM", "H200 SXM")),
    100: dict(gpu="B200", smem_block=227 * 1024, smem_sm=228 * 1024, devices=("B200",)),
}
REGS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
SMEM_RESERVED_PER_BLOCK = 1024  # the guide: 1 KB per block is reserved for system use
_TORCH_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8",
                torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """One compilation of `kernel`: `args` maps every kernel parameter to what the launcher passes
    (a torch dtype for a tensor, an int, a float, or the constexpr's value). `label` names the
    configuration; `shape`, `bytes`, `flops` and `peak` ("bf16_tflops", "int8_tops", ...) describe
    the work at a named real shape, for the roofline (bytes = the minimum HBM traffic); `torch`, if
    given, is (bytes, flops, peak) of torch's op at the same shape, for the expected ratio."""
    kernel: object
    args: dict
    label: str
    num_warps: int = 4
    num_stages: int = 3
    shape: str = ""
    bytes: int = 0
    flops: int = 0
    peak: str = "fp32_tflops"
    torch: tuple | None = None

    @property
    def name(self) -> str:
        return f"{python_function(self.kernel).__name__}[{self.label}]"


def python_function(kernel):
    """The Python function under a `triton.jit` object, compiled or interpreted."""
    return kernel.fn


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def specialization(case: CompileCase) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `triton.compile` for the launch `case.args` describes,
    specialized as Triton's launcher does: ints equal to 1 become constants, pointers (torch
    allocations) and ints divisible by 16 get tt.divisibility 16."""
    params = inspect.signature(python_function(case.kernel)).parameters
    if set(params) != set(case.args):
        raise ValueError(f"{case.name}: the case's arguments {sorted(case.args)} are not the kernel's {list(params)}")
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(params.items()):
        value = case.args[name]
        if _is_constexpr(param) or (type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.dtype):
            signature[name], attrs[(i,)] = "*" + _TORCH_TYPES[value], [["tt.divisibility", 16]]
        elif type(value) is int:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif type(value) is float:
            signature[name] = "fp32"
        else:
            raise TypeError(f"{case.name}: argument {name}={value!r} is not a dtype, int, float or constexpr")
    return signature, constexprs, attrs


def tensor_core(ptx: str) -> str:
    """The tensor-core instruction family the PTX uses: tcgen05 (Blackwell), wgmma (Hopper), mma, or none."""
    for family in ("tcgen05.mma", "wgmma.mma_async", "mma.sync"):
        if family in ptx:
            return family.split(".")[0]
    return "none"


def ptxas_resources(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and stack frame from `ptxas -v`, run as Triton runs it (same ptxas,
    same flags); Triton reads these only when it loads the binary on a GPU."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                              r"(\d+) bytes spill loads", log).groups())
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    return dict(regs=regs, spill_stores=stores, spill_loads=loads, stack=stack)


def occupancy(regs: int, smem: int, num_warps: int, arch: int) -> float:
    """Fraction of an SM's 64 warp slots filled by resident blocks, limited by warps, blocks,
    registers (allocated per warp in units of 256) and shared memory on sm_`arch` (the rules of
    the CUDA occupancy calculator)."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    limits = [WARPS_PER_SM // num_warps, BLOCKS_PER_SM, REGS_PER_SM // (regs_per_warp * num_warps)]
    if smem:
        limits.append(TARGETS[arch]["smem_sm"] // (smem + SMEM_RESERVED_PER_BLOCK))
    return min(limits) * num_warps / WARPS_PER_SM


def compile_case(case: CompileCase, arch: int) -> dict:
    """Compile one case for sm_`arch`; a dict of its resources, or {"error": ...} if it does not compile."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs = specialization(case)
    start = time.perf_counter()
    try:
        k = triton.compile(ASTSource(fn=case.kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=case.num_warps, num_stages=case.num_stages))
        res = ptxas_resources(k.asm["ptx"], arch)
    except Exception as e:  # a compile error is a result to report, not a crash of the whole run
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    smem = k.metadata.shared
    return dict(res, seconds=round(time.perf_counter() - start, 2), smem=smem, num_warps=k.metadata.num_warps,
                num_stages=k.metadata.num_stages,
                tensor_core=tensor_core(k.asm["ptx"]), smem_limit=TARGETS[arch]["smem_block"],
                occupancy=occupancy(res["regs"], smem, k.metadata.num_warps, arch))


def all_cases() -> list[CompileCase]:
    """The compile cases of every `dlo.kernels` module (each one's `compile_cases()`)."""
    import dlo.kernels
    cases = []
    for info in pkgutil.iter_modules(dlo.kernels.__path__):
        module = importlib.import_module(f"dlo.kernels.{info.name}")
        if callable(getattr(module, "compile_cases", None)):
            cases += module.compile_cases()
    return cases


def _compile_indexed(job: tuple[int, int]) -> dict:
    index, arch = job
    case = all_cases()[index]
    return {"case": case.name, "arch": arch, **compile_case(case, arch)}


def _main(archs: list[int], jobs: int, out: str, only: list[str] | None = None) -> None:
    todo = [(i, arch) for i, case in enumerate(all_cases()) if not only or case.name in only for arch in archs]
    # Many small processes: Triton's compiler holds the GIL, ptxas is the only part that runs outside it.
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(_compile_indexed, todo))
    with open(out, "w") as f:  # not stdout: Triton prints a failing kernel's PTX there
        json.dump(results, f)


def compile_all(archs: tuple[int, ...] = tuple(TARGETS), cache_dir: str | None = None,
                jobs: int | None = None, only: list[str] | None = None) -> dict[tuple[str, int], dict]:
    """Compile every case (or the cases named in `only`) for every arch in a child process with the
    interpreter off: {(case name, arch): resources or {"error": ...}}. `cache_dir`: Triton's cache."""
    if unknown := sorted(set(archs) - set(TARGETS)):
        raise ValueError(f"no target sm_{unknown[0]}; known: {', '.join(f'sm_{a}' for a in TARGETS)}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, "-m", "dlo.kernels.aot", "--jobs", str(jobs or os.cpu_count() or 1), "--out", out,
               *(["--only", "\n".join(only)] if only else []), *(str(a) for a in archs)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return {(r.pop("case"), r.pop("arch")): r for r in json.load(f)}


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="compile every dlo kernel case; JSON results on stdout")
    parser.add_argument("archs", nargs="*", type=int, default=list(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", required=True, help="file for the JSON results")
    parser.add_argument("--only", default="", help="the case names to compile, one per line (default: all)")
    args = parser.parse_args()
    _main(args.archs, args.jobs, args.out, [n for n in args.only.split("\n") if n] or None)
