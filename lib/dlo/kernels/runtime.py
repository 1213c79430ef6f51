"""Where a Triton kernel runs, and what the kernels share (launch tables, bf16 rounding, timing).

Kernels are compiled for CUDA tensors, or run in numpy on CPU tensors with TRITON_INTERPRET=1 (the
tests on a machine without GPU). `triton.jit` picks compiled vs interpreted when a kernel module is
imported, so TRITON_INTERPRET must be set before dlo.kernels is imported: tests/conftest.py does.

On a GPU, Triton's JIT first builds a C launcher (its CUDA driver module, compiled once per machine and
cached under ~/.triton/cache) with a C compiler, the Python headers and libcuda: `jit_missing` checks those
the way Triton 3.7.1 finds them. When that build fails, every kernel of the course fails with one line,
`JITUnavailable`, naming what is missing and `dlo doctor`; it does not fall back to the op's torch reference
`<op>_ref`. The course measures its kernels (`dlo bench`, the notebooks' timing and memory tables, the claims
they answer): a reference standing in would be timed and reported under the kernel's name, with other
numerics and memory (flash_attention_ref writes the T x T scores, in fp32), and a warning scrolled past in a
long notebook would not undo that. The cause is the node's set-up, fixed once for everyone (a compiler
module, the headers, TRITON_LIBCUDA_PATH), so failing at the first launch costs one cell, not a wrong table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

LDCONFIG = "/sbin/ldconfig"  # the path Triton runs to find libcuda.so.1 (triton/backends/nvidia/driver.py)


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels then run in numpy on CPU tensors (tests, no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device` in this process. On a GPU, the first call
    builds Triton's launcher (`build_launcher`): JITUnavailable, one line, when it cannot."""
    device = torch.device(device)
    if interpreting():
        return device.type == "cpu"
    if device.type == "cuda" and not _launcher_built and torch.cuda.is_available():
        build_launcher()
    return device.type == "cuda"


class JITUnavailable(RuntimeError):
    """Triton cannot build its CUDA launcher on this machine (a node's set-up, not a kernel's bug)."""


def python_include() -> Path:
    """The folder where Triton looks for Python.h: sysconfig's include path of the default scheme, Debian's
    posix_local read as posix_prefix (triton/runtime/build.py)."""
    scheme = sysconfig.get_default_scheme()
    return Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])


def libcuda_dirs() -> list[str]:
    """The folders holding libcuda.so.1 as Triton finds them: TRITON_LIBCUDA_PATH, else `ldconfig -p`'s
    entries, else the LD_LIBRARY_PATH folders that have it; only folders where the file is."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        dirs = [os.environ["TRITON_LIBCUDA_PATH"]]
    else:
        try:
            listing = subprocess.run([LDCONFIG, "-p"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            listing = ""
        dirs = [os.path.dirname(line.split()[-1]) for line in listing.splitlines() if "libcuda.so.1" in line]
        if not dirs:
            dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    return [d for d in dirs if os.path.exists(os.path.join(d, "libcuda.so.1"))]


def c_compiler() -> str | None:
    """The C compiler Triton builds its launcher with: $CC, else gcc, else clang on PATH (a full path)."""
    cc = os.environ.get("CC")
    if cc is not None:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def jit_missing() -> list[str]:
    """What Triton's JIT lacks here to build its CUDA launcher, each with its fix; empty when nothing is."""
    missing = []
    if c_compiler() is None:
        missing.append(f"CC={os.environ['CC']} is not a command" if "CC" in os.environ else
                       "no C compiler (Triton uses $CC, else gcc, else clang on PATH): load or install gcc")
    include = python_include()
    if not (include / "Python.h").is_file():
        missing.append(f"no Python.h in {include}: install the Python headers (e.g. python3.11-dev)")
    if not libcuda_dirs():
        missing.append("no libcuda.so.1 (ldconfig -p, LD_LIBRARY_PATH): set TRITON_LIBCUDA_PATH to the "
                       "NVIDIA driver's library folder")
    cache = Path(triton.knobs.cache.dir)
    while not cache.exists() and cache != cache.parent:
        cache = cache.parent
    if not (cache.is_dir() and os.access(cache, os.W_OK)):
        missing.append(f"Triton's cache {triton.knobs.cache.dir} is not writable: set TRITON_CACHE_DIR")
    return missing


_launcher_built = False


def build_launcher() -> None:
    """Build Triton's CUDA launcher, or load it from Triton's cache: what every GPU launch needs first
    (Triton's CUDA driver compiles it when it is first used). Once per process when it works; JITUnavailable,
    one line naming what is missing, when it does not (tried again at the next call: a fix needs no restart)."""
    global _launcher_built
    if _launcher_built:
        return
    try:
        triton.runtime.driver.active.utils  # noqa: B018 - creating the active driver builds the launcher
    except Exception as exc:  # noqa: BLE001 - whatever the build raised, the cause is named below
        missing = jit_missing()
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        cause = "; ".join(missing) or f"{type(exc).__name__}: {first}"
        error = JITUnavailable(f"Triton cannot build its CUDA launcher here, so no kernel can run: {cause} "
                               "(`dlo doctor` checks every prerequisite; the torch references do not stand in "
                               "for the kernels)")
        if missing:
            raise error from None  # the cause is known: its one line, not Triton's traceback
        raise error from exc
    _launcher_built = True


FP32_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= FP32_MAX is false exactly for inf and nan


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32. Done by hand because the CPU
    interpreter truncates on fp32 -> bf16, which would bias small updates downwards; this way GPU
    and interpreter agree bit for bit. inf keeps its class under this rounding; a nan is passed through
    as it is: the canonical nan of NVIDIA's arithmetic is 0x7FFFFFFF, whose rounding carry would run into
    the sign bit and make it -0.0 (seen on an H100: nan * 0.5 unscaled to -0.0, hiding an overflow)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


def block_map(numels: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-tensor launch map (as torch's multi_tensor_apply): program i works on tensor
    `block_tensor[i]` from element `block_start[i]`, so one launch covers every tensor of a list."""
    counts = torch.tensor([triton.cdiv(n, block_size) for n in numels])
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first_block = torch.cumsum(counts, 0) - counts
    block_start = (torch.arange(len(block_tensor)) - first_block[block_tensor]) * block_size
    return block_tensor, block_start.to(torch.int64)


_tables: dict[tuple, tuple] = {}


def launch_tables(lists: list[list[Tensor]], device: torch.device, block_size: int) -> tuple:
    """Tables of one multi-tensor launch over parallel tensor lists (e.g. params, grads, m, v):
    (L, T) int64 addresses, (T,) sizes (of lists[0]), the per-program map of `block_map`, and
    whether every address is 16-byte aligned. A pure function of addresses, sizes and block size,
    so the cache is always right; it saves rebuilding and copying the tables every step."""
    # map over the unbound methods and flat tuples: this runs every optimizer step, and with ~150
    # tensors its Python time is what a small model's step costs (host-bound, first H100 run).
    addrs = tuple(tuple(map(Tensor.data_ptr, lst)) for lst in lists)
    numels = tuple(map(Tensor.numel, lists[0]))
    key = (device, block_size, addrs, numels)
    if key not in _tables:
        block_tensor, block_start = block_map(numels, block_size)
        if len(_tables) >= 64:
            _tables.pop(next(iter(_tables)))
        tables = [torch.tensor(addrs, dtype=torch.int64), torch.tensor(numels, dtype=torch.int64),
                  block_tensor, block_start]
        # torch allocations are aligned; only views with an odd storage offset are not.
        aligned = all(a % 16 == 0 for lst in addrs for a in lst)
        _tables[key] = (*(x.to(device) for x in tables), aligned)
    return _tables[key]


def time_ms(fn, device: torch.device | str = "cuda", warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of one call of `fn`: triton's do_bench on CUDA (it flushes the L2 cache
    between calls), dlo.measure.time_fn on CPU (after one warm-up call, e.g. an optimizer's state
    allocation on its first step; at least 3 calls and 0.2 s)."""
    if torch.device(device).type == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    from dlo.measure import time_fn

    return time_fn(fn, device=device, warmup=1, reps=3, min_time_s=0.2, max_reps=50).median_ms


def bench_matmuls(op: str, M: int, K: int, N: int, impls: dict, peaks: dict | None = None) -> list[dict]:
    """Time implementations of one (M, K) x (K, N) product for `dlo bench` (GPU only).

    `impls` maps a name to (fn, peak key such as "bf16_tflops", bytes it must move at least or None:
    then no roofline columns);
    the first entry is the dense bf16 baseline that "speed-up" refers to. TFLOP/s counts the dense
    work 2 M N K, whatever the format, so rates of sparse and quantized products compare with dense
    ones. `peaks`: dlo.hardware figures (default: this GPU's). "size" groups rows for dlo.bench's ratios.
    """
    if peaks is None:
        from dlo.hardware import peak
        peaks = peak("cuda") or {}
    rows, base = [], None
    for impl, (fn, key, moved) in impls.items():
        ms = time_ms(fn, warmup=10, rep=50)
        base = base or ms
        tflops = 2 * M * N * K / (ms * 1e-3) / 1e12
        pk = peaks.get(key)
        rows.append({"op": op, "size": f"{M}x{K}x{N}", "M": M, "K": K, "N": N, "impl": impl, "ms": ms,
                     "TFLOP/s": tflops, "% peak": 100 * tflops / pk if pk else None, "speed-up": base / ms,
                     **({"work": (moved, 2 * M * N * K, key)} if moved else {})})
    from dlo.hardware import add_roofline
    return add_roofline(rows, peaks.get("name"))
