"""Checkpoint interval, budget arithmetic, the parallel planner's textbook cases, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.models import PRESETS, ModelArgs
from hpctrain.plan.budget import plan_budget, tokens_per_s_from_run
from hpctrain.plan.interval import daly_interval, job_mttf, young_interval
from hpctrain.plan.memory_options import gpu_memory_bytes
from hpctrain.plan.parallel import plan_parallel


def test_daly_worked_example() -> None:
    # FIELD_NOTES: δ = 5 min, M = 24 h -> 116.7 min (Young: 120 min).
    assert daly_interval(5, 24 * 60) == pytest.approx(116.7, abs=0.05)
    assert young_interval(5, 24 * 60) == pytest.approx(120.0)
    assert daly_interval(300, 100) == 100  # δ >= 2M: checkpoint every M


def test_job_mttf() -> None:
    # ~50k GPU-hours per GPU on 16,384 GPUs: one failure every ~3.05 h (Llama 3 saw ~3.1 h).
    assert job_mttf(50_000, 16_384) == pytest.approx(3.05, abs=0.01)
    with pytest.raises(ConfigError):
        job_mttf(50_000, 0)


def test_budget_arithmetic() -> None:
    # 1e12 tokens at 10k tok/s/GPU on 100 GPUs = 1e6 s, +10% = 1.1e6 s = 30,555.6 GPU-hours.
    b = plan_budget(1e12, 10_000, 100, margin=0.10, warn_gpu_hours=20_000)
    assert b.walltime_s == pytest.approx(1.1e6)
    assert b.gpu_hours == pytest.approx(1.1e6 / 3600 * 100)
    assert b.warning and "30,556" in b.warning
    assert plan_budget(1e9, 10_000, 1, margin=0.2).warning is None


def test_budget_reads_pilot_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for rank, rates in ((0, [1, 100, 100, 120, 80]), (1, [1, 200, 200, 200, 200])):
        lines = [json.dumps({"step": 10 * (i + 1), "tokens_per_s": r})
                 for i, r in enumerate(rates)]
        (metrics / f"rank-{rank:03d}.jsonl").write_text("\n".join(lines) + "\n")
    # Steps > 0.4 * 50 = 20 are kept: medians 100 and 200, mean 150.
    assert tokens_per_s_from_run(tmp_path) == pytest.approx(150.0)
    with pytest.raises(ConfigError):
        tokens_per_s_from_run(tmp_path / "nothing")


H100 = gpu_memory_bytes("h100")


def test_model_that_fits_one_gpu_gets_data_parallel() -> None:
    plan = plan_parallel(PRESETS["125m"], gpus_per_node=8, nodes=2, gpu_bytes=H100)
    assert (plan.strategy, plan.dp, plan.tp, plan.pp) == ("ddp", 16, 1, 1)
    assert 2 <= len(plan.explanation) <= 3


def test_model_too_big_for_one_gpu_is_sharded_or_split() -> None:
    """8b on 4 nodes: plain DDP cannot hold it; the winner shards (FSDP) or splits it (TP/PP)
    and keeps tensor parallelism inside a node."""
    plan = plan_parallel(PRESETS["8b"], gpus_per_node=8, nodes=4, gpu_bytes=H100)
    assert plan.strategy == "fsdp" and plan.memory.fits
    assert plan.dp * plan.tp * plan.pp == 32 and 8 % plan.tp == 0


def test_model_that_fits_no_node_gets_tensor_and_pipeline_parallelism() -> None:
    big = ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                    vocab_size=128256)  # Llama-3.1-405B shape
    plan = plan_parallel(big, gpus_per_node=8, nodes=16, gpu_bytes=H100)
    assert plan.tp > 1 and plan.pp > 1 and plan.tp * plan.pp * plan.dp == 128
    assert plan.memory.fits
    assert "inside each node" in plan.explanation[0]


def test_cli_plan_commands(capsys) -> None:
    main(["plan", "interval", "--save-min", "5", "--mttf-h", "24"])
    main(["plan", "memory", "--model", "1b", "--strategy", "fsdp", "--gpus", "4",
          "--micro-batch", "4", "--gpu", "h100"])
    main(["plan", "budget", "--tokens", "1T", "--tokens-per-s", "10000", "--gpus", "100"])
    out = capsys.readouterr().out
    assert "Daly:  checkpoint every 116.7 min" in out
    assert "fits:" in out and "peak" in out
    assert "GPU-hours" in out and "WARNING" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "memory", "model.size=3b"], "is not a known model size"),
    (["plan", "memory", "model.size=1b", "--gpu", "v100x"], "unknown GPU"),
    (["plan", "budget", "--tokens", "lots", "--tokens-per-s", "1", "--gpus", "1"],
     "not a count"),
    (["plan", "interval", "--save-min", "5"], "no MTTF"),
])
def test_cli_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
