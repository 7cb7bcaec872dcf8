"""`hpctrain tune`: candidates from the memory model, measured, the fastest written out.

Candidate generation is checked in-process (no run); one end-to-end CLI run on the CPU trains
two real candidates plus one injected failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
# The conftest TINY model: ~50k parameters, 32-token samples, a 200 kB corpus.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "data.seq_len=32", "data.max_bytes=200000"]


def test_bench_model_lets_one_replica_span_several_ranks(monkeypatch, tmp_path: Path) -> None:
    """tp 2 with strategy none on 2 ranks is one replica, not 2 ranks without a strategy."""
    from hpctrain.bench import model

    seen = []

    def fake_measure(path, run_dir, nproc, **kw):
        seen.append(nproc)
        return _result(nproc), 1.0

    monkeypatch.setattr(model, "measure", fake_measure)
    row, _ = model.run_model_bench(DEMO, [*TINY, "parallel.strategy=none", "parallel.tp=2"],
                                   nproc=2, out=tmp_path, steps=4, log_every=2)
    assert seen == [2] and row["ranks"] == 2
    with pytest.raises(ConfigError, match="strategy=none"):  # 2 replicas need a strategy
        model.run_model_bench(DEMO, [*TINY, "parallel.strategy=none"], nproc=2, out=tmp_path,
                              steps=4, log_every=2)


def _result(ranks: int):
    from hpctrain.bench.model import ModelResult

    return ModelResult(ranks=ranks, tokens_per_s_per_gpu=100.0, mfu=None, hfu=None,
                       peak_mem_gb=0.5, step_time_s=0.1, data_time_frac=0.0, final_loss=5.0,
                       measured_steps=(2, 4), measured_span_s=(0.0, 1.0))
