"""benchmarks/checkpoint_done.py: the energy window against nvidia-smi's integrated power, the
steady rate, per-node save bandwidth, the 8b choice and the report, on recorded numbers (the
script's runs themselves are checked by its --cpu-smoke)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def done():
    sys.path.insert(0, str(BENCH))  # the script imports ckpt_runs beside it
    spec = importlib.util.spec_from_file_location("checkpoint_done", BENCH / "checkpoint_done.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("ckpt_runs", None)


def write_metrics(run: Path, rank: int, records: list[dict]) -> None:
    (run / "metrics").mkdir(parents=True, exist_ok=True)
    (run / "metrics" / f"rank-{rank:03d}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))


def test_energy_compares_the_loop_window_only(done) -> None:
    # GPU 3 draws 100 W from t=0; 1000 W from t=10 (the loop); nvidia-smi sees GPU 3 and 4.
    def counter(t: float) -> float:
        return 100 * t if t < 10 else 1000 + 1000 * (t - 10)

    # nvidia-smi prints board power; SmiEnergy integrates its readings into running joules.
    assert done.parse_smi("3, 100.00\n4, 7.5\n5, [N/A]\n") == {3: 100.0, 4: 7.5}
    smi, last = done.SmiEnergy(), None
    for t in range(0, 40):
        last = smi.add(float(t), {3: 100.0 if t < 10 else 1000.0, 4: 0.0}, last)
    # Trapezoids: the step from 100 W to 1000 W between t=9 and t=10 counts 550 J.
    assert smi.samples[10][1][3] == pytest.approx(900 + 550)
    samples = [(float(t), {3: counter(t), 4: 7.0}) for t in range(0, 40)]
    # The attempt started at 0; its start-up parts before the loop sum to 10 s; ended at 30.
    attempt = {"start": 0.0, "end": 30.0, "energy_kwh": 20_000 / 3.6e6,
               "startup_parts": {"start": 4.0, "model_build": 5.0, "other": 1.0,
                                 "first_step": 6.0}}
    check = done.energy_check({"attempts": [attempt]}, 0, samples, [3])
    assert check["window_s"] == pytest.approx(20.0)
    assert check["smi_kwh"] * 3.6e6 == pytest.approx(20_000)  # not the 1,000 J before the loop
    assert check["ratio"] == pytest.approx(1.0)
    late = done.energy_check({"attempts": [{**attempt, "end": 45.0}]}, 0, samples, [3])
    assert late["smi_kwh"] is None and "span" in late["why"]
    assert done.energy_check({"attempts": [{**attempt, "energy_kwh": None}]}, 0, samples,
                             [3]) is None


def test_steady_rate_and_per_node_saves(done, tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = [{"step": s, "loss": 1.0, "ts": 100.0 + s * 0.5} for s in range(10, 110, 10)]
    write_metrics(run, 0, [{"event": "layout", "tokens_per_step_per_gpu": 1000}, *steps,
                           {"event": "checkpoint", "step": 100, "bytes": 4e9, "write_s": 2.0,
                            "writer": "process"}])
    write_metrics(run, 1, [{"event": "checkpoint", "step": 100, "bytes": 4e9, "write_s": 4.0}])
    rate = done.steady(run, 20)
    assert rate["tokens_per_s"] == pytest.approx(80 * 1000 / 40)  # steps 20..100 over 40 s
    (save,) = done.saves(run)["saves"]
    assert save["bytes"] == 8e9 and save["gbps"] == pytest.approx(2.0)  # the slower rank's 4 s


def test_8b_keeps_fp32_only_where_state_and_checkpoint_fit(done, tmp_path: Path,
                                                           monkeypatch) -> None:
    run = done.Phases("cpu", tmp_path, tmp_path / "out", 10, 5, [])
    run.mode = "gpu"
    monkeypatch.setattr(done.shutil, "disk_usage", lambda _: type("U", (), {"free": 200e9}))
    run.gpus = [{"name": "H100", "memory_gb": 85.0}] * 4
    assert run.big_choice(4)[0] == []
    assert run.big_choice(2)[0] == ["train.master_weights=bf16"]  # 80 GB a GPU of 85
    run.gpus = [{"name": "H200", "memory_gb": 150.0}] * 2
    assert run.big_choice(2)[0] == []
    monkeypatch.setattr(done.shutil, "disk_usage", lambda _: type("U", (), {"free": 100e9}))
    assert run.big_choice(2)[0] == ["train.master_weights=bf16"]  # 96 GB checkpoint, 100 free


def test_report_states_ratios_and_targets(done, tmp_path: Path) -> None:
    base = {"host": "h", "date": "2026-11-28 05:00", "device": "NVIDIA H100", "steps": 2000,
            "warmup": 50, "together": True, "time_to_first_step_s": 24.0, "periodic_saves": 0,
            "goodput_parts": {"productive": 270.0}, "log": ["checkpoint interval auto: ..."]}
    phases = {
        "default": {**base, "tokens_per_s": 62_000.0, "goodput": 0.9, "final_save_s": 9.0,
                    "saves": [{"step": 2000, "bytes": 13.2e9, "write_s": 11.0, "gbps": 1.2}],
                    "energy": {"kwh": 0.0505, "smi_kwh": 0.05, "ratio": 1.01, "window_s": 280}},
        "none": {**base, "tokens_per_s": 62_500.0, "goodput": 0.92, "final_save_s": 0.0,
                 "saves": []},
        "resume": {**base, "model": "1b", "checkpoint_bytes": 13.2e9, "restore_gbps": 1.5,
                   "cold_first_step_s": 24.0, "resumed_first_step_s": 7.0,
                   "startup_ratio": 7 / 24, "cold_parts": {"start": 3.0, "first_step": 21.0},
                   "resumed_parts": {"start": 3.0, "first_step": 4.0},
                   "energy": {"kwh": 0.001, "smi_kwh": 0.0012, "ratio": 0.83, "window_s": 9}},
        "disk-h": {**base, "rows": [{"op": "write", "gbps": 1.5, "method": "O_DIRECT + fsync"},
                                    {"op": "read", "gbps": 2.0, "method": "O_DIRECT"}]},
    }
    for name, body in phases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    text = done.report(tmp_path)
    assert "| default (interval auto) | 62,000 | 0.9920 | 0.900 |" in text
    assert "steady >= 0.99: met; goodput >= 0.95: MISSED" in text
    assert "AT THE SAME TIME" in text
    assert "| 1b | 1 GPU | 13.2 | 1.20 | 0.80 | 1.50 | 0.75 | 1.50 / 2.00" in text
    assert "| 1b | 24.0 | 7.0 | 0.29 | met |" in text
    assert "| 1b default | 280 | 0.0505 | 0.0500 | 1.0100 | met |" in text
    assert "| 1b resumed | 9 | 0.0010 | 0.0012 | 0.8300 | MISSED |" in text
