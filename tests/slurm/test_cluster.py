"""Smoke tests of the real single-node Slurm cluster (``slurm_cluster`` in conftest.py).

    .venv/bin/pytest tests/slurm -q        # as root, after scripts/install-slurm.sh

They prove what hpctrain's Slurm support leans on: srun task variables, a signal sent with
``scancel --signal`` reaching a process inside a step (the preemption path), a job requeueing
itself (one run appended to the other's log), and an array task requeueing only itself. They
also pin which rank variables the batch shell itself carries, because rank detection must not
mistake the batch shell for rank 0 of an srun step.
"""

from __future__ import annotations

import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import SlurmCluster
from .jobs import ReferenceLosses

# A requeued job may start again cred_expire+1 s (=6 s) after it ended; on top comes up to one
# sched_interval (1 s). Measured ~12 s per round trip with 10 and 2; the timeouts leave plenty of
# margin.
REQUEUE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def preemption_reference(reference: ReferenceLosses) -> None:
    """Start the preemption tests' reference run (2 ranks, tests/slurm/jobs.py) now: it trains
    while the jobs here idle in Slurm's queue (a requeue waits ~6 s), not beside the first
    preempted job, whose ranks and preflight it would slow."""
    reference.preemption()


def write_script(path: Path, body: str) -> Path:
    """Write an executable bash batch script (a shebang, then `body` dedented)."""
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
    path.chmod(0o755)
    return path


def wait_for_file(path: Path, timeout: float) -> None:
    """Wait until `path` exists."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:.0f}s"
        time.sleep(0.1)


def slurm_vars(path: Path) -> dict[str, str]:
    """The SLURM_* lines of an `env` dump."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs if k.startswith("SLURM_")}


def test_srun_task_variables(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """srun tasks see their job id, rank and task count; the batch shell has no step id."""
    script = write_script(tmp_path / "tasks.sh", f"""
        env > {tmp_path}/batch.env
        srun bash -c 'echo "$SLURM_JOB_ID $SLURM_PROCID $SLURM_NTASKS"'
        srun --ntasks=1 env > {tmp_path}/step.env
    """)
    out = tmp_path / "tasks.out"
    job = slurm_cluster.sbatch(script, "--ntasks=2", f"--output={out}")
    assert slurm_cluster.wait(job, timeout=30) == "COMPLETED", slurm_cluster.job_info(job)
    # srun's own notices share the job's output: under load the second step can wait for the
    # first one's CPUs ("srun: Job N step creation temporarily disabled, retrying").
    lines = sorted(line for line in out.read_text().splitlines()
                   if line.strip() and not line.startswith("srun: "))
    assert lines == [f"{job} 0 2", f"{job} 1 2"], out.read_text()

    # The batch shell carries SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step variables:
    # only SLURM_STEP_ID/SLURM_STEPID tell a task started by srun from the batch shell.
    batch, step = slurm_vars(tmp_path / "batch.env"), slurm_vars(tmp_path / "step.env")
    assert batch["SLURM_PROCID"] == "0" and batch["SLURM_NTASKS"] == "2", batch
    assert not {"SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"} & batch.keys(), batch
    assert step["SLURM_STEP_ID"] == step["SLURM_STEPID"] == "1", step
    assert step["SLURM_STEP_NUM_TASKS"] == "1", step


def test_scancel_signal_reaches_srun_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``scancel --signal=USR2`` (no --batch) reaches a Python process started by srun."""
    ready, marker = tmp_path / "ready", tmp_path / "marker"
    program = tmp_path / "trap.py"
    program.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        def on_usr2(signum, frame):
            with open({str(marker)!r}, "w") as f:
                f.write(f"{{signal.Signals(signum).name}} {{os.environ['SLURM_PROCID']}}")
            sys.exit(0)
        signal.signal(signal.SIGUSR2, on_usr2)
        open({str(ready)!r}, "w").close()
        time.sleep(120)
        sys.exit(3)
    """))
    script = write_script(tmp_path / "signal.sh", f"""
        srun --ntasks=1 {sys.executable} {program}
        echo "srun exited $?"
    """)
    out = tmp_path / "signal.out"
    job = slurm_cluster.sbatch(script, "--ntasks=1", f"--output={out}")
    wait_for_file(ready, timeout=30)
    slurm_cluster.scancel(job, signal="USR2")
    assert slurm_cluster.wait(job, timeout=30) == "COMPLETED", slurm_cluster.job_info(job)
    assert marker.read_text() == "SIGUSR2 0"
    assert "srun exited 0" in out.read_text(), out.read_text()


REQUEUE_ONCE = """
    echo "run restart=${SLURM_RESTART_COUNT:-0} job=$SLURM_JOB_ID"
    if [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then
        scontrol requeue "$SLURM_JOB_ID" || exit 1
        # The requeue kills this run. `exec`: with a plain `sleep`, bash may see its child die
        # of the SIGTERM first and run the next line before its own SIGTERM arrives.
        exec sleep 120
    fi
    echo "second run done"
"""

REQUEUE_ARRAY_TASK_1 = """
    echo "task=$SLURM_ARRAY_TASK_ID restart=${SLURM_RESTART_COUNT:-0}"
    if [ "$SLURM_ARRAY_TASK_ID" = 1 ] && [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then
        scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" || exit 1
        exec sleep 120
    fi
"""


@dataclass
class RequeueJobs:
    """The two requeue jobs, submitted together: a requeued job idles in the queue for
    cred_expire+1 s, and the two tests below wait out those seconds side by side."""

    submitted: float  # time.monotonic() at submission
    once: str
    once_out: Path
    array: str
    array_out: Path  # a folder: array-<job>_<task>.out


@pytest.fixture(scope="module")
def requeue_jobs(slurm_cluster: SlurmCluster,
                 tmp_path_factory: pytest.TempPathFactory) -> RequeueJobs:
    """Submit the job that requeues itself once and the array whose task 1 does."""
    tmp = tmp_path_factory.mktemp("requeue")
    submitted = time.monotonic()
    once_out = tmp / "requeue.out"
    once = slurm_cluster.sbatch(write_script(tmp / "requeue.sh", REQUEUE_ONCE),
                                "--open-mode=append", f"--output={once_out}")
    array = slurm_cluster.sbatch(write_script(tmp / "array.sh", REQUEUE_ARRAY_TASK_1),
                                 "--array=0-1", "--open-mode=append",
                                 f"--output={tmp}/array-%A_%a.out")
    return RequeueJobs(submitted, once, once_out, array, tmp)


@pytest.mark.slow
def test_job_requeues_itself_once(slurm_cluster: SlurmCluster, requeue_jobs: RequeueJobs
                                  ) -> None:
    """A job that requeues itself runs twice, ends COMPLETED, and keeps both runs' output."""
    job, out = requeue_jobs.once, requeue_jobs.once_out
    state = slurm_cluster.wait(job, timeout=REQUEUE_TIMEOUT_S)
    elapsed = time.monotonic() - requeue_jobs.submitted
    info = slurm_cluster.job_info(job)
    assert state == "COMPLETED", info
    assert info["RestartCnt"] == "1" and info["ExitCode"] == "0:0", info
    log = out.read_text()
    runs = [line for line in log.splitlines() if line.startswith("run ")]
    assert runs == [f"run restart=0 job={job}", f"run restart=1 job={job}"], log
    assert log.rstrip().endswith("second run done"), log
    print(f"requeue round trip (submit to COMPLETED after one requeue): {elapsed:.1f}s")


@pytest.mark.slow
def test_array_task_requeues_only_itself(slurm_cluster: SlurmCluster, requeue_jobs: RequeueJobs
                                         ) -> None:
    """In ``--array=0-1`` task 1 requeues ``<array job>_1``: it runs twice, task 0 once."""
    job = requeue_jobs.array
    for task in (0, 1):
        state = slurm_cluster.wait(f"{job}_{task}", timeout=REQUEUE_TIMEOUT_S)
        assert state == "COMPLETED", slurm_cluster.job_info(f"{job}_{task}")
    assert slurm_cluster.job_info(f"{job}_0")["RestartCnt"] == "0"
    assert slurm_cluster.job_info(f"{job}_1")["RestartCnt"] == "1"
    # slurmstepd also appends its "CANCELLED ... DUE TO JOB REQUEUE" line to the requeued log.
    logs = [(requeue_jobs.array_out / f"array-{job}_{task}.out").read_text() for task in (0, 1)]
    runs = [[line for line in log.splitlines() if line.startswith("task=")] for log in logs]
    assert runs[0] == ["task=0 restart=0"], logs[0]
    assert runs[1] == ["task=1 restart=0", "task=1 restart=1"], logs[1]
    assert "DUE TO JOB REQUEUE" not in logs[0] and "DUE TO JOB REQUEUE" in logs[1], logs
