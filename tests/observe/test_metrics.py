"""Per-rank JSONL metrics: fields, appending, non-finite values."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from hpctrain.observe.metrics import MetricsWriter, read_metrics
from hpctrain.runtime.env import detect_env
from hpctrain.runtime.rundir import RunDir


def test_records_get_ts_rank_host(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    env = replace(detect_env({}), rank=2, hostname="gpu07")
    with MetricsWriter(run, env) as metrics:
        metrics.write({"step": 1, "loss": 3.5})
        # flushed per line: readable before close
        assert len(read_metrics(run.rank_metrics(2))) == 1
    (record,) = read_metrics(tmp_path / "metrics" / "rank-002.jsonl")
    assert record["step"] == 1 and record["loss"] == 3.5
    assert record["rank"] == 2 and record["host"] == "gpu07"
    assert record["ts"] > 0


def test_resume_appends(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    env = detect_env({})
    with MetricsWriter(run, env) as metrics:
        metrics.write({"step": 1})
    with MetricsWriter(run, env) as metrics:
        metrics.write({"step": 2})
    assert [r["step"] for r in read_metrics(run.rank_metrics(0))] == [1, 2]


def test_non_finite_values_stay_valid_json(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    with MetricsWriter(run, detect_env({})) as metrics:
        metrics.write({"loss": math.nan, "grad_norm": math.inf, "x": -math.inf})
    line = run.rank_metrics(0).read_text().splitlines()[0]
    raw = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert (raw["loss"], raw["grad_norm"], raw["x"]) == ("nan", "inf", "-inf")
    (record,) = read_metrics(run.rank_metrics(0))
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf


def test_truncated_last_line_is_skipped_and_resume_starts_fresh(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    env = detect_env({})
    path = run.rank_metrics(0)
    path.parent.mkdir(parents=True)
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # killed mid-write
    with MetricsWriter(run, env) as metrics:
        metrics.write({"step": 3})
    assert [r["step"] for r in read_metrics(path)] == [1, 3]
