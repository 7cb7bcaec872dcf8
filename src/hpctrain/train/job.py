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

from hpctrain.config import JobConfig, dump_yaml
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.runtime.dist import init_distributed, shutdown
from hpctrain.runtime.env import ProcessEnv, detect_env
from hpctrain.runtime.logs import log_device_binding, setup_rank_logging
from hpctrain.runtime.provenance import collect_provenance, write_provenance
from hpctrain.runtime.rundir import RunDir, run_name
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
    result: TrainResult | None = None
    try:
        ctx = init_distributed(cfg.run, env, cfg.parallel.strategy)
        log_device_binding(log, env, ctx.device)
        hosts = _gather_hosts(env.world_size)
        if env.rank == 0:
            (run_dir.config_dir / "config.yaml").write_text(dump_yaml(cfg))
            if source is not None:
                (run_dir.config_dir / f"source{source.suffix}").write_text(source.read_text())
            write_provenance(run_dir, collect_provenance(hosts))
        with MetricsWriter(run_dir, env) as metrics:
            trainer = Trainer(cfg, ctx, metrics)
            result = trainer.train()
        if env.world_size > 1:
            dist.barrier()
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}"
        log.error("rank %d failed: %s", env.rank, reason, exc_info=not _is_user_error(e))
        run_dir.write_exit_info(exit_code=_exit_code(e), reason=reason, last_checkpoint=None,
                                extra={"rank": env.rank, "host": socket.gethostname()})
        raise
    finally:
        shutdown()
    if env.rank == 0:
        run_dir.write_exit_info(exit_code=0, reason="completed", last_checkpoint=None,
                                extra={"steps": result.steps, "final_loss": result.final_loss,
                                       "tokens_per_s": result.tokens_per_s})
        log.info("run directory: %s", run_dir.root)
        log.info("done: %d steps, final loss %.4f, %.0f tokens/s per rank (%.0f in all)",
                 result.steps, result.final_loss, result.tokens_per_s,
                 result.tokens_per_s * env.world_size)
    return result


def _gather_hosts(world_size: int) -> list[str]:
    if world_size == 1:
        return [socket.gethostname()]
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return sorted(set(hosts))


def _is_user_error(e: BaseException) -> bool:
    from hpctrain.errors import HpctrainError

    return isinstance(e, HpctrainError)


def _exit_code(e: BaseException) -> int:
    if isinstance(e, KeyboardInterrupt):
        return 130
    return getattr(e, "exit_code", 1)
