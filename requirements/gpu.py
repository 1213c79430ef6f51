"""Write requirements/gpu.txt from requirements/cpu.lock (`make lock` runs it).

GPU nodes install the same versions as CPU machines, but the CUDA build of torch (PyPI's `torch==X`
instead of the CPU index's `torch==X+cpu`); torch pins its NVIDIA libraries itself (nvidia-*==...).
No hashes here: the CUDA wheels are not in the CPU lock, and conda's pip section (environment.yml)
installs `-e .` in the same call, which hash-checking mode refuses.
"""

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", re.M)


def pins(lock_text: str) -> dict[str, str]:
    """{name: version} of every `name==version` line of a pip-compile lock."""
    return dict(PIN.findall(lock_text))


# The two CUDA packages that torch 2.13.0's CUDA build (CUDA 13.0) and its cuda-toolkit 13.0.3 ask for by a
# range rather than a pin (read from their metadata); every other NVIDIA library they pin exactly.
CUDA_ONLY = {"cuda-bindings": "13.0.3", "nvidia-nvjitlink": "13.0.88"}


def gpu_pins(cpu: dict[str, str]) -> dict[str, str]:
    same = {name: version.split("+", 1)[0] for name, version in cpu.items()}  # torch 2.13.0+cpu -> 2.13.0
    return {**same, **CUDA_ONLY}


def main() -> int:
    cpu = pins((HERE / "cpu.lock").read_text())
    lines = [f"{n}=={v}" for n, v in sorted(gpu_pins(cpu).items(), key=lambda kv: kv[0].lower())]
    head = ("# Generated from requirements/cpu.lock by requirements/gpu.py (make lock): do not edit.\n"
            "# The same versions as the CPU lock, with the CUDA build of torch (its NVIDIA libraries pinned by torch).\n")
    (HERE / "gpu.txt").write_text(head + "\n".join(lines) + "\n")
    print(f"requirements/gpu.txt: {len(lines)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
