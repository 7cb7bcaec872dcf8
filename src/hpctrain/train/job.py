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
import yaml

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config import JobConfig, dump_yaml
from hpctrain.errors import ConfigError, DataError, HpctrainError, RuntimeEnvError
from hpctrain.models.registry import count_params
from hpctrain.observe.goodput import GoodputClock, summary
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.profile import write_oom_snapshot
from hpctrain.plan.auto import AUTO_FILE, Resolution, resolve_auto
from hpctrain.runtime.config import refuse_large_model_on_cpu
from hpctrain.runtime.dist import Distributed, init_distributed, shutdown
from hpctrain.runtime.env import ProcessEnv, detect_env
from hpctrain.runtime.exit_codes import PREEMPTED
from hpctrain.runtime.exit_info import exit_info_or_none
from hpctrain.runtime.interrupted import INTERRUPTED, Interrupted
from hpctrain.runtime.logs import log_device_binding, setup_rank_logging
from hpctrain.runtime.orphans import die_with_launcher
from hpctrain.runtime.provenance import collect_provenance, write_provenance
from hpctrain.runtime.requeue import requeue
from hpctrain.runtime.rundir import (
    RunDir,
    archive_run,
    check_can_write,
    check_run_dir,
    real_run_root,
    run_name,
)
from hpctrain.runtime.runlock import (
    TOKEN_ENV,
    RunLock,
    RunLockedError,
    acquire,
    current_attempt,
    follow,
)
from hpctrain.runtime.safe_open import write_atomic
from hpctrain.runtime.watchdog import Watchdog, enable_flight_recorder
from hpctrain.task import Task, TaskError
from hpctrain.train import preflight
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
    # Every writer refuses links inside it, so a link of the user's own is followed here once.
    return RunDir(real_run_root(Path(cfg.run.out_dir) / name))


@dataclass
class Claim:
    """A locked run directory, and what was done to get it (for the user)."""

    run_dir: RunDir
    lock: RunLock
    notes: list[str] = field(default_factory=list)


def claim_run_dir(cfg: JobConfig, env: ProcessEnv, *, fresh: bool = False,
                  world_size: int | None = None, ranks: bool = False) -> Claim:
    """Lock this run's directory (RunLockedError if a live run holds it) once every check
    before the first step has passed (train/preflight.py): a refused run writes nothing there.

    With ``fresh`` a previous run there is first archived under a new name, never deleted.
    ``world_size``: the ranks the run will have (default: this process's job).
    ``ranks``: the caller is the local launcher, whose ranks heartbeat the lock too.
    """
    resolve_auto(cfg, world_size or env.world_size)  # as the ranks will (a no-op once resolved)
    preflight.check_config(cfg, world_size or env.world_size)  # before --fresh moves anything
    run_dir = resolve_run_dir(cfg, env)
    # Before anything is written there: links planted in it are refused (safe_open.py), and
    # a folder that cannot be written fails now rather than at the first save.
    notes = check_run_dir(run_dir.root)
    check_can_write(run_dir.root)
    attempt = current_attempt()
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
    lock = acquire(run_dir.root, attempt, ranks=ranks)
    try:
        # Under the lock: what the directory holds cannot change between check and start.
        preflight.check_run_dir(cfg, run_dir)
    except BaseException:
        lock.release()
        raise
    if lock.took_over:
        notes.append(lock.took_over)
    return Claim(run_dir, lock, notes)


def check_device_fits(cfg: JobConfig) -> None:
    """Refuse a GPU-sized model that run.device=auto would put on the CPU (no GPU visible).

    A task's model exists only once its factory runs: the task trainer counts it there."""
    if cfg.task or cfg.run.device != "auto" or torch.cuda.is_available():
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
    if task is None:
        check_device_fits(cfg)  # before anything is allocated
    env = detect_env()
    # The values left to `auto`, for this run's GPUs; config/auto.yaml records them.
    chosen = resolve_auto(cfg, env.world_size)
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
        if chosen is not None:
            chosen.log()
        return _train(cfg, env, run_dir, ctx, preempt, source, task, chosen)
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
        # Started by `hpctrain train --nproc`: the launcher holds the lock for every restart;
        # this rank dies with it and heartbeats its lock meanwhile (orphans.py, runlock.py).
        die_with_launcher()
        run_dir = resolve_run_dir(cfg, env)
        return run_dir, follow(run_dir.root, token), None, []
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
           preempt: PreemptionFlag, source: Path | None, task: Task | None,
           chosen: Resolution | None = None) -> TrainResult:
    """Everything after the lock: process group, Trainer, exit info."""
    started = time.time()
    watchdog = trainer = ckpt = None
    # An earlier attempt's account, which a refusal of this one must leave as it is.
    earlier = run_dir.exit_info_path.exists()
    training = False  # until the loop starts, a user error is a refusal (see _REFUSALS)
    goodput = _goodput_clock(run_dir, env)
    goodput.startup_part("start")
    try:
        if ctx is None:
            ctx = init_distributed(cfg.run, env, cfg.parallel)
            goodput.startup_part("process_group")
        log_device_binding(log, env, ctx.device)
        if chosen is not None and env.world_size > 1:
            _same_choice_everywhere(chosen, ctx.control_group)
        hosts = _gather_hosts(env.world_size)
        watchdog = Watchdog(cfg.watchdog, run_dir, env.rank, hosts, _store())
        ckpt = CheckpointManager(cfg.checkpoint, run_dir.checkpoints_dir, rank=env.rank,
                                 world_size=env.world_size, device=ctx.device,
                                 group=ctx.checkpoint_group, timeout_s=cfg.run.timeout_s)
        with MetricsWriter(run_dir, env) as metrics:
            trainer = build_trainer(cfg, task, ctx, metrics, ckpt=ckpt, watchdog=watchdog,
                                    preempt=preempt, control=ControlChannel(ctx.control_group),
                                    goodput=goodput)
            goodput.startup_part("model_build")
            trainer.resume(cfg.checkpoint.resume)
            goodput.startup_part("checkpoint_load")
            # Once built and resumed: neither a refused run nor a rerun of a finished one
            # replaces the config the run was trained with.
            if env.rank == 0 and not trainer.complete:
                _record_config(run_dir, cfg, source, hosts, chosen, env.world_size)
            training = True
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
        if isinstance(e, _REFUSALS) and not training and earlier:
            # Refused before its first step in a directory that holds an earlier run: the
            # rank's log and the console say why; the records stay those of the run before.
            log.error("refused before the first step: %s", e.what)
            goodput.discard()
            raise
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
        if ckpt is not None:
            try:
                # A failure before the resume (the model's build) leaves the prefetch's checks
                # running, and the interpreter's exit would wait for them to hash every file.
                ckpt.cancel_prefetch()
            except Exception:  # noqa: BLE001 - never in place of the error being raised
                log.exception("stopping the checkpoint's verification failed")
        if watchdog is not None:
            watchdog.stop()
        shutdown()
    if result.already_complete:
        return _already_complete(cfg, env, run_dir, result, goodput)
    if env.rank == 0:
        run_dir.write_exit_info(exit_code=0, reason="completed",
                                last_checkpoint=trainer.last_checkpoint,
                                extra={"steps": result.steps, "final_loss": result.final_loss,
                                       "tokens_per_s": result.tokens_per_s,
                                       "world_size": env.world_size})
        log.info("run directory: %s", run_dir.root)
        log.info("done: %d steps, final loss %.4f, %s%s", result.steps, result.final_loss,
                 _rate(result.tokens_per_s, env.world_size),
                 f"; {summary(result.goodput)}" if result.goodput else "")
    return result


def _same_choice_everywhere(chosen: Resolution, group: dist.ProcessGroup | None) -> None:
    """Refuse a run whose ranks resolved `auto` differently: each chose alone, before the group
    was up, from its own GPU; a node with another GPU kind or memory would train another split
    of the batch."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, chosen.summary(), group=group)
    odd = next((r for r, values in enumerate(every) if values != every[0]), None)
    if odd is not None:
        raise ConfigError(
            f"auto chose differently on rank {odd} ({every[odd]}) than on rank 0 ({every[0]})",
            expected="one choice on every rank: GPUs of one kind and memory in a job",
            hint="give rank 0's values as overrides, or run on one kind of GPU")


def _rate(tokens_per_s: float | None, world_size: int) -> str:
    """``1234 tokens/s per rank (2468 in all)`` (train.window.Throughput's number)."""
    if tokens_per_s is None:
        return "tokens/s not measured"
    return f"{tokens_per_s:.0f} tokens/s per rank ({tokens_per_s * world_size:.0f} in all)"


def _already_complete(cfg: JobConfig, env: ProcessEnv, run_dir: RunDir, result: TrainResult,
                      goodput: GoodputClock) -> TrainResult:
    """A rerun of a finished run: say so, with the result the run saved; record nothing."""
    goodput.discard()  # no attempt: the run's account stays that of the attempts that trained
    saved = _saved_result(run_dir)
    loss, rate, ranks = (saved.get(k) for k in ("final_loss", "tokens_per_s", "world_size"))
    if env.rank == 0:
        log.info("run directory: %s", run_dir.root)
        log.info("already complete: %s finished step %d of train.steps=%d before (final loss "
                 "%s, %s); nothing to train. HINT: raise train.steps to train on, or add "
                 "--fresh (archives it) or choose run.name=NAME to start a new run",
                 run_dir.root.name, result.steps, cfg.train.steps,
                 f"{loss:.4f}" if isinstance(loss, int | float) else "not recorded",
                 _rate(rate if isinstance(rate, int | float) else None,
                       ranks if isinstance(ranks, int) else env.world_size))
    return TrainResult(result.steps, loss if isinstance(loss, int | float) else float("nan"),
                       rate if isinstance(rate, int | float) else None, None,
                       already_complete=True)


def _saved_result(run_dir: RunDir) -> dict:
    """What the run that finished here recorded in exit_info.json ({} if nothing usable)."""
    info = exit_info_or_none(run_dir.exit_info_path)
    if info is None or info["exit_code"] != 0:
        return {}
    extra = info.get("extra")
    return extra if isinstance(extra, dict) else {}


# The user errors that refuse a run at start-up (config, data, devices, lock); a damaged
# checkpoint or a failure while training is the run's own end and is recorded.
_REFUSALS = (ConfigError, DataError, RuntimeEnvError, RunLockedError, TaskError)


def _record_config(run_dir: RunDir, cfg: JobConfig, source: Path | None, hosts: list[str],
                   chosen: Resolution | None, world_size: int) -> None:
    """The config (``auto`` kept, so that it resumes on another GPU count) and what auto chose
    for these ranks, the config file as given, and provenance (rank 0)."""
    auto_file = run_dir.config_dir / AUTO_FILE
    if chosen is None:
        write_atomic(run_dir.config_dir / "config.yaml", dump_yaml(cfg).encode())
        auto_file.unlink(missing_ok=True)  # an earlier attempt's choice is not this config's
    else:
        write_atomic(run_dir.config_dir / "config.yaml", dump_yaml(chosen.as_given(cfg)).encode())
        write_atomic(auto_file, yaml.safe_dump(chosen.record(world_size),
                                               sort_keys=False).encode())
    if source is not None:
        write_atomic(run_dir.config_dir / f"source{source.suffix}", source.read_bytes())
    write_provenance(run_dir, collect_provenance(sorted(set(hosts))))


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
        # This attempt's throughput, as a completed run records it (train.window.Throughput).
        rate = {"tokens_per_s": trainer.throughput.tokens_per_s, "world_size": env.world_size}
        run_dir.write_exit_info(**info, extra={"requeued": False, **rate})
        requeued, how = requeue(env, cfg.checkpoint.max_requeues)
        log.info("requeue: %s", how)
        run_dir.write_exit_info(**info, extra={"requeued": requeued, "requeue": how, **rate})
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
