"""Ask Slurm to run this job again after a preemption checkpoint.

Arrays are requeued per task (``<array job>_<task>``): in the last task of an array
``$SLURM_JOB_ID`` equals the array's own id, and requeueing that requeues the whole array.
Where ``scontrol`` is missing (inside a container) the job exits with code 75 and the batch
script requeues from outside the container.
"""

from __future__ import annotations

import logging
import os
import subprocess

from hpctrain.runtime.env import ProcessEnv

log = logging.getLogger("hpctrain.requeue")


def requeue_target(env: ProcessEnv) -> str | None:
    """The id ``scontrol requeue`` needs for this job or array task, or None outside Slurm."""
    if env.array_job_id and env.array_task_id:
        return f"{env.array_job_id}_{env.array_task_id}"
    return env.job_id


# Printed to stdout (the Slurm log) when scontrol is out of reach; the batch script greps it.
SCRIPT_MARKER = "HPCTRAIN_REQUEUE_BY_SCRIPT"


def requeue(env: ProcessEnv, max_requeues: int) -> tuple[bool, str]:
    """Requeue the job if allowed; returns (requeued, why)."""
    target = requeue_target(env)
    if target is None:
        return False, "not running under Slurm"
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts >= max_requeues:
        return False, f"SLURM_RESTART_COUNT={restarts} reached checkpoint.max_requeues"
    try:
        proc = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True,
                              timeout=60)
    except FileNotFoundError:
        print(f"{SCRIPT_MARKER} restart={restarts} target={target}", flush=True)
        return False, "scontrol not found (container?): the batch script requeues on exit 75"
    except subprocess.TimeoutExpired:
        return False, "scontrol requeue timed out: the batch script requeues on exit 75"
    if proc.returncode != 0:
        return False, f"scontrol requeue {target} failed: {proc.stderr.strip()}"
    log.info("requeued Slurm job %s (restart %d)", target, restarts + 1)
    return True, f"scontrol requeue {target}"
