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

The ranks are forked from multiprocessing's fork server, which has imported torch and the
training code once for this test process: importing them costs a fresh interpreter ~4 CPU-s,
more than most jobs' training. The server is single-threaded and has run no torch op, so a
forked rank starts as clean as a new interpreter; each one then takes its own session, log,
environment and working directory as a ``python rank_jobs.py`` process would.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 600.0
# What the fork server imports before it forks the first rank.
PRELOAD = ["torch", "hpctrain.train.job", "rank_jobs"]
# CPU seconds of the ranks forked so far: they are the fork server's children, not ours, so
# the per-test CPU accounting of tests/conftest.py adds this to what it measures.
forked_cpu_s = 0.0


def free_port() -> int:
    """A TCP port free right now on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when this process starts its server
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc),
                        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                        **extra)
        rank_env.pop("TORCHELASTIC_RUN_ID", None)
        proc = ctx.Process(target=_rank_main, name=f"rank-{rank}",
                           args=(str(spec_path), rank_env, str(workdir / f"rank-{rank}")))
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.exitcode is None for p in procs):
            codes = [p.exitcode for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        codes = [p.exitcode for p in procs]
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.join(timeout=10)
        _count_cpu(workdir, nproc)
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
    import torch.distributed as dist

    import hpctrain.train.job as job
    from hpctrain.config import load_config

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


def _rank_main(spec_path: str, env: dict[str, str], stem: str) -> None:
    """One rank, in a process just forked from the fork server: become what
    ``python rank_jobs.py SPEC`` started in a session of its own would be, then run the jobs;
    leave the CPU seconds spent in ``STEM.cpu`` (however the jobs end)."""
    try:
        os.setsid()
        log = os.open(f"{stem}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(REPO)
        sys.argv = [__file__, spec_path]
        import torch

        # OMP_NUM_THREADS is read when torch starts its thread pool; the server had not.
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        _run_jobs(spec_path)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        used = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        Path(f"{stem}.cpu").write_text(str(used.ru_utime + used.ru_stime
                                           + kids.ru_utime + kids.ru_stime))


def _count_cpu(workdir: Path, nproc: int) -> None:
    """Add the CPU seconds the ranks left behind to ``forked_cpu_s`` (a rank killed before it
    wrote them counts nothing)."""
    global forked_cpu_s
    for rank in range(nproc):
        path = workdir / f"rank-{rank}.cpu"
        if path.is_file():
            forked_cpu_s += float(path.read_text() or 0)

