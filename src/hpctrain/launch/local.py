"""Start N ranks on this machine through PyTorch's elastic launcher (what torchrun runs).

The launcher resolves and locks the run directory once, holds the lock across restarts and
hands the same name (and the lock's token) to every rank, so nobody writes a torchrun line and
all ranks agree on where to write. When any rank fails, the elastic agent stops the others
(SIGTERM, then SIGKILL) and, within ``max_restarts``, starts the group again; the failure is
recorded in the run's ``exit_info.json``. Its own exit code tells a wrapper what to do: 75
preempted (checkpoint committed), 130 Ctrl-C, 1 a rank failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hpctrain.config import JobConfig
from hpctrain.errors import HpctrainError, LaunchError
from hpctrain.plan.auto import CPU, resolve_auto
from hpctrain.plan.gpu import gpu_without_cuda
from hpctrain.runtime import early_signals
from hpctrain.runtime.env import detect_env
from hpctrain.runtime.exit_codes import HUNG, PREEMPTED
from hpctrain.runtime.interrupted import INTERRUPTED, Interrupted
from hpctrain.runtime.orphans import LAUNCHER_PID_ENV
from hpctrain.runtime.rundir import RunDir
from hpctrain.runtime.runlock import TOKEN_ENV
from hpctrain.train.job import check_device_fits, claim_run_dir

log = logging.getLogger("hpctrain.launch")


# The elastic agent itself forwards these to the workers (then SIGKILLs after the grace).
_AGENT_HANDLED = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


def launch_training(cfg: JobConfig, config: Path, overrides: list[str], nproc: int, *,
                    max_restarts: int = 0, fresh: bool = False) -> None:
    """``hpctrain train CONFIG --nproc N``: lock the run directory, run the ranks, unlock."""
    check_nproc(nproc)  # before the run directory is claimed
    check_device_fits(cfg)  # once here, before any rank starts
    resolve_for_ranks(cfg, nproc)  # before the claim, which would otherwise ask CUDA
    claim = claim_run_dir(cfg, detect_env(), fresh=fresh, world_size=nproc, ranks=True)
    for note in claim.notes:
        print(f"hpctrain: {note}", file=sys.stderr)
    run_dir = claim.run_dir
    try:
        run_dir.create()
        # The ranks write exactly here (suffix resolved once) and find the lock ours.
        worker_args = ["train", str(config), *overrides, f"run.name={run_dir.root.name}",
                       "run.suffix=none"]
        os.environ[TOKEN_ENV] = claim.lock.token
        # The ranks die with this process (runtime/orphans.py), even by kill -9.
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # The profile signal too: `kill -URG <launcher>` profiles the ranks as it does one rank.
        forward = (*cfg.preempt.signals, *([cfg.profile.signal] if cfg.profile.signal else []))
        launch_local(nproc, worker_args, run_dir, run_id=time.strftime("%Y%m%d-%H%M%S"),
                     max_restarts=max_restarts, forward_signals=forward,
                     grace_s=cfg.preempt.grace_s)
    finally:
        os.environ.pop(TOKEN_ENV, None)
        os.environ.pop(LAUNCHER_PID_ENV, None)
        claim.lock.release()


def resolve_for_ranks(cfg: JobConfig, nproc: int) -> None:
    """Choose the config's ``auto`` values as the ranks will, without initialising CUDA here
    (hpctrain.plan.gpu): for this machine's GPU as NVML reads it, so that a job nothing fits
    is refused before any rank starts; where only CUDA could tell, for the CPU's stand-in,
    which checks the batch split and the layout (each rank sizes it on its own GPU)."""
    resolve_auto(cfg, nproc, gpu_without_cuda(cfg) or CPU)


def check_nproc(nproc: int) -> None:
    """Refuse ``--nproc`` below 1 or above what this machine can run: 8, two per CPU core, or
    one per GPU (each rank is a Python process with torch imported, ~0.3 GB: thousands of
    them are a fork bomb, not a job)."""
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc} must be >= 1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    most = max(8, 2 * (os.cpu_count() or 1), gpus)
    if nproc > most:
        raise LaunchError(f"--nproc {nproc} is more ranks than this machine can run",
                          expected=f"at most {most} (one per GPU, or up to two per CPU core)",
                          hint="use --nproc with the number of GPUs; spread more ranks over "
                          "nodes with sbatch")


def launch_local(nproc: int, worker_args: list[str], run_dir: RunDir, *, run_id: str,
                 max_restarts: int = 0, forward_signals: tuple[str, ...] = (),
                 grace_s: float = 120) -> None:
    """Run ``python -m hpctrain <worker_args>`` as ``nproc`` ranks; raise LaunchError on failure.

    Preemption signals reach the ranks: those the agent does not handle itself are forwarded
    by this process, and after SIGTERM the agent waits ``grace_s`` before SIGKILL so the ranks
    can commit their checkpoint.
    """
    check_nproc(nproc)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(grace_s)))
    # The ranks meet on the store the agent hosts (bound once, held for the whole launch).
    # Unshared, torch picks rank 0's port by binding port 0 and closing it, and rank 0 binds it
    # again seconds later: a concurrent launch (or any process) can take it meanwhile, and the
    # group then fails or meets a stranger's store. A restart's stale keys in the shared store
    # are kept apart by runtime.dist (a prefix per attempt).
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    for name in set(forward_signals) - _AGENT_HANDLED:
        signal.signal(getattr(signal, name), _forward_to_workers)
    if "OMP_NUM_THREADS" not in os.environ:
        # Each rank's intra-op pool would otherwise take every core: N ranks x all cores spin
        # against each other (measured 10x slower on 2 cores with 2 ranks). torchrun sets 1;
        # an equal share of the cores keeps CPU ranks fast and leaves GPU ranks room for data.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        log.info("OMP_NUM_THREADS=%s per rank (%d ranks)", os.environ["OMP_NUM_THREADS"], nproc)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        # torchrun --standalone: a c10d store on a free local port, no etcd, no fixed port.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir.logs_dir / "launcher")),
    )
    # The agent's warnings ("Received 2 death signal", "Sending process N closing signal")
    # would bury the one line this launcher prints; its errors still show.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    started = time.time()
    try:
        # Until the agent installs its own handlers (when the ranks start), a stop signal
        # would kill this process outright, or under `python -m hpctrain` be recorded and
        # ignored: raise what the agent raises instead, and answer one that came already.
        for name in _AGENT_HANDLED:
            signal.signal(getattr(signal, name), _raise_stop)
        if "SIGTERM" in early_signals.received:
            _raise_stop(signal.SIGTERM, None)
        elastic_launch(config, sys.executable)("-m", "hpctrain", *worker_args)
    except ChildFailedError as e:
        # After a preemption the ranks exit with 75; one still on its way out may be stopped
        # by the agent's signal, which changes its exit code, not the outcome.
        codes = [f.exitcode for f in e.failures.values()]
        if PREEMPTED in codes and all(c == PREEMPTED or c < 0 for c in codes):
            # The ranks checkpointed and wrote exit_info.json themselves: keep their account.
            raise _preempted(run_dir) from None
        rank, failure = blamed_failure(e.failures)
        reason = f"rank {rank} exited with code {failure.exitcode}"
        if failure.exitcode < 0:
            reason += f" ({failure.signal_name()})"
        recorded = run_dir.failure_since(started)
        # Whose account stays: a watchdog's (it names the rank that fell behind), else the
        # launcher's when a rank was killed by a signal (it could write nothing; a peer's
        # "connection closed" is only the echo), else the rank's own error message.
        keep = recorded is not None and (recorded.get("exit_code") == HUNG
                                         or failure.exitcode >= 0)
        if not keep:
            error_file = failure.error_file if os.path.isfile(failure.error_file) else None
            run_dir.write_exit_info(exit_code=1, reason=reason,
                                    last_checkpoint=run_dir.latest_checkpoint(),
                                    extra={"failed_ranks": sorted(e.failures),
                                           "error_file": error_file})
        account, details = _own_account(recorded, rank)
        raise LaunchError(
            f"training failed: {reason}{account}",
            lines=[*details, *_others(e.failures, rank)],
            hint=f"see {run_dir.rank_log(rank)} and {run_dir.exit_info_path}",
        ) from None
    except SignalException as e:
        # The agent has stopped the ranks (same signal, then SIGKILL after the grace).
        raise _stopped_by(signal.Signals(e.sigval), run_dir, started) from None


# Once a rank has failed, torch's agent SIGTERMs the others and SIGKILLs those still alive
# this long after (SubprocessContext.close's default timeout, which the agent does not change).
_AGENT_KILL_AFTER_S = 30


def blamed_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank that failed first; one the agent stopped is a victim, not a cause.

    torch's own choice is the smallest timestamp, but timestamps are whole seconds and a rank
    killed by a signal gets the time the agent noticed: ties and inversions are common. So: a
    rank killed by another signal first (it could not report), then one that aborted (SIGABRT:
    often std::terminate in gloo's thread once a peer's connection broke, so a consequence
    more often than a cause), then one that exited by itself, then the agent's victims
    (see :func:`_stopped_by_agent`); earliest within.
    """
    first = min(f.timestamp for f in failures.values())

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
        rank, failure = item
        code = failure.exitcode
        if _stopped_by_agent(failure, first):
            tier = 3
        elif code < 0 and code != -signal.SIGABRT:
            tier = 0
        elif code == -signal.SIGABRT:
            tier = 1
        else:
            tier = 2
        return tier, failure.timestamp, rank

    return min(failures.items(), key=order)


def _stopped_by_agent(failure: ProcessFailure, first: int) -> bool:
    """Whether the agent ended this rank after another's failure noticed at ``first``:
    SIGTERM, exit 75 (it checkpointed on that SIGTERM), or a SIGKILL noticed the agent's grace
    later (a rank that died of SIGKILL by itself, OOM-killed say, is noticed with the rest)."""
    code = failure.exitcode
    return (code in (-signal.SIGTERM, PREEMPTED)
            or (code == -signal.SIGKILL and failure.timestamp - first >= _AGENT_KILL_AFTER_S))


def _own_account(recorded: dict | None, rank: int) -> tuple[str, list[str]]:
    """The blamed rank's own exit_info reason (its exception and where the user's code raised
    it) as ``": first line"`` and the lines after, less its hint; nothing if another wrote it."""
    if recorded is None or recorded.get("extra", {}).get("rank") != rank:
        return "", []
    first, *rest = str(recorded["reason"]).splitlines() or [""]
    return f": {first}", [line for line in rest if not line.strip().startswith("HINT:")]


def _others(failures: dict[int, ProcessFailure], blamed: int) -> list[str]:
    """One line for each rank but the blamed one: stopped by the launcher, or failed too."""
    first = min(f.timestamp for f in failures.values())
    lines = []
    for rank, failure in sorted(failures.items()):
        if rank == blamed:
            continue
        code = failure.exitcode
        how = failure.signal_name() if code < 0 else f"exit code {code}"
        lines.append(f"  rank {rank} stopped by the launcher ({how})"
                     if _stopped_by_agent(failure, first) else f"  rank {rank} failed too ({how})")
    return lines


def _preempted(run_dir: RunDir) -> LaunchError:
    err = LaunchError(f"preempted: all ranks checkpointed and exited with {PREEMPTED}",
                      hint=f"rerun the same command to resume from "
                      f"{run_dir.latest_checkpoint()} (see {run_dir.exit_info_path})")
    err.exit_code = PREEMPTED
    return err


def _stopped_by(sig: signal.Signals, run_dir: RunDir, started: float) -> HpctrainError:
    """The error (and exit code) for a launcher stopped by ``sig``: 75, 130 or 128 + sig."""
    recorded = run_dir.failure_since(started)
    if recorded is not None and recorded.get("exit_code") == PREEMPTED:
        return _preempted(run_dir)  # SIGTERM in preempt.signals: the ranks checkpointed
    latest = run_dir.latest_checkpoint()
    if sig == signal.SIGINT:
        if recorded is None:
            run_dir.write_exit_info(exit_code=INTERRUPTED, reason="interrupted by SIGINT "
                                    "(Ctrl-C) to the launcher", last_checkpoint=latest)
        return Interrupted(run_dir.root, latest)
    reason = f"the launcher was stopped by {sig.name} before the ranks committed a checkpoint"
    if recorded is None:
        run_dir.write_exit_info(exit_code=128 + sig, reason=reason, last_checkpoint=latest)
    err = LaunchError(reason, hint=f"add {sig.name} to preempt.signals to checkpoint on it; "
                      f"a rerun resumes from {latest or 'step 0 (no checkpoint yet)'}")
    err.exit_code = 128 + sig
    return err


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, its process group and every descendant.

    The elastic agent starts each worker in a session of its own, so killing the launcher's
    group alone would leave the ranks running (and holding the caller's pipes open).
    """
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        kids = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            kid.kill()


def _raise_stop(signum: int, frame) -> None:
    sig = signal.Signals(signum)
    raise SignalException(f"launcher got {sig.name}", sigval=sig)


def _forward_to_workers(signum: int, frame) -> None:
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)
