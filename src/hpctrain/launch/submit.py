"""``hpctrain submit``: write the batch script, create what the job needs, submit it, and say
where it will write.

    hpctrain submit configs/llama-1b.yaml --nodes 2 --tasks-per-node 4 --gpus-per-node 4
    jid=$(hpctrain submit configs/demo.yaml train.steps=1000)       # stdout: the job id only
    hpctrain submit configs/eval.yaml --dependency afterok:$jid
    hpctrain submit configs/sweep.yaml --array 0-7%2 --dry-run      # show, create nothing

The script is the one ``hpctrain sbatch`` writes (same options, same checks). Before submitting,
the log folder and the run's output folder (``run.out_dir``) are created: Slurm opens the log
before the script starts and never creates its folder. The script as submitted is kept beside
its log, ``LOG_DIR/<job-name>-<jobid>.sh`` next to ``<job-name>-<jobid>.out``; a script sbatch
refused stays as ``<job-name>-unsubmitted-<time>.sh`` for a look.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError, LaunchError
from hpctrain.launch.sbatch import (
    SbatchParams,
    add_job_options,
    create_log_dir,
    params_from_args,
    render_sbatch,
)

_SBATCH_TIMEOUT_S = 120


class SubmitError(LaunchError):
    """sbatch is missing, or refused or did not answer a submission."""


@dataclass
class Submitted:
    """A submitted job: its id, the kept script, its log and the run directories it will use."""

    job_id: str
    script: Path
    log: str
    run_dirs: list[Path]


def array_indices(spec: str) -> list[int]:
    """The task ids of an ``--array`` spec such as ``0-15:4%2`` or ``1,3,5``."""
    indices: list[int] = []
    for item in spec.split("%")[0].split(","):
        bounds, _, step = item.partition(":")
        low, _, high = bounds.partition("-")
        try:
            first, last, stride = int(low), int(high or low), int(step or 1)
        except ValueError:
            raise ConfigError(f"--array {spec!r}: {item!r} is not an index range",
                              expected="N, N-M, N-M:STEP, joined by ',' and an optional %MAX",
                              ) from None
        if stride < 1 or last < first:
            raise ConfigError(f"--array {spec!r}: {item!r} is an empty range")
        indices.extend(range(first, last + 1, stride))
    return indices


def run_dirs(cfg: JobConfig, workdir: Path, job_id: str, array: str | None) -> list[Path]:
    """Where the job's runs will write (as runtime.rundir names them under Slurm)."""
    root = workdir / cfg.run.out_dir
    if cfg.run.suffix == "none":
        return [root / cfg.run.name]
    if array:
        return [root / f"{cfg.run.name}-{job_id}_{i}" for i in array_indices(array)]
    return [root / f"{cfg.run.name}-{job_id}"]


def log_path(p: SbatchParams, job_id: str) -> str:
    """The job's log file (one per array task: ``<task>`` stands for the task id)."""
    stem = f"{p.job_name}-{job_id}_<task>" if p.array else f"{p.job_name}-{job_id}"
    return f"{p.log_path}/{stem}.out"


def sbatch_submit(script: Path, cwd: Path, sbatch: str = "sbatch",
                  options: Sequence[str] = ()) -> str:
    """Submit `script` with ``sbatch --parsable`` from `cwd`; return the job id."""
    argv = [sbatch, "--parsable", *options, str(script)]
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                              timeout=_SBATCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SubmitError(f"{sbatch} not found on PATH: this machine cannot submit Slurm jobs",
                          hint="run on a login node of the cluster (module load slurm, if the "
                          "site uses modules); --dry-run shows the script without submitting"
                          ) from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{sbatch} did not answer in {_SBATCH_TIMEOUT_S} s (slurmctld busy or "
                          "down)", hint=f"check `squeue --me` before retrying: the job may be "
                          f"queued already; the script is {script}") from None
    # --parsable prints "JOBID" or "JOBID;CLUSTER".
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job_id.isdigit():
        said = (done.stderr.strip() or done.stdout.strip() or "nothing").splitlines()
        raise SubmitError(f"sbatch refused the job (exit {done.returncode}): {said[-1]}",
                          hint=f"the script is kept at {script}; fix what sbatch names, "
                          "then submit again")
    return job_id


def write_script(text: str, folder: Path, job_name: str) -> Path:
    """Write the script into `folder` under a name that cannot collide with a kept one."""
    fd, name = tempfile.mkstemp(prefix=f".{job_name}-", suffix=".sh", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(name, 0o755)
    return Path(name)


def submit_script(params: SbatchParams, *, sbatch: str = "sbatch") -> tuple[str, Path]:
    """Render and submit the script from its log folder; (job id, the kept script)."""
    text = render_sbatch(params)
    logs = create_log_dir(params)
    pending = write_script(text, logs, params.job_name)
    try:
        job_id = sbatch_submit(pending, Path(params.workdir), sbatch)
    except SubmitError as e:
        kept = logs / f"{params.job_name}-unsubmitted-{time.strftime('%Y%m%d-%H%M%S')}.sh"
        os.replace(pending, kept)
        e.hint = (e.hint or "").replace(str(pending), str(kept))
        raise
    # sbatch has read the script: the name of the kept copy can now carry the job id.
    script = logs / f"{params.job_name}-{job_id}.sh"
    os.replace(pending, script)
    return job_id, script


def submit_job(params: SbatchParams, cfg: JobConfig, *, sbatch: str = "sbatch") -> Submitted:
    """Create the run's output folder, submit the training script, say where it will write."""
    workdir = Path(params.workdir)
    (workdir / cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    job_id, script = submit_script(params, sbatch=sbatch)
    return Submitted(job_id, script, log_path(params, job_id),
                     run_dirs(cfg, workdir, job_id, params.array))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain submit`` on the top-level parser's ``sub``."""
    s = sub.add_parser("submit", help="write the batch script and submit it to Slurm",
                       description="Write the script `hpctrain sbatch` would, create the log "
                       "and output folders, submit it; print the job id (stdout) and where "
                       "the job logs and writes (stderr).")
    add_job_options(s)
    s.add_argument("--dry-run", action="store_true",
                   help="print the script and what would be done; create and submit nothing")
    s.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain submit``."""
    params, cfg = params_from_args(args)
    if args.dry_run:
        print(render_sbatch(params), end="")
        where = run_dirs(cfg, Path(params.workdir), "<jobid>", params.array)
        print(f"dry run: nothing created or submitted. Would create {params.log_path}/ and "
              f"{Path(params.workdir) / cfg.run.out_dir}/, then run `sbatch --parsable "
              f"SCRIPT` in {params.workdir}; log {log_path(params, '<jobid>')}, run directory "
              f"{where[0] if len(where) == 1 else where[0].parent / '...'}", file=sys.stderr)
        return
    job = submit_job(params, cfg)
    print(job.job_id, flush=True)
    dirs = (f"run directory {job.run_dirs[0]}" if len(job.run_dirs) == 1 else
            "run directories " + ", ".join(str(d) for d in job.run_dirs))
    print(f"submitted job {job.job_id}: log {job.log}, {dirs}; script {job.script}",
          file=sys.stderr)
