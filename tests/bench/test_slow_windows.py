"""Slow windows of a measured run, each with its cause (``hpctrain.bench.slow_windows``).

Two ranks' metrics, windows of 5 steps up to 80, measured from step 10: one window held a
checkpoint, one a data stall, one a rank whose GPU waited for its CPU, one nothing the metrics
see; a window that held a profile but kept its pace is not listed. `bench model`'s summary
carries them, and compare.py prints one line each.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import DEMO
from hpctrain.bench.model import rank_metrics, result_row, summarise
from hpctrain.bench.slow_windows import slow_windows
from hpctrain.config import load_config

RATE = 1000.0
SLOW = {20: 900.0, 30: 920.0, 35: 910.0, 40: 800.0}  # 8-20% below the median of 1000


def _window(step: int, rank: int, waits: tuple[float, float]) -> dict:
    stall = step == 35 and rank == 1  # rank 1 waited 40 ms of a 0.5 s step for data
    behind = step == 30 and rank == 1  # rank 1's host barely waited: its GPU waited for it
    return {"ts": 1000.0 + step, "step": step, "loss": 2.0, "tokens_per_s": SLOW.get(step, RATE),
            "step_time_s": 0.5, "data_time_s": 0.04 if stall else 0.001,
            "host_wait_s": waits[behind], "mfu": 0.4, "mem_gb": 10.0}


def _write(run_dir: Path, waits: tuple[float, float] = (0.06, 0.001)) -> None:
    """Two ranks' metrics; ``waits``: a host's usual wait, and rank 1's at step 30."""
    for rank in range(2):
        rows = [_window(s, rank, waits) for s in range(5, 85, 5)]
        # A checkpoint saved after step 15's window: its time falls in the window ending at 20.
        rows.insert(3, {"ts": 1016.0, "event": "checkpoint_stall", "step": 15, "stall_s": 3.0})
        # A profile of steps 21-23, in a window that kept its pace.
        rows.insert(6, {"ts": 1024.0, "event": "profile", "first_step": 21, "last_step": 23})
        path = run_dir / "metrics" / f"rank-{rank:03d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _slow(run_dir: Path, first_step: int, last_step: int) -> list[dict]:
    lines = rank_metrics(run_dir, 2)
    windows = [[r for r in rank if "tokens_per_s" in r] for rank in lines]
    events = [r for rank in lines for r in rank if "tokens_per_s" not in r]
    return slow_windows(windows, events, first_step, last_step)


def test_each_slow_window_has_its_cause(tmp_path: Path) -> None:
    _write(tmp_path)
    found = {w["step"]: w for w in _slow(tmp_path, 10, 80)}
    assert sorted(found) == [20, 30, 35, 40]
    assert found[20]["cause"] == "events: checkpoint_stall"
    assert found[30]["cause"] == "rank 1 behind its CPU"
    assert found[30]["host_wait_s"] == [0.06, 0.001]
    assert found[35]["cause"] == "data wait" and found[35]["data_time_s"] == 0.04
    assert found[40]["cause"] == "not in the metrics (GPU or communication)"
    assert found[40]["below_median"] == 0.2
    # On a CPU every host wait is ~0 (the "device" never lags): no rank is singled out.
    cpu = tmp_path / "cpu"
    _write(cpu, waits=(2e-5, 1e-6))
    found = {w["step"]: w for w in _slow(cpu, 10, 80)}
    assert found[30]["cause"] == "not in the metrics (GPU or communication)"
    # Outside the measured span nothing is listed, however slow.
    assert _slow(tmp_path, 20, 25) == []


def test_bench_rows_carry_them_and_compare_prints_them(tmp_path: Path, compare) -> None:
    _write(tmp_path)
    result = summarise(tmp_path, 2, warmup_frac=0.1)
    row = result_row(result, load_config(DEMO, []))
    assert [w["step"] for w in row["slow_windows"]] == [20, 30, 35, 40]
    text = compare.slow_window_lines([{"layout": "1b-fsdp4", "tag": "", **row}])
    assert "- 1b-fsdp4: the window ending at step 30 ran 8.0% below the median: rank 1 " \
           "behind its CPU" in text
    assert compare.slow_window_lines([{"layout": "1b-1gpu", "slow_windows": []}]).endswith(
        "none more than 5% below the median")
