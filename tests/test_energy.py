"""dlo.energy on fake counters: RAPL's sysfs files (sub-domains not added, wrap-around), nvidia-smi's total
energy (a stand-in script), the CPU-time estimate when nothing is readable; each reading says its source."""

import pytest

from dlo import energy
from dlo.energy import EnergyMeter, Reading
from dlo.errors import BadInput


def _domain(root, name, uj, max_uj=2**32):
    d = root / name
    d.mkdir(parents=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return d


def test_rapl_packages_summed_subdomains_skipped_wraparound_counted(tmp_path):
    p0, p1 = _domain(tmp_path, "intel-rapl:0", 1_000_000), _domain(tmp_path, "intel-rapl:1", 2**32 - 500_000)
    core = _domain(tmp_path, "intel-rapl:0:0", 5)             # inside package 0: adding it would count twice
    (tmp_path / "intel-rapl:2").mkdir()
    (tmp_path / "intel-rapl:2" / "energy_uj").mkdir()          # unreadable: left out, not a crash
    with EnergyMeter(powercap=tmp_path, gpu=False) as meter:
        (p0 / "energy_uj").write_text("4000000\n")             # +3 J
        (p1 / "energy_uj").write_text("1500000\n")             # wrapped: +0.5 J before the wrap, +1.5 J after
        (core / "energy_uj").write_text("999999999\n")
    [reading] = meter.readings
    assert reading.source == "rapl" and reading.measured and reading.joules == pytest.approx(5.0)
    assert "intel-rapl:0, intel-rapl:1" in reading.how and meter.missing == []


def _fake_smi(tmp_path, rows_per_call):
    """An nvidia-smi that prints the next block of rows at each call."""
    for i, rows in enumerate(rows_per_call):
        (tmp_path / f"out{i}").write_text("\n".join(rows) + "\n")
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/bash\nn=$(cat {tmp_path}/n 2>/dev/null || echo 0)\necho $((n+1)) > {tmp_path}/n\n'
                      f'cat {tmp_path}/out$n\n')
    script.chmod(0o755)
    return str(script)


def test_nvidia_smi_total_energy_of_every_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(energy, "_nvml_counter", lambda: None)        # as on a node without pynvml
    smi = _fake_smi(tmp_path, [["71.20 W, 1000000.000 J", "70.00 W, 500.5 kJ"],
                               ["650.00 W, 1003500.000 J", "600.00 W, 502.0 kJ"]])
    with EnergyMeter(powercap=tmp_path / "none", smi=smi, gpu=True) as meter:
        pass
    [reading] = meter.readings
    assert reading.source == "nvidia-smi" and reading.joules == pytest.approx(3500 + 1500)
    assert "1250 W" in reading.how


def test_nothing_readable_gives_a_stated_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(energy, "_nvml_counter", lambda: None)
    smi = _fake_smi(tmp_path, [["[N/A], [N/A]"], ["[N/A], [N/A]"]])    # a GPU without the counter
    monkeypatch.setattr(energy, "cpu_seconds", iter([10.0, 14.0]).__next__)
    with EnergyMeter(powercap=tmp_path / "none", smi=smi, gpu=True, tdp_watts=100, cores=4) as meter:
        pass
    [reading] = meter.readings
    assert reading.source == "estimate" and not reading.measured and not meter.measured
    assert reading.joules == pytest.approx(4.0 * 100 / 4)
    assert "stated, not measured" in reading.how and "ESTIMATE" in reading.line(400)
    assert meter.missing == ["GPU: neither NVML nor nvidia-smi's total_energy_consumption answered"]


def test_kwh_and_co2e_with_a_stated_intensity():
    r = Reading("rapl", 7.2e6, 3600.0, "test")
    assert r.kwh == 2.0 and r.co2e_grams(433) == 866.0
    assert "at 433 g/kWh (measured" in r.line(433)
    with pytest.raises(BadInput, match="intensity"):
        r.co2e_grams(-1)
