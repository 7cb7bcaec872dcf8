"""hpctrain's preemption protocol against a real Slurm: signal → checkpoint → requeue → resume,
and the goodput of a run requeued into a second allocation.

The batch scripts are the ones `hpctrain sbatch` generates; ranks are `srun` tasks on CPU (gloo).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from hpctrain.checkpoint.manifest import read_manifest, verify_files
from hpctrain.observe.goodput import PARTS

from .jobs import PREEMPT_STEPS, REPO, ReferenceLosses, diagnosis, exit_info, script, wait_for_steps


@dataclass
class Job:
    """A job of this module: its id and the folder of its script, logs and runs."""

    id: str
    tmp: Path

    def run_dir(self, name: str, suffix: str = "") -> Path:
        """The run directory of the run `name` (``<name>-<job id><suffix>``)."""
        return self.tmp / "runs" / f"{name}-{self.id}{suffix}"

    def log(self, name: str, suffix: str = "") -> str:
        """The job's output file."""
        return (self.tmp / "logs" / f"{name}-{self.id}{suffix}.out").read_text()


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """The module's three jobs, submitted together as it starts, and the two preemptions sent
    (SIGUSR2 once a job logged 5 steps; its pause holds step 6 until then): each job mostly
    waits (for its signal, its requeue, the time limit's signal) and the waits overlap (the node
    has CPUs for all of them, tests/slurm/conftest.py). The tests check how each one ended."""
    specs = {
        # A real time limit with --signal=USR2@100, the limit cut to 2 minutes once the job
        # trains (below). max_requeues=0: checkpoint and stop, so the job ends instead of
        # looping. Each step sleeps 0.2 s meanwhile, so the wait leaves the cores to the others.
        "walltime": (["train.steps=1000000", "checkpoint.max_requeues=0",
                      "parallel.strategy=none"],
                     {"time": "10:00", "signal_lead_s": 100, "slow_s": 0.2}),
        "preempt": ([f"train.steps={PREEMPT_STEPS}", "parallel.strategy=ddp"],
                    {"pause_at": 6, "tasks_per_node": 2, "time": "10:00"}),
        "arr": (["train.steps=40", "parallel.strategy=none"],
                {"pause_at": 6, "fault_task": 1, "time": "10:00", "array": "0-1"}),
    }
    made = {}
    for name, (overrides, params) in specs.items():
        tmp = tmp_path_factory.mktemp(name)
        made[name] = Job(slurm_cluster.sbatch(script(tmp, name, overrides, **params), cwd=REPO),
                         tmp)
    # The signal is due 20 s in, and "may be sent up to 60 s earlier" (sbatch(1)): slurmctld
    # checks time limits every 30 s. Submitted with 2 minutes, it came at once when a check
    # fell as the task started, and killed it before Python could catch it (1 run in 6).
    walltime = made["walltime"]
    wait_for_steps(slurm_cluster, walltime.id, walltime.run_dir("walltime"), 1)
    slurm_cluster.run("scontrol", "update", f"JobId={walltime.id}", "TimeLimit=2")
    for target, run_dir in ((made["preempt"].id, made["preempt"].run_dir("preempt")),
                            (f"{made['arr'].id}_1", made["arr"].run_dir("arr", "_1"))):
        wait_for_steps(slurm_cluster, target, run_dir, 5)
        slurm_cluster.scancel(target, signal="USR2")  # to every task of the step, as --signal
    return made


@pytest.mark.slow
def test_signal_checkpoint_requeue_resume_exact(slurm_cluster, jobs: dict[str, Job],
                                                reference: ReferenceLosses) -> None:
    expected = reference.preemption()  # (started by test_cluster.py where that runs first)
    job = jobs["preempt"]
    run_dir = job.run_dir("preempt")
    state = slurm_cluster.wait(job.id, timeout=240)
    log = job.log("preempt")
    info = slurm_cluster.job_info(job.id)
    assert state == "COMPLETED", diagnosis(slurm_cluster, job.id, run_dir)
    assert info["RestartCnt"] == "1"
    assert "preempted by SIGUSR2" in log
    assert "resumed from step-" in log
    done = exit_info(run_dir)
    assert done["exit_code"] == 0 and done["extra"]["steps"] == PREEMPT_STEPS
    # The preempted-and-requeued run ends exactly where an uninterrupted one does.
    assert done["extra"]["final_loss"] == expected.result()


@pytest.mark.slow
def test_array_task_requeues_only_itself(slurm_cluster, jobs: dict[str, Job]) -> None:
    job = jobs["arr"].id
    run_1 = jobs["arr"].run_dir("arr", "_1")
    assert slurm_cluster.wait(f"{job}_1", timeout=240) == "COMPLETED"
    assert slurm_cluster.wait(f"{job}_0", timeout=240) == "COMPLETED"
    assert slurm_cluster.job_info(f"{job}_0")["RestartCnt"] == "0"
    assert slurm_cluster.job_info(f"{job}_1")["RestartCnt"] == "1"
    assert exit_info(jobs["arr"].run_dir("arr", "_0"))["extra"]["steps"] == 40
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
    log = jobs["arr"].log("arr", "_1")
    assert "goodput" in log and "over 2 attempts" in log, log[-3000:]


@pytest.mark.slow
def test_walltime_signal_reaches_the_ranks(slurm_cluster, jobs: dict[str, Job]) -> None:
    job = jobs["walltime"]
    state = slurm_cluster.wait(job.id, timeout=180)
    run_dir = job.run_dir("walltime")
    log = job.log("walltime")
    info = exit_info(run_dir)
    record = slurm_cluster.job_info(job.id)
    assert state == "FAILED", log[-3000:]  # exit 75: preempted, not completed
    assert record["ExitCode"].startswith("75:"), log[-3000:]
    assert info["exit_code"] == 75 and "preempted by SIGUSR2" in info["reason"]
    assert "reached checkpoint.max_requeues" in info["extra"]["requeue"]
    ran = (datetime.fromisoformat(record["EndTime"])
           - datetime.fromisoformat(record["StartTime"])).total_seconds()
    assert ran < 120, f"the signal came after the time limit ({ran:.0f} s)"
    ckpt = run_dir / "checkpoints" / info["last_checkpoint"]
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest["files"], sorted(manifest["files"]))
