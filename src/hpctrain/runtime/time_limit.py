"""When Slurm will end this job: its time limit as a Unix time, read once at start.

``SLURM_JOB_END_TIME`` (Unix seconds) where Slurm or the batch script sets it; else one
``squeue -h -j $SLURM_JOB_ID -o %e`` (the end time in the cluster's local time, ``N/A`` or
``Unknown`` for none). Not under Slurm, no limit, or squeue missing, slow or failing: None (the
run simply makes no save before the limit). ``scontrol update TimeLimit`` after the start is not
seen; the ``--signal`` that sbatch sets still answers that case through preemption.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from datetime import datetime

from hpctrain.shown import quoted

log = logging.getLogger("hpctrain.runtime")

END_TIME_ENV = "SLURM_JOB_END_TIME"


def job_end_time(environ: Mapping[str, str] | None = None, *, squeue: str | None = None,
                 timeout_s: float = 10.0) -> float | None:
    """Unix time at which Slurm ends this job, or None when there is none to know."""
    env = os.environ if environ is None else environ
    given = env.get(END_TIME_ENV, "").strip()
    if given:
        try:
            return float(int(given))
        except ValueError:
            log.warning("%s=%r is not a Unix time: no save before the time limit", END_TIME_ENV,
                        given[:40])
            return None
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job.isdigit():
        return None
    squeue = squeue or shutil.which("squeue")
    if squeue is None:
        return None
    try:
        done = subprocess.run([squeue, "-h", "-j", job, "-o", "%e"], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("squeue could not say when job %s ends (%s): no save before the time "
                    "limit", job, e)
        return None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or [""])[0]
        log.warning("squeue could not say when job %s ends (exit code %d: %s): no save before "
                    "the time limit", job, done.returncode, quoted(first))
        return None
    return _parse_end(done.stdout)


def _parse_end(text: str) -> float | None:
    """squeue's ``%e`` (``2026-11-28T02:30:00`` local time) as Unix time; None for N/A."""
    try:
        return datetime.fromisoformat(text.strip().splitlines()[0].strip()).timestamp()
    except (ValueError, IndexError):
        return None  # N/A, Unknown, NONE: no limit
