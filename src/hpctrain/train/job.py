"""One rank's whole job: environment → run directory → process group → Trainer → exit info.

This is what every rank runs, whether started by ``hpctrain train --nproc N``, by torchrun or by
``srun``; it learns its place from the environment.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config import JobConfig, dump_yaml
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.models.flops import count_params
from hpctrain.observe.goodput import GoodputClock, summary
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.profile import write_oom_snapshot
from hpctrain.runtime.config import refuse_large_model_on_cpu
from hpctrain.runtime.dist import Distributed, init_distributed, shutdown
from hpctrain.runtime.env import ProcessEnv, detect_env
from hpctrain.runtime.exit_codes import PREEMPTED
from hpctrain.runtime.interrupted import INTERRUPTED, Interrupted
from hpctrain.runtime.logs import log_device_binding, setup_rank_logging
from hpctrain.runtime.provenance import collect_provenance, write_provenance
from hpctrain.runtime.requeue import requeue
from hpctrain.runtime.rundir import RunDir, archive_run, run_name
from hpctrain.runtime.runlock import (
    TOKEN_ENV,
    RunLock,
    RunLockedError,
    acquire,
    check_held,
    current_attempt,
)
from hpctrain.runtime.watchdog import Watchdog, enable_flight_recorder
from hpctrain.task import Task
from hpctrain.train.preemption import ControlChannel, Preempted, PreemptionFlag
from hpctrain.train.task_trainer import build_trainer
from hpctrain.train.trainer import Trainer, TrainResult

log = logging.getLogger("hpctrain.job")


def resolve_run_dir(cfg: JobConfig, env: ProcessEnv) -> RunDir:
    """``<out_dir>/<name>``; under Slurm ``<name>-<job id>`` (arrays: ``<job>_<task>``).

    The same command finds the same directory again (a requeue keeps its job id), so a rerun
    resumes from the run's last checkpoint; ``--fresh`` archives the old run first.
    """
    name = run_name(cfg.run.name, env) if cfg.run.suffix == "auto" else cfg.run.name
    return RunDir(Path(cfg.run.out_dir) / name)


@dataclass
class Claim:
    """A locked run directory, and what was done to get it (for the user)."""

    run_dir: RunDir
    lock: RunLock
    notes: list[str] = field(default_factory=list)


def claim_run_dir(cfg: JobConfig, env: ProcessEnv, *, fresh: bool = False) -> Claim:
    """Lock this run's directory (RunLockedError if a live run holds it).

    With ``fresh`` a previous run there is first archived under a new name, never deleted.
    """
    run_dir = resolve_run_dir(cfg, env)
    attempt = current_attempt()
    notes = []
    if fresh and attempt.attempt[0] > 0:
        # The batch script runs the same command again after a requeue: continue, or the
        # requeued job would archive its own checkpoints.
        notes.append(f"--fresh ignored: Slurm restart {attempt.attempt[0]} of this job "
                     f"resumes {run_dir.root}")
    elif fresh:
        resume = cfg.checkpoint.resume
        if resume not in ("auto", "never") and _inside(Path(resume), run_dir.root):
            raise ConfigError(
                f"--fresh archives {run_dir.root}, which holds --resume {resume}",
                hint="copy that checkpoint elsewhere first, or drop --fresh to continue the run")
        archived = archive_run(run_dir.root, attempt)
        if archived is not None:
            notes.append(f"previous run {run_dir.root} archived to {archived}")
    lock = acquire(run_dir.root, attempt)
    if cfg.checkpoint.resume == "never" and run_dir.committed_checkpoints():
        # Refused here, before this attempt appends to the old run's log or exit info.
        lock.release()
        raise ConfigError(
            f"{run_dir.root} already holds checkpoints and checkpoint.resume=never",
            hint="rerun without --resume never to continue that run, add --fresh to archive "
            "it and start over, or choose another run.name")
    if lock.took_over:
        notes.append(lock.took_over)
    return Claim(run_dir, lock, notes)


def check_device_fits(cfg: JobConfig) -> None:
    """Refuse a GPU-sized model that run.device=auto would put on the CPU (no GPU visible)."""
    if cfg.run.device != "auto" or torch.cuda.is_available():
        return
    n_params = count_params(cfg.model.resolve(), include_embedding=True)
    named = (f"model.init_from={cfg.model.init_from}" if cfg.model.init_from
             else f"model.size={cfg.model.size}")
    refuse_large_model_on_cpu(n_params, model=named, force="run.device=cpu")


def run_training(cfg: JobConfig, source: Path | None = None, *, fresh: bool = False,
                 task: Task | None = None) -> TrainResult:
    """Train as this rank under the run's lock; a refused run writes nothing into its directory.

    ``task`` (or ``cfg.task``, a spec to load) trains a user's own model instead of the built-in
    one (`hpctrain.task`)."""
    if task is None and not cfg.task:
        check_device_fits(cfg)  # before anything is allocated
    env = detect_env()
    # Installed first: a signal that arrives during start-up is answered at the first step.
    preempt = PreemptionFlag(cfg.preempt)
    enable_flight_recorder(cfg.watchdog)  # before any process group: read when one starts
    lock = None
    try:
        run_dir, lock, ctx, notes = _claim(cfg, env, fresh)
        run_dir.create()
        setup_rank_logging(run_dir, env, console=env.rank == 0)
        for note in notes:
            log.info("%s", note)
        return _train(cfg, env, run_dir, ctx, preempt, source, task)
    finally:
        preempt.restore()
        if lock is not None:
            lock.release()


def _claim(cfg: JobConfig, env: ProcessEnv, fresh: bool
           ) -> tuple[RunDir, RunLock | None, Distributed | None, list[str]]:
    """(run dir, lock this process holds, process group if already up, notes)."""
    token = os.environ.get(TOKEN_ENV)
    if fresh and (token or env.launcher != "local"):
        raise ConfigError("--fresh is for the command that starts the run, not for its ranks",
                          hint="pass --fresh to `hpctrain train` (with or without --nproc), "
                          "or choose a new run.name")
    if token:
        # Started by `hpctrain train --nproc`: the launcher holds the lock for every restart.
        run_dir = resolve_run_dir(cfg, env)
        check_held(run_dir.root, token)
        return run_dir, None, None, []
    if env.world_size == 1:
        claim = claim_run_dir(cfg, env, fresh=fresh)
        return claim.run_dir, claim.lock, None, claim.notes
    # Ranks of srun or torchrun: rank 0 takes the lock once the group is up and every rank
    # learns the outcome, so all of them start or all exit with the same error.
    ctx = init_distributed(cfg.run, env, cfg.parallel)
    claim, refusal = None, [None]
    try:
        if env.rank == 0:
            try:
                claim = claim_run_dir(cfg, env)
            except HpctrainError as e:
                refusal = [(e.what, e.expected, e.hint)]
            except BaseException as e:
                refusal = [(f"rank 0 could not lock the run directory: {e}", None, None)]
                dist.broadcast_object_list(refusal, src=0, group=ctx.control_group)
                raise
        dist.broadcast_object_list(refusal, src=0, group=ctx.control_group)
        if refusal[0] is not None:
            what, expected, hint = refusal[0]
            raise RunLockedError(what, expected=expected, hint=hint)
    except BaseException:
        shutdown()
        raise
    if claim is None:
        return resolve_run_dir(cfg, env), None, ctx, []
    return claim.run_dir, claim.lock, ctx, claim.notes


def _train(cfg: JobConfig, env: ProcessEnv, run_dir: RunDir, ctx: Distributed | None,
           preempt: PreemptionFlag, source: Path | None, task: Task | None) -> TrainResult:
    """Everything after the lock: process group, Trainer, exit info."""
    started = time.time()
    watchdog = trainer = None
    goodput = _goodput_clock(run_dir, env)
    try:
        if ctx is None:
            ctx = init_distributed(cfg.run, env, cfg.parallel)
        log_device_binding(log, env, ctx.device)
        hosts = _gather_hosts(env.world_size)
        if env.rank == 0:
            (run_dir.config_dir / "config.yaml").write_text(dump_yaml(cfg))
            if source is not None:
                (run_dir.config_dir / f"source{source.suffix}").write_text(source.read_text())
            write_provenance(run_dir, collect_provenance(sorted(set(hosts))))
        watchdog = Watchdog(cfg.watchdog, run_dir, env.rank, hosts, _store())
        ckpt = CheckpointManager(cfg.checkpoint, run_dir.checkpoints_dir, rank=env.rank,
                                 world_size=env.world_size, device=ctx.device,
                                 group=ctx.checkpoint_group, timeout_s=cfg.run.timeout_s)
        with MetricsWriter(run_dir, env) as metrics:
            trainer = build_trainer(cfg, task, ctx, metrics, ckpt=ckpt, watchdog=watchdog,
                                    preempt=preempt, control=ControlChannel(ctx.control_group),
                                    goodput=goodput)
            trainer.resume(cfg.checkpoint.resume)
            result = trainer.train()
        if env.world_size > 1:
            dist.barrier()
    except Preempted as e:
        _end_goodput(goodput, PREEMPTED)
        _after_preemption(cfg, env, run_dir, e, trainer)
        raise
    except KeyboardInterrupt:
        _end_goodput(goodput, INTERRUPTED)
        step = trainer.step if trainer else 0
        latest = run_dir.latest_checkpoint()
        # The one line the user sees comes from the CLI or the launcher; the log keeps this.
        log.debug("stopped by SIGINT (Ctrl-C) at step %d; last checkpoint %s", step, latest)
        if run_dir.failure_since(started) is None:
            run_dir.write_exit_info(exit_code=INTERRUPTED,
                                    reason=f"interrupted by SIGINT (Ctrl-C) at step {step}",
                                    last_checkpoint=latest,
                                    extra={"rank": env.rank, "host": socket.gethostname()})
        raise Interrupted(run_dir.root, latest) from None
    except BaseException as e:
        if isinstance(e, torch.OutOfMemoryError):  # unless the OOM observer wrote it already
            write_oom_snapshot(run_dir.root, env.rank)
        reason = f"{type(e).__name__}: {e}"
        log.error("rank %d failed: %s", env.rank, reason, exc_info=not isinstance(e, HpctrainError))
        _end_goodput(goodput, _exit_code(e))
        if run_dir.failure_since(started) is None:  # a watchdog's or peer's account comes first
            # The committed one: an async save still in flight (or failed) is not a checkpoint.
            run_dir.write_exit_info(
                exit_code=_exit_code(e), reason=reason,
                last_checkpoint=run_dir.latest_checkpoint(),
                extra={"rank": env.rank, "host": socket.gethostname()})
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        shutdown()
    if env.rank == 0:
        run_dir.write_exit_info(exit_code=0, reason="completed",
                                last_checkpoint=trainer.last_checkpoint,
                                extra={"steps": result.steps, "final_loss": result.final_loss,
                                       "tokens_per_s": result.tokens_per_s})
        log.info("run directory: %s", run_dir.root)
        log.info("done: %d steps, final loss %.4f, %.0f tokens/s per rank (%.0f in all)%s",
                 result.steps, result.final_loss, result.tokens_per_s,
                 result.tokens_per_s * env.world_size,
                 f"; {summary(result.goodput)}" if result.goodput else "")
    return result


def _goodput_clock(run_dir: RunDir, env: ProcessEnv) -> GoodputClock:
    """Rank 0 keeps the run's goodput ledger (observe/goodput.py); the other ranks only count."""
    if env.rank != 0:
        return GoodputClock()
    try:
        return GoodputClock.open(run_dir.root)
    except OSError as e:
        log.warning("goodput: no ledger in %s (%s); this attempt is not accounted", run_dir.root,
                    e)
        return GoodputClock()


def _end_goodput(clock: GoodputClock, exit_code: int) -> None:
    """Close this attempt's ledger and write goodput.json; never masks the run's own error."""
    try:
        account = clock.finish(exit_code)
    except Exception as e:  # noqa: BLE001 - the run's outcome matters more than its account
        log.warning("goodput: the account was not written: %s", e)
        return
    if account is not None:
        log.info("%s", summary(account))


def _after_preemption(cfg: JobConfig, env: ProcessEnv, run_dir: RunDir, e: Preempted,
                      trainer: Trainer) -> None:
    """Rank 0 requeues under Slurm (the checkpoint is committed by now); then all exit.

    The barrier keeps the other ranks alive until rank 0 is done: ``srun
    --kill-on-bad-exit`` would otherwise kill rank 0 when the first rank exits with 75.
    """
    log.warning("%s", e.what)
    if env.rank == 0:
        info = {"exit_code": PREEMPTED, "reason": e.what,
                "last_checkpoint": trainer.last_checkpoint}
        run_dir.write_exit_info(**info, extra={"requeued": False})
        requeued, how = requeue(env, cfg.checkpoint.max_requeues)
        log.info("requeue: %s", how)
        run_dir.write_exit_info(**info, extra={"requeued": requeued, "requeue": how})
    if env.world_size > 1:
        dist.barrier(group=trainer.dist.control_group)


def _store() -> dist.Store | None:
    """The job's key-value store (the rendezvous store), for watchdog heartbeats."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _gather_hosts(world_size: int) -> list[str]:
    """The host of every rank, indexed by rank."""
    if world_size == 1:
        return [socket.gethostname()]
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _exit_code(e: BaseException) -> int:
    return getattr(e, "exit_code", 1)


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())
