"""Cost, energy and CO2e of a planned run against worked examples, and the budget CLI's inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.plan.budget import from_bench, plan_budget, plan_energy


def test_worked_example_from_watts() -> None:
    # 1T tokens, 8,600 tok/s/GPU, 256 GPUs, 15% margin (the budget.py docstring).
    b = plan_budget(1e12, 8600, 256, margin=0.15)
    e = plan_energy(b, price_per_gpu_hour=2.5, gpu_watts=700, grid_gco2_per_kwh=400, pue=1.2)
    gpu_hours = 1e12 / 8600 / 3600 * 1.15
    assert b.gpu_hours == pytest.approx(gpu_hours)
    assert e.cost == pytest.approx(92_861.76, abs=0.01)
    assert e.gpu_kwh == pytest.approx(26_001.29, abs=0.01)
    assert e.site_kwh == pytest.approx(26_001.29 * 1.2, abs=0.01)
    assert e.co2e_kg == pytest.approx(12_480.62, abs=0.01)


def test_round_numbers_from_joules_per_token() -> None:
    # 3.6e9 tokens at 1,000 tok/s on one GPU = 1,000 GPU-hours (no margin).
    b = plan_budget(3.6e9, 1000, 1, margin=0.0)
    assert b.gpu_hours == pytest.approx(1000)
    e = plan_energy(b, price_per_gpu_hour=2.0, gpu_watts=500, grid_gco2_per_kwh=400)
    assert (e.cost, e.gpu_kwh, e.site_kwh, e.co2e_kg) == pytest.approx((2000, 500, 500, 200))
    # 0.5 J/token: 1.8e9 J = 500 kWh; the margin (re-done work after restarts) scales it too.
    e = plan_energy(b, joules_per_token=0.5, grid_gco2_per_kwh=400)
    assert (e.cost, e.gpu_kwh, e.co2e_kg) == pytest.approx((None, 500, 200))
    b10 = plan_budget(3.6e9, 1000, 1, margin=0.1)
    assert plan_energy(b10, joules_per_token=0.5).gpu_kwh == pytest.approx(550)


@pytest.mark.parametrize("kwargs, message", [
    (dict(grid_gco2_per_kwh=400), "needs the energy"),
    (dict(gpu_watts=700, joules_per_token=0.5), "both"),
    (dict(gpu_watts=-1), ">= 0"),
    (dict(gpu_watts=700, pue=0.9), "PUE"),
])
def test_energy_input_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_energy(plan_budget(1e9, 1000, 1), **kwargs)


def _bench_dir(tmp_path: Path, jpt: float | None) -> Path:
    d = tmp_path / "model-bench"
    d.mkdir()
    rows = [{"tokens_per_s_per_gpu": 1000.0, "joules_per_token": jpt}]
    (d / "model.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    return d


def test_budget_cli_from_bench_uses_measured_energy(tmp_path: Path, capsys) -> None:
    d = _bench_dir(tmp_path, 0.5)
    assert from_bench(d) == (1000.0, 0.5)
    main(["plan", "budget", "--tokens", "3.6B", "--from-bench", str(d), "--gpus", "1",
          "--margin", "0", "--price-per-gpu-hour", "2", "--grid-gco2-per-kwh", "400",
          "--pue", "1.5"])
    out = capsys.readouterr().out
    assert "1,000 GPU-hours" in out and "cost 2,000" in out
    assert "energy 500 kWh on the GPUs (0.5 J/token" in out and "750 kWh with PUE 1.5" in out
    assert "0.30 t CO2e" in out


@pytest.mark.parametrize("extra, message", [
    (["--tokens-per-s", "1000", "--from-bench", "X"], "exactly one"),
    (["--tokens-per-s", "1000", "--grid-gco2-per-kwh", "400"], "needs the energy"),
    (["--from-bench", "nowhere"], "no bench model results"),
])
def test_budget_cli_errors(extra: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "budget", "--tokens", "1B", "--gpus", "1", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
