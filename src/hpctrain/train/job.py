"""One rank's whole job: environment → run directory → process group → Trainer → exit info.

This is what every rank runs, whether started by ``hpctrain train --nproc N``, by torchrun or by
``srun``; it learns its place from the environment.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config import JobConfig, dump_yaml
from hpctrain.errors import HpctrainError
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.runtime.dist import init_distributed, shutdown
from hpctrain.runtime.env import ProcessEnv, detect_env
from hpctrain.runtime.exit_codes import PREEMPTED
from hpctrain.runtime.logs import log_device_binding, setup_rank_logging
from hpctrain.runtime.provenance import collect_provenance, write_provenance
from hpctrain.runtime.requeue import requeue
from hpctrain.runtime.rundir import RunDir, run_name
from hpctrain.runtime.watchdog import Watchdog
from hpctrain.train.preemption import ControlChannel, Preempted, PreemptionFlag
from hpctrain.train.trainer import Trainer, TrainResult

log = logging.getLogger("hpctrain.job")


def resolve_run_dir(cfg: JobConfig, env: ProcessEnv, run_id: str | None = None) -> RunDir:
    """``<out_dir>/<name>[-suffix]``: Slurm job id, else the launcher's run id, else a timestamp."""
    name = cfg.run.name
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if cfg.run.suffix == "auto":
        if env.job_id:
            name = run_name(name, env)
        elif run_id != "none":
            name = f"{name}-{run_id}"
        elif env.world_size == 1:
            name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        # Several ranks without a shared id cannot agree on a timestamp: use the name as is.
    return RunDir(Path(cfg.run.out_dir) / name)


def run_training(cfg: JobConfig, source: Path | None = None) -> TrainResult:
    """Train as this rank; write config, provenance, metrics, logs and exit info."""
    env = detect_env()
    run_dir = resolve_run_dir(cfg, env)
    run_dir.create()
    setup_rank_logging(run_dir, env, console=env.rank == 0)
    # Installed first: a signal that arrives during start-up is answered at the first step.
    preempt = PreemptionFlag(cfg.preempt)
    started = time.time()
    watchdog = trainer = None
    try:
        ctx = init_distributed(cfg.run, env, cfg.parallel.strategy)
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
                                 group=ctx.checkpoint_group)
        with MetricsWriter(run_dir, env) as metrics:
            trainer = Trainer(cfg, ctx, metrics, ckpt=ckpt, watchdog=watchdog, preempt=preempt,
                              control=ControlChannel(ctx.control_group))
            trainer.resume(cfg.checkpoint.resume)
            result = trainer.train()
        if env.world_size > 1:
            dist.barrier()
    except Preempted as e:
        _after_preemption(cfg, env, run_dir, e, trainer)
        raise
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}"
        log.error("rank %d failed: %s", env.rank, reason, exc_info=not isinstance(e, HpctrainError))
        if run_dir.failure_since(started) is None:  # a watchdog's or peer's account comes first
            run_dir.write_exit_info(
                exit_code=_exit_code(e), reason=reason,
                last_checkpoint=trainer.last_checkpoint if trainer else None,
                extra={"rank": env.rank, "host": socket.gethostname()})
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        preempt.restore()
        shutdown()
    if env.rank == 0:
        run_dir.write_exit_info(exit_code=0, reason="completed",
                                last_checkpoint=trainer.last_checkpoint,
                                extra={"steps": result.steps, "final_loss": result.final_loss,
                                       "tokens_per_s": result.tokens_per_s})
        log.info("run directory: %s", run_dir.root)
        log.info("done: %d steps, final loss %.4f, %.0f tokens/s per rank (%.0f in all)",
                 result.steps, result.final_loss, result.tokens_per_s,
                 result.tokens_per_s * env.world_size)
    return result


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
    if isinstance(e, KeyboardInterrupt):
        return 130
    return getattr(e, "exit_code", 1)
