"""Energy per run: EnergyMeter's running total, goodput's kWh / tokens per joule / CO2e per
attempt and across attempts, and a CPU training run metered through a stand-in NVML shown by
``hpctrain runs`` and the report.

The stand-in is test_power's fake ``pynvml`` module, injected as ``sys.modules["pynvml"]`` (the
seam observe/power.py reads it through); the real module runs on the GPU machine.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console
from test_power import FakeClock, fake_nvml

from conftest import DEMO, QUIET, TINY
from hpctrain.observe import power
from hpctrain.observe.goodput import GoodputClock, compute_goodput, summary
from hpctrain.observe.power import EnergyMeter


@pytest.mark.parametrize("counter", [True, False], ids=["energy-counter", "power-only"])
def test_meter_keeps_a_running_total(counter: bool) -> None:
    """2 GPUs at 300 W for 10 s: 6 kJ from the counters or from integrated power; no samples
    kept; a counter that goes back (driver reload) falls back to power for that interval."""
    clock = FakeClock()
    nvml = fake_nvml(lambda i, t: 300.0, clock, energy=counter)
    meter = EnergyMeter(nvml=nvml, clock=clock)
    for _ in range(11):
        meter.sample()
        clock.t += 1.0
    assert meter.joules() == pytest.approx(6000.0) and meter.samples == []
    if counter:
        nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: 0.0  # reset
        meter.sample()
        assert meter.joules() == pytest.approx(6600.0)


def test_rank_0_meters_the_gpus_of_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPUs the node's ranks use (cuda:<local rank>, or GPU 0 of each task where Slurm
    shows each one GPU), the lone rank's own GPU, none on a CPU run."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert power.energy_devices(torch.device("cuda", 0), 4) == [0, 1, 2, 3]
    assert power.energy_devices(torch.device("cuda", 3), 1) == [3]  # run.device=cuda:3
    assert power.energy_devices(torch.device("cpu"), 2) == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert power.energy_devices(torch.device("cuda", 0), 4) == [0]


def _attempt(run: Path, clock: FakeClock, *, watts: float, seconds: int, steps: int,
             grid: float) -> None:
    """One attempt of rank 0 metering 1 of the job's 4 GPUs at ``watts``."""
    meter = EnergyMeter(nvml=fake_nvml(lambda i, t: watts, clock, gpus=1), clock=clock)
    goodput = GoodputClock.open(run)
    goodput.started(None)
    goodput.meter_energy(meter, tokens_per_step=1000, gpus=4, grid_gco2_per_kwh=grid)
    meter.sample()
    for step in range(1, steps + 1):
        clock.t += seconds / steps
        meter.sample()
        goodput.step_done(step, writing=False)
    goodput.finish(exit_code=0)


def test_goodput_energy_per_attempt_and_across_attempts(tmp_path: Path) -> None:
    """kWh scaled to all the job's GPUs, CO2e at each attempt's own grid intensity, summed."""
    clock = FakeClock()
    _attempt(tmp_path, clock, watts=500.0, seconds=36, steps=3, grid=500.0)
    _attempt(tmp_path, clock, watts=250.0, seconds=36, steps=2, grid=100.0)
    account = json.loads((tmp_path / "goodput.json").read_text())
    assert account == compute_goodput(tmp_path)
    first, second = account["attempts"]
    # 500 W x 36 s x 4 GPUs = 72 kJ = 0.02 kWh; 0.01 kWh at half the power.
    assert first["energy_kwh"] == pytest.approx(0.02)
    assert second["energy_kwh"] == pytest.approx(0.01)
    assert first["co2e_kg"] == pytest.approx(0.01) and second["co2e_kg"] == pytest.approx(0.001)
    assert (first["tokens"], second["tokens"]) == (3000, 2000)
    energy = account["energy"]
    assert energy["kwh"] == pytest.approx(0.03) and energy["co2e_kg"] == pytest.approx(0.011)
    assert energy["tokens_per_j"] == pytest.approx(5000 / 108_000)
    assert summary(account).endswith("; GPUs 0.03 kWh, 0.0463 tokens/J, 0.011 kg CO2e")
    assert (energy["gpus"], energy["gpus_sampled"], energy["attempts_measured"]) == (4, 1, 2)


def test_cpu_run_metered_through_a_stand_in_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 no_faults) -> None:
    """An in-process run whose rank 0 meters one (fake) GPU: goodput.json, `runs` and the
    report show its kWh, tokens per joule and CO2e."""
    from hpctrain.config import load_config
    from hpctrain.observe.report import build_report
    from hpctrain.observe.rundata import load_run
    from hpctrain.observe.runs import print_runs, runs_table
    from hpctrain.train.job import run_training

    t0 = time.time()
    monkeypatch.setitem(__import__("sys").modules, "pynvml",
                        fake_nvml(lambda i, t: 200.0, lambda: time.time() - t0, gpus=1))
    monkeypatch.setattr(power, "energy_devices", lambda device, local: [0])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(DEMO, [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4",
                             "train.steps=4", "checkpoint.interval=none",
                             "checkpoint.save_at_end=false", "metrics.grid_gco2_per_kwh=300",
                             f"run.out_dir={tmp_path}", "run.name=metered"])
    run_training(cfg)
    wall = time.time() - t0
    energy = json.loads((tmp_path / "metered" / "goodput.json").read_text())["energy"]
    assert energy["tokens"] == 4 * 4 * 32  # steps x global batch x seq_len
    assert 0 < energy["joules"] <= 200.0 * wall
    assert energy["tokens_per_j"] == pytest.approx(energy["tokens"] / energy["joules"])
    assert energy["co2e_kg"] == pytest.approx(energy["kwh"] * 0.3)

    row = runs_table(tmp_path, squeue="/nonexistent/squeue")[0]
    assert row["kwh"] == energy["kwh"] and row["co2e_kg"] == energy["co2e_kg"]
    out = io.StringIO()
    print_runs([row], Console(file=out, width=200))
    assert "TOKENS/J" in out.getvalue() and f"{energy['tokens_per_j']:.4g}" in out.getvalue()
    html = build_report([load_run(tmp_path / "metered")], tmp_path / "report.html")
    assert f"{energy['kwh']:.4g} kWh on 1 GPU(s)" in html and "kg CO2e at 300 g/kWh" in html


def test_a_task_run_counts_its_own_tokens_per_step(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    no_faults) -> None:
    """A task's tokens are its samples x tokens_per_sample, not x data.seq_len (256 by
    default, meaningless for an image model)."""
    import sys

    import torch
    from torch import nn

    import hpctrain
    from hpctrain.task import Task

    t0 = time.time()
    monkeypatch.setitem(sys.modules, "pynvml",
                        fake_nvml(lambda i, t: 200.0, lambda: time.time() - t0, gpus=1))
    monkeypatch.setattr(power, "energy_devices", lambda device, local: [0])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    x = torch.randn(16, 3)
    task = Task(model=lambda: nn.Linear(3, 1), data=torch.utils.data.TensorDataset(x, x[:, :1]),
                loss=nn.functional.mse_loss, flops_per_sample=1.0, tokens_per_sample=3)
    hpctrain.fit(task, overrides=[*QUIET, "train.micro_batch=4", "train.steps=2",
                                  "checkpoint.interval=none", "checkpoint.save_at_end=false",
                                  f"run.out_dir={tmp_path}", "run.name=task"])
    energy = json.loads((tmp_path / "task" / "goodput.json").read_text())["energy"]
    assert energy["tokens"] == 2 * 4 * 3  # steps x samples per step x tokens_per_sample
