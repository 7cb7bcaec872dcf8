"""Helpers for the tests that run hpctrain training jobs on the test Slurm: the generated batch
script (with an optional injected stall and a record of where each rank ran), waiting for
steps, and the uninterrupted reference run each resumed run must match exactly.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hpctrain.launch.sbatch import SbatchParams, create_log_dir, render_sbatch
from hpctrain.observe.metrics import read_metrics
from rank_jobs import launch

REPO = Path(__file__).resolve().parents[2]
TINY = ["run.device=cpu", "data.source=stdlib", "data.max_bytes=300000", "data.seq_len=64",
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "train.micro_batch=2", "train.precision=fp32",
        "train.deterministic=true", "optim.warmup_steps=2", "metrics.log_every=1",
        "metrics.progress=false", "checkpoint.interval=none", "preempt.check_every=1"]


def script(tmp: Path, name: str, overrides: list[str], *, pause_at: int | None = None,
           slow_s: float | None = None, where: Path | None = None,
           fault_task: int | None = None, **params) -> Path:
    """The generated batch script; ``pause_at`` holds step N of the first run (an injected,
    harmless stall that the preemption signal ends, 60 s at most) so a signal sent after N-1
    logged steps lands mid-run, however fast the steps and however slow the signal are;
    ``slow_s`` makes every step sleep that long (a run that waits for a signal then idles
    instead of taking a core); ``fault_task`` limits both to that array task (a task nobody
    signals would sit out the whole pause); each rank appends ``node rank`` (SLURMD_NODENAME,
    SLURM_PROCID) to ``where`` as it starts."""
    python = sys.executable
    faults = []
    if pause_at is not None:
        faults.append(f"hang@step={pause_at},seconds=60")
    if slow_s is not None:
        faults.append(f"slow@seconds={slow_s}")
    if faults or where is not None:
        python = str(tmp / f"{name}-python.sh")
        lines = ["#!/bin/bash"]
        if faults:
            # The first run only: a requeued run resumes past the pause and runs at full speed.
            when = '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] && '
            if fault_task is not None:
                when += f'[ "${{SLURM_ARRAY_TASK_ID:-}}" = {fault_task} ] && '
            lines.append(f"{when}export HPCTRAIN_FAULTS='{';'.join(faults)}'")
        if where is not None:
            lines.append(f'echo "$SLURMD_NODENAME $SLURM_PROCID" >> {where}')
        lines.append(f'exec {sys.executable} "$@"')
        Path(python).write_text("\n".join(lines) + "\n")
        os.chmod(python, 0o755)
    p = SbatchParams(config="configs/demo.yaml", workdir=str(REPO), python=python,
                     overrides=[*TINY, f"run.out_dir={tmp / 'runs'}", f"run.name={name}",
                                *overrides],
                     job_name=name, log_dir=str(tmp / "logs"), **params)
    path = tmp / f"{name}.sh"
    path.write_text(render_sbatch(p))
    create_log_dir(p)  # as `hpctrain sbatch` does: Slurm does not create --output directories
    return path


def steps_logged(run_dir: Path) -> int:
    """Training steps rank 0 has logged so far."""
    path = run_dir / "metrics" / "rank-000.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for r in read_metrics(path) if "loss" in r)


def diagnosis(cluster, job: str, run_dir: Path) -> str:
    """The job's record, its output file, its run's rank logs and the daemons' logs."""
    return cluster.diagnosis(job, *sorted((run_dir / "logs").glob("rank-*.log")))


def wait_for_steps(cluster, job: str, run_dir: Path, n: int, timeout: float = 240) -> None:
    """Wait until rank 0 logged `n` steps; fail at once if the job ends first."""
    deadline = time.monotonic() + timeout
    while steps_logged(run_dir) < n:
        state = cluster.job_info(job)["JobState"]
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} ended ({state}) before {n} steps:\n"
                                 f"{diagnosis(cluster, job, run_dir)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_dir} logged fewer than {n} steps in {timeout:.0f} s:\n"
                               f"{diagnosis(cluster, job, run_dir)}")
        time.sleep(0.3)


def exit_info(run_dir: Path) -> dict:
    """The run's exit_info.json."""
    return json.loads((run_dir / "exit_info.json").read_text())


# The preemption tests (one node, tests/slurm/test_training_jobs.py; two nodes,
# test_multinode.py) train this many steps on 2 DDP ranks, against one reference run.
PREEMPT_STEPS = 30


class ReferenceLosses:
    """Final losses of uninterrupted runs, each computed once per session (the single-node and
    the two-node preemption tests compare against the same one).

    The ranks are forked from the preloaded interpreter (tests/rank_jobs.py: the ranks' own
    entry point, without a launcher's fresh interpreters and their ~3 CPU-s of imports each):
    only the numbers are compared. A test ``start``s its reference before it submits its job,
    so that the reference trains while jobs wait on Slurm instead of after them."""

    def __init__(self, root: Path):
        self.root = root
        self._pool = ThreadPoolExecutor(max_workers=1)

    @functools.cache  # noqa: B019 (one instance per session, held by a fixture)
    def start(self, ranks: int, steps: int, strategy: str) -> Future[float]:
        """The final loss, to come, of ``steps`` steps of TINY on ``ranks`` local ranks (the run
        starts on the first call)."""
        return self._pool.submit(self._final_loss, ranks, steps, strategy)

    def preemption(self) -> Future[float]:
        """The final loss, to come, of the preemption tests' uninterrupted run."""
        return self.start(2, PREEMPT_STEPS, "ddp")

    def close(self) -> None:
        """Wait for the runs started and let the thread go."""
        self._pool.shutdown()

    def _final_loss(self, ranks: int, steps: int, strategy: str) -> float:
        name = f"ref-{ranks}-{steps}-{strategy}"
        spec = {"config": "configs/demo.yaml", "out": str(self.root),
                "common": [*TINY, "run.suffix=none", f"train.steps={steps}",
                           f"parallel.strategy={strategy}"],
                "jobs": [{"name": name, "overrides": []}]}
        launch(ranks, spec, self.root / f"launch-{name}", timeout=300)
        return exit_info(self.root / name)["extra"]["final_loss"]
