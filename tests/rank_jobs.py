"""Many training jobs in one multi-rank launch: start the ranks once, train every layout in turn.

Starting 4 ranks costs far more than training a tiny model for 10 steps (each process imports
torch), so the layout tests hand one launch a list of jobs. Every rank runs this file; each job
goes through the real entry point, ``hpctrain.train.job.run_training`` (run directory, process
group, device mesh, Trainer, metrics, checkpoints), except that the process group is kept between
jobs: each job builds its own mesh (and groups) on it.

    launch(nproc, spec, workdir, timeout)   # spec: {"config", "common", "out", "jobs": [...]}

A job is ``{"name": ..., "overrides": [...], "wait_for": path or absent, "faults": str or
absent}``; ``wait_for`` holds the job back until that path exists (a checkpoint another launch
writes); ``faults`` is that job's ``HPCTRAIN_FAULTS`` (in place of the launch's, if any).

The ranks are forked from a preloaded interpreter (tests/forked.py): a fresh one spends ~4 CPU-s
importing torch and the training code, more than most jobs train.
"""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import forked
from ports import free_port  # noqa: F401 - tests import it from here

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 600.0


def launch(nproc: int, spec: dict[str, Any], workdir: Path, timeout: float,
           env: dict[str, str] | None = None) -> None:
    """Run ``spec``'s jobs on ``nproc`` ranks; fail (killing all) if one rank fails or hangs.

    ``env`` adds variables to the ranks' environment (e.g. ``HPCTRAIN_FAULTS``).
    """
    extra = env or {}
    from hpctrain.launch.local import kill_tree

    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc),
                        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                        **extra)
        rank_env.pop("TORCHELASTIC_RUN_ID", None)
        procs.append(forked.start(_run_jobs, (str(spec_path),), env=rank_env,
                                  out=workdir / f"rank-{rank}.log", name=f"rank-{rank}"))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.exitcode is None for p in procs):
            codes = [p.exitcode for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            left = deadline - time.monotonic()
            if failed is not None or left <= 0:
                break
            # Woken as soon as a rank exits.
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
        codes = [p.exitcode for p in procs]
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    finally:
        for rank, p in enumerate(procs):
            kill_tree(p.pid)
            forked.finish(p, workdir / f"rank-{rank}.log")
    if failed is not None:
        # Every rank's account: the first to fail is often not the lowest rank.
        tails = "\n".join(f"--- rank {r} (exit {p.exitcode}) ---\n"
                           + _errors((workdir / f"rank-{r}.log").read_text())
                           for r, p in enumerate(procs))
        raise AssertionError(f"a rank of {nproc} failed or timed out:\n{tails}")


def _errors(log: str) -> str:
    """The lines of a rank's log that tell what happened: errors and finished jobs."""
    keep = [line for line in log.splitlines()
            if line.startswith("job ") or "Error" in line or "error" in line]
    return "\n".join(keep[-20:])


def _run_jobs(spec_path: str) -> None:
    """Every job of the spec in turn, on one process group (a rank's whole life)."""
    import torch.distributed as dist

    import hpctrain.train.job as job
    from hpctrain.config import load_config

    sys.argv = [__file__, spec_path]  # what the run's provenance records
    job.shutdown = lambda: None  # one process group for all jobs
    spec = json.loads(Path(spec_path).read_text())
    launch_faults = os.environ.get("HPCTRAIN_FAULTS")
    for item in spec["jobs"]:
        if "faults" in item:
            _use_faults(item["faults"])
        wait_for = item.get("wait_for")
        if wait_for:
            deadline = time.monotonic() + WAIT_S
            while not Path(wait_for).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{wait_for} did not appear")
                time.sleep(0.2)
        cfg = load_config(spec["config"], [*spec["common"], *item["overrides"],
                                           f"run.out_dir={spec['out']}",
                                           f"run.name={item['name']}"])
        started = time.monotonic()
        job.run_training(cfg)
        print(f"job {item['name']}: {time.monotonic() - started:.1f} s", flush=True)
        if "faults" in item:
            _use_faults(launch_faults)
    if dist.is_initialized():
        dist.destroy_process_group()


def _use_faults(value: str | None) -> None:
    """Set HPCTRAIN_FAULTS for the jobs that follow, as if this process had started with it."""
    from hpctrain import faults

    if value is None:
        os.environ.pop("HPCTRAIN_FAULTS", None)
    else:
        os.environ["HPCTRAIN_FAULTS"] = value
    faults._specs.cache_clear()  # parsed once per process otherwise
    faults._fired.clear()
