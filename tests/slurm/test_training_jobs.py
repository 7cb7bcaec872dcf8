"""hpctrain's preemption protocol against a real Slurm: signal → checkpoint → requeue → resume,
and the goodput of a run requeued into a second allocation.

The batch scripts are the ones `hpctrain sbatch` generates; ranks are `srun` tasks on CPU (gloo).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from hpctrain.checkpoint.manifest import read_manifest, verify_files
from hpctrain.observe.goodput import PARTS

from .jobs import PREEMPT_STEPS, REPO, ReferenceLosses, diagnosis, exit_info, script, wait_for_steps


@pytest.mark.slow
def test_signal_checkpoint_requeue_resume_exact(slurm_cluster, tmp_path: Path,
                                                reference: ReferenceLosses) -> None:
    steps = PREEMPT_STEPS
    expected = reference.preemption()  # (started by test_cluster.py where that runs first)
    path = script(tmp_path, "preempt", [f"train.steps={steps}", "parallel.strategy=ddp"],
                  pause_at=6, tasks_per_node=2, time="10:00")
    job = slurm_cluster.sbatch(path, cwd=REPO)
    run_dir = tmp_path / "runs" / f"preempt-{job}"
    wait_for_steps(slurm_cluster, job, run_dir, 5)
    slurm_cluster.scancel(job, signal="USR2")  # to every task of the step, as --signal does
    state = slurm_cluster.wait(job, timeout=240)
    log = (tmp_path / "logs" / f"preempt-{job}.out").read_text()
    info = slurm_cluster.job_info(job)
    assert state == "COMPLETED", diagnosis(slurm_cluster, job, run_dir)
    assert info["RestartCnt"] == "1"
    assert "preempted by SIGUSR2" in log
    assert "resumed from step-" in log
    done = exit_info(run_dir)
    assert done["exit_code"] == 0 and done["extra"]["steps"] == steps
    # The preempted-and-requeued run ends exactly where an uninterrupted one does.
    assert done["extra"]["final_loss"] == expected.result()


@pytest.mark.slow
def test_walltime_signal_reaches_the_ranks(slurm_cluster, tmp_path: Path) -> None:
    # A real --time with --signal=USR2@100: Slurm signals ~20 s in (it may be up to a minute
    # late). max_requeues=0: checkpoint and stop, so the job ends instead of looping. Each step
    # sleeps 0.2 s meanwhile, so the wait leaves the cores to the other tests.
    path = script(tmp_path, "walltime", ["train.steps=1000000", "checkpoint.max_requeues=0",
                                         "parallel.strategy=none"],
                  time="2", signal_lead_s=100, slow_s=0.2)
    job = slurm_cluster.sbatch(path, cwd=REPO)
    start = time.monotonic()
    state = slurm_cluster.wait(job, timeout=180)
    run_dir = tmp_path / "runs" / f"walltime-{job}"
    log = (tmp_path / "logs" / f"walltime-{job}.out").read_text()
    info = exit_info(run_dir)
    assert state == "FAILED", log[-3000:]  # exit 75: preempted, not completed
    assert slurm_cluster.job_info(job)["ExitCode"].startswith("75:"), log[-3000:]
    assert info["exit_code"] == 75 and "preempted by SIGUSR2" in info["reason"]
    assert "reached checkpoint.max_requeues" in info["extra"]["requeue"]
    assert time.monotonic() - start < 120, "the signal came after the time limit"
    ckpt = run_dir / "checkpoints" / info["last_checkpoint"]
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest["files"], sorted(manifest["files"]))


@pytest.mark.slow
def test_array_task_requeues_only_itself(slurm_cluster, tmp_path: Path) -> None:
    path = script(tmp_path, "arr", ["train.steps=40", "parallel.strategy=none"],
                  pause_at=6, fault_task=1, time="10:00", array="0-1")
    job = slurm_cluster.sbatch(path, cwd=REPO)
    run_1 = tmp_path / "runs" / f"arr-{job}_1"
    wait_for_steps(slurm_cluster, f"{job}_1", run_1, 5)
    slurm_cluster.scancel(f"{job}_1", signal="USR2")
    assert slurm_cluster.wait(f"{job}_1", timeout=240) == "COMPLETED"
    assert slurm_cluster.wait(f"{job}_0", timeout=240) == "COMPLETED"
    assert slurm_cluster.job_info(f"{job}_0")["RestartCnt"] == "0"
    assert slurm_cluster.job_info(f"{job}_1")["RestartCnt"] == "1"
    assert exit_info(tmp_path / "runs" / f"arr-{job}_0")["extra"]["steps"] == 40
    assert exit_info(run_1)["extra"]["steps"] == 40
    # Task 1's goodput holds both of its attempts, in two allocations, found from the run
    # directory alone: nothing lost, and no restart gap (it held no devices while queued).
    account = json.loads((run_1 / "goodput.json").read_text())
    first, second = account["attempts"]
    assert (first["exit_code"], first["resumed_from_step"], first["last_step"]) == (75, None, 6)
    assert (second["exit_code"], second["resumed_from_step"], second["last_step"]) == (0, 6, 40)
    parts = account["parts"]
    assert set(parts) == set(PARTS) and account["lost_steps"] == 0
    assert parts["restart_gap"] == 0 and parts["lost_work"] == 0
    # The queue time between the allocations is not in the wall time.
    assert second["start"] - first["end"] > 5
    held = sum(a["end"] - a["start"] for a in account["attempts"])
    assert math.isclose(account["wall_s"], held, rel_tol=0.02)
    assert math.isclose(sum(parts.values()), account["wall_s"], rel_tol=0.02)
    log = (tmp_path / "logs" / f"arr-{job}_1.out").read_text()
    assert "goodput" in log and "over 2 attempts" in log, log[-3000:]
