"""What a student's code can do on a GPU inside the grading sandbox: run by `bench/gpu_steps.py sandbox`
under `dlo.grading.jail`'s real flags (bubblewrap, uid 65534, a private /dev with the GPU nodes, a private
network, the checkout and HOME hidden), from the sandbox's own scratch folder.

    python sandbox_probe.py CHECKOUT [--cpu]

Prints one JSON line per check ({"check": name, "ok": true/false/null, "s": seconds, ...}): who it runs as
and what it sees, torch's import, CUDA (an allocation and a bf16 matmul), a Triton kernel compiled just in
time (the C compiler and Python's headers it builds its launcher with, its cache in the sandbox's HOME),
torch.compile (inductor), an NCCL process group of one rank on the private loopback, and
`dlo.distributed.launch` of one NCCL rank from inside. `--cpu`: gloo, the Triton interpreter (the caller
sets TRITON_INTERPRET=1), inductor's C++ backend; the CUDA check is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

CHECKOUT = Path(sys.argv[1])
CPU = "--cpu" in sys.argv


def check(name: str, fn, skip: str = "") -> None:
    if skip:
        print(json.dumps({"check": name, "ok": None, "skipped": skip}), flush=True)
        return
    t = time.perf_counter()
    try:
        extra = fn() or {}
        ok = extra.pop("ok", True)
    except Exception as exc:  # noqa: BLE001 - every check is reported, the next one still runs
        extra = {"error": f"{type(exc).__name__}: {exc}"[:800], "trace": traceback.format_exc()[-2000:]}
        ok = False
    print(json.dumps({"check": name, "ok": ok, "s": round(time.perf_counter() - t, 2), **extra}, default=str),
          flush=True)


def identity() -> dict:
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    home = Path(os.environ["HOME"])
    (home / "probe-written").write_text("ok")
    version = Path("/proc/driver/nvidia/version")
    seen = os.path.exists(CHECKOUT / "solutions")
    return {"ok": os.getuid() == 65534 and int(status["CapEff"], 16) == 0 and not seen,
            "uid": os.getuid(), "cap_eff": status["CapEff"].strip(), "sees_checkout": seen,
            "interfaces": [n for _, n in socket.if_nameindex()], "home": str(home),
            "dev": sorted(p.name for p in Path("/dev").iterdir() if p.name.startswith(("nvidia", "dri"))),
            "proc_driver_nvidia": version.read_text().splitlines()[0] if version.is_file() else None,
            **{k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES")}}


def torch_import() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}


def cuda() -> dict:
    import torch

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = x @ x
    torch.cuda.synchronize()
    del big
    return {"ok": bool(torch.isfinite(y.float()).all()), "device": torch.cuda.get_device_name(),
            "allocated_peak": torch.cuda.max_memory_allocated()}


def triton_jit() -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    device = "cpu" if CPU else "cuda"
    x, y = torch.randn(10_000, device=device), torch.randn(10_000, device=device)
    out = torch.empty_like(x)
    add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
    cache = Path(os.environ.get("TRITON_CACHE_DIR", ""))
    files = sum(1 for _ in cache.rglob("*")) if cache.is_dir() else 0
    return {"ok": bool(torch.equal(out, x + y)), "triton": triton.__version__, "interpreted": CPU,
            "cache_files": files}


def torch_compile() -> dict:
    import torch

    def f(x):
        return torch.nn.functional.gelu(x) * x + 1.0

    x = torch.randn(1024, 1024, device="cpu" if CPU else "cuda")
    got = torch.compile(f)(x)
    return {"ok": bool(torch.allclose(got, f(x), atol=1e-5)), "backend": "inductor"}


def process_group() -> dict:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "gloo" if CPU else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        t = torch.ones(8, device="cpu" if CPU else "cuda")
        dist.all_reduce(t)
        dist.barrier()
        return {"ok": t.sum().item() == 8.0, "backend": dist.get_backend()}
    finally:
        dist.destroy_process_group()


def _rank():
    import torch
    import torch.distributed as dist

    from dlo.distributed.current import rank_device

    device = rank_device()
    t = torch.full((4,), 2.0, device=device)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "device": str(device), "sum": t.sum().item(), "uid": os.getuid()}


def launch() -> dict:
    from dlo.distributed.launch import launch as run

    backend = "gloo" if CPU else "nccl"
    got = run(_rank, 1, backend=backend, timeout=120)[0]
    return {"ok": got["backend"] == backend and got["sum"] == 8.0 and got["uid"] == 65534, **got}


if __name__ == "__main__":
    check("identity", identity)
    check("torch_import", torch_import)
    check("cuda", cuda, skip="no GPU" if CPU else "")
    check("triton_jit", triton_jit)
    check("torch_compile", torch_compile)
    check("process_group", process_group)
    check("launch", launch)
