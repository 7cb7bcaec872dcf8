"""The bad-step guard through a pipeline: a NaN loss on the last stage skips the step on every
stage, exactly as one process skips it.

Two small launches side by side, both with ``HPCTRAIN_FAULTS=nan@step=2`` (the loss of step 2
is poisoned): one process, and PP2 x TP2 on 4 ranks (1F1B). If any stage applied its update the
weights would split from the one-process run's and so would the losses of steps 3 and 4.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rank_jobs import launch

from conftest import DEMO, QUIET, TINY
from hpctrain.observe.metrics import read_metrics

COMMON = [*TINY, "model.n_layers=4", *QUIET, "train.steps=4", "optim.schedule=constant",
          "checkpoint.async_save=false", "checkpoint.save_at_end=false",
          "checkpoint.interval=none", "train.micro_batch=4"]
FAULT = {"HPCTRAIN_FAULTS": "nan@step=2"}


def test_nan_step_is_skipped_on_every_stage(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    spec = {"config": DEMO, "common": COMMON, "out": str(runs)}
    one = {**spec, "jobs": [{"name": "one", "overrides": ["parallel.strategy=none"]}]}
    pipe = {**spec, "jobs": [{"name": "pp2_tp2", "overrides": [
        "parallel.strategy=none", "parallel.pp=2", "parallel.tp=2",
        "parallel.pp_microbatches=2"]}]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [pool.submit(launch, 1, one, tmp_path / "l1", 600, FAULT),
                pool.submit(launch, 4, pipe, tmp_path / "l4", 600, FAULT)]
        for future in done:
            future.result()

    def records(name: str, rank: int) -> list[dict]:
        return read_metrics(runs / name / "metrics" / f"rank-{rank:03d}.jsonl")

    ref = [r["loss"] for r in records("one", 0) if "loss" in r]
    assert math.isnan(ref[1]) and all(math.isfinite(x) for x in ref[2:])
    for rank in range(4):
        recs = records("pp2_tp2", rank)
        assert [r["step"] for r in recs if r.get("event") == "bad_steps"] == [2]
        losses = [r["loss"] for r in recs if "loss" in r]
        assert math.isnan(losses[1])
        for got, want in zip(losses[2:], ref[2:], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, losses, ref)
