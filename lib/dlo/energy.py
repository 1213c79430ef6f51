"""The energy a run costs, read where the machine can tell, then kWh and grams of CO2-equivalent.

Green AI (Schwartz et al. 2019, "Green AI") asks that a result be reported with what it cost to get;
Strubell et al. 2019 ("Energy and Policy Considerations for Deep Learning in NLP") turned training time into
kWh (measured CPU, DRAM and GPU power, times the data centre's PUE) and CO2e (kWh x the grid's intensity).
Every `Reading` here says which source it comes from, so an estimate is never shown as a measurement:

- "rapl": Intel RAPL's cumulative counters, /sys/class/powercap/intel-rapl:N/energy_uj (one per CPU package;
  their sub-domains core/uncore/dram are inside or beside it and are not added), wrap-around handled with
  max_energy_range_uj. Readable by root only on most kernels since 5.10 (CVE-2020-8694).
- "nvml" / "nvidia-smi": the GPU's total energy since the driver loaded (nvmlDeviceGetTotalEnergyConsumption,
  in mJ, Volta and newer), through pynvml when it imports, else `nvidia-smi --query-gpu=power.draw,
  total_energy_consumption`.
- "estimate": CPU time of this process and its children x a stated TDP per core, when nothing is readable.

The intensity of the grid (gCO2e per kWh) is not measured here: it is given, and printed with the result.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dlo.errors import BadInput

POWERCAP = Path("/sys/class/powercap")
JOULES_PER_KWH = 3.6e6
UNITS = {"mJ": 1e-3, "J": 1.0, "kJ": 1e3}


@dataclass(frozen=True)
class Reading:
    source: str      # "rapl", "nvml", "nvidia-smi" or "estimate"
    joules: float
    seconds: float   # wall time between the two reads
    how: str         # what was read, in words (an estimate says its assumption)

    @property
    def measured(self) -> bool:
        return self.source != "estimate"

    @property
    def kwh(self) -> float:
        return self.joules / JOULES_PER_KWH

    def co2e_grams(self, grams_per_kwh: float) -> float:
        if grams_per_kwh < 0:
            raise BadInput(f"grid intensity must be >= 0 gCO2e/kWh, got {grams_per_kwh}")
        return self.kwh * grams_per_kwh

    def line(self, grams_per_kwh: float) -> str:
        kind = "measured" if self.measured else "ESTIMATE"
        return (f"{self.source}: {self.joules:.1f} J in {self.seconds:.1f} s = {self.kwh * 1e3:.4f} Wh, "
                f"{self.co2e_grams(grams_per_kwh):.3f} gCO2e at {grams_per_kwh:g} g/kWh ({kind}: {self.how})")


# ----------------------------------------------------------------------------- counters

def rapl_packages(root: Path = POWERCAP) -> list[Path]:
    """The readable top-level RAPL domains (intel-rapl:N, not intel-rapl:N:M)."""
    found = []
    for domain in sorted(root.glob("intel-rapl:*")):
        if re.fullmatch(r"intel-rapl:\d+", domain.name):
            try:
                int((domain / "energy_uj").read_text())
            except (OSError, ValueError):
                continue
            found.append(domain)
    return found


def rapl_read(domains: list[Path]) -> list[int]:
    return [int((d / "energy_uj").read_text()) for d in domains]


def rapl_joules(domains: list[Path], start: list[int], end: list[int]) -> float:
    """Sum of the counters' increases; a counter that wrapped went past its max_energy_range_uj."""
    total = 0
    for domain, a, b in zip(domains, start, end):
        if b < a:
            b += int((domain / "max_energy_range_uj").read_text())
        total += b - a
    return total / 1e6


def _nvml_counter():
    """A function returning the summed energy of every visible GPU in J through NVML, or None."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        read = lambda: sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3  # noqa: E731
        read()
    except Exception:  # no pynvml, no driver, a GPU older than Volta: NVML cannot tell
        return None
    return read if handles else None


def smi_energy(smi: str = "nvidia-smi") -> tuple[float, float] | None:
    """(total energy in J summed over the GPUs, power draw in W summed) from nvidia-smi, or None when it does
    not answer or does not know the counter ([N/A], an unknown unit)."""
    try:
        out = subprocess.run([smi, "--query-gpu=power.draw,total_energy_consumption", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    joules = watts = 0.0
    rows = [row for row in out.stdout.splitlines() if row.strip()]
    for row in rows:
        match = re.fullmatch(r"\s*([\d.]+) W\s*,\s*([\d.]+) (mJ|J|kJ)\s*", row)
        if not match:
            return None
        watts += float(match.group(1))
        joules += float(match.group(2)) * UNITS[match.group(3)]
    return (joules, watts) if rows else None


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ----------------------------------------------------------------------------- the meter

@dataclass
class EnergyMeter:
    """`with EnergyMeter() as m: ...` then `m.readings`: one Reading per source that could tell, and
    `m.missing`: what is here but could not be measured (a GPU without an energy counter), said, not guessed.

    `tdp_watts` and `cores` state the CPU estimate's assumption (the package's thermal design power shared by
    its cores); it is used only when neither RAPL nor a GPU counter is readable.
    """

    tdp_watts: float = 65.0
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    powercap: Path = POWERCAP
    smi: str = "nvidia-smi"
    gpu: bool | None = None          # None: ask dlo.nvidia whether a driver is here
    readings: list[Reading] = field(default_factory=list)

    def __enter__(self) -> EnergyMeter:
        if self.tdp_watts <= 0 or self.cores < 1:
            raise BadInput(f"EnergyMeter needs tdp_watts > 0 and cores >= 1, got {self.tdp_watts}, {self.cores}")
        self.rapl = rapl_packages(self.powercap)
        self.rapl_start = rapl_read(self.rapl)
        gpu = self.gpu
        if gpu is None:
            from dlo.nvidia import driver
            gpu = driver() is not None
        self.gpu_here = gpu
        self.nvml = _nvml_counter() if gpu else None
        self.smi_start = smi_energy(self.smi) if gpu and self.nvml is None else None
        self.gpu_start = self.nvml() if self.nvml else None
        self.cpu_start, self.wall_start = cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self.wall_start
        self.readings = []
        if self.rapl:
            joules = rapl_joules(self.rapl, self.rapl_start, rapl_read(self.rapl))
            names = ", ".join(d.name for d in self.rapl)
            self.readings.append(Reading("rapl", joules, seconds, f"energy_uj of {names} (the whole package)"))
        if self.nvml is not None:
            self.readings.append(Reading("nvml", self.nvml() - self.gpu_start, seconds,
                                         "nvmlDeviceGetTotalEnergyConsumption, every visible GPU"))
        elif self.smi_start is not None and (end := smi_energy(self.smi)) is not None:
            self.readings.append(Reading("nvidia-smi", end[0] - self.smi_start[0], seconds,
                                         f"total_energy_consumption, every GPU (power.draw {end[1]:.0f} W at the end)"))
        self.missing = []
        if self.gpu_here and not any(r.source in ("nvml", "nvidia-smi") for r in self.readings):
            self.missing.append("GPU: neither NVML nor nvidia-smi's total_energy_consumption answered")
        if not self.readings:
            cpu = cpu_seconds() - self.cpu_start
            self.readings.append(Reading("estimate", cpu * self.tdp_watts / self.cores, seconds,
                                         f"{cpu:.1f} CPU s x {self.tdp_watts:g} W TDP / {self.cores} cores, "
                                         f"stated, not measured: no readable RAPL or GPU counter here"))

    @property
    def joules(self) -> float:
        return sum(r.joules for r in self.readings)

    @property
    def measured(self) -> bool:
        return all(r.measured for r in self.readings)
