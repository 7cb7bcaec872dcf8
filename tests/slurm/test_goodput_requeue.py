"""Goodput of a run preempted and requeued by a real Slurm: two attempts in two allocations.

The job (1 CPU task, the script ``hpctrain sbatch`` generates) is held before step 6, gets
SIGUSR2 (``scancel --signal``, as ``--signal`` sends it), checkpoints step 6, exits 75 and is
requeued; the second allocation resumes from step 6 and finishes. ``goodput.json`` then holds
both attempts, found from the run directory alone: nothing lost, and no restart gap (the job
held no devices while it waited in the queue).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from hpctrain.launch.sbatch import SbatchParams, create_log_dir, render_sbatch
from hpctrain.observe.goodput import PARTS
from hpctrain.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
TINY = ["run.device=cpu", "data.source=stdlib", "data.max_bytes=300000", "data.seq_len=64",
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "train.micro_batch=2", "train.precision=fp32",
        "parallel.strategy=none", "optim.warmup_steps=2", "metrics.log_every=1",
        "metrics.progress=false", "checkpoint.interval=none", "preempt.check_every=1",
        f"train.steps={STEPS}"]


def _script(tmp: Path) -> Path:
    """The generated batch script, its python holding step 6 of the first run until the signal
    lands (60 s at most)."""
    python = tmp / "python.sh"
    python.write_text("#!/bin/bash\n[ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] && "
                      "export HPCTRAIN_FAULTS='hang@step=6,seconds=60'\n"
                      f'exec {sys.executable} "$@"\n')
    os.chmod(python, 0o755)
    params = SbatchParams(config="configs/demo.yaml", workdir=str(REPO), python=str(python),
                          overrides=[*TINY, f"run.out_dir={tmp / 'runs'}", "run.name=goodput"],
                          job_name="goodput", log_dir=str(tmp / "logs"), time="10:00")
    path = tmp / "goodput.sh"
    path.write_text(render_sbatch(params))
    create_log_dir(params)
    return path


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "rank-000.jsonl"
    return sum(1 for r in read_metrics(path) if "loss" in r) if path.is_file() else 0


@pytest.mark.slow
def test_requeued_run_accounts_both_allocations(slurm_cluster, tmp_path: Path) -> None:
    job = slurm_cluster.sbatch(_script(tmp_path), cwd=REPO)
    run_dir = tmp_path / "runs" / f"goodput-{job}"
    deadline = time.monotonic() + 240
    while _steps(run_dir) < 5:
        state = slurm_cluster.job_info(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), slurm_cluster.diagnosis(job)
        assert time.monotonic() < deadline, "the job never logged 5 steps"
        time.sleep(0.3)
    slurm_cluster.scancel(job, signal="USR2")
    state = slurm_cluster.wait(job, timeout=240)
    log = (tmp_path / "logs" / f"goodput-{job}.out").read_text()
    assert state == "COMPLETED" and slurm_cluster.job_info(job)["RestartCnt"] == "1", log[-3000:]
    account = json.loads((run_dir / "goodput.json").read_text())
    first, second = account["attempts"]
    assert (first["exit_code"], first["resumed_from_step"], first["last_step"]) == (75, None, 6)
    assert (second["exit_code"], second["resumed_from_step"], second["last_step"]) == \
        (0, 6, STEPS)
    parts = account["parts"]
    assert set(parts) == set(PARTS) and account["lost_steps"] == 0
    assert parts["restart_gap"] == 0 and parts["lost_work"] == 0
    # The queue time between the allocations is not in the wall time.
    assert second["start"] - first["end"] > 5
    held = sum(a["end"] - a["start"] for a in account["attempts"])
    assert math.isclose(account["wall_s"], held, rel_tol=0.02)
    assert math.isclose(sum(parts.values()), account["wall_s"], rel_tol=0.02)
    assert "goodput" in log and "over 2 attempts" in log
