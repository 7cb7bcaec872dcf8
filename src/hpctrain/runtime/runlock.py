"""An exclusive lock on a run directory that works on NFS and Lustre, where ``flock`` may not.

Two runs writing one run directory interleave metrics and checkpoints, so a run holds
``<run>/run.lock`` from start to exit:

- the file is created with ``O_CREAT | O_EXCL``, atomic on local disks, NFSv3+ and Lustre; it
  holds JSON naming the holder: host, pid, start time, job (Slurm job or array task, torchrun
  run id) and attempt (Slurm restart count, torchrun restart count), and a random token;
- a daemon thread refreshes its mtime every ``HEARTBEAT_S`` (the heartbeat);
- a lock is stale when its holder is an earlier attempt of the same job (a requeue or a
  restart: Slurm and torchrun stop the old processes first), when it is on this host and its
  process is gone, or when it is on another host and its heartbeat is older than ``STALE_S``;
- taking over a stale lock goes through a second ``O_EXCL`` file, ``run.lock.takeover``: of
  several processes that find the same stale lock, exactly one replaces it.

The local launcher holds the lock across ``--max-restarts`` and hands its token to the ranks in
``HPCTRAIN_RUN_LOCK``; a rank with that token checks that the lock is still its launcher's.

    lock = acquire(Path("runs/demo"))      # RunLockedError (exit 2) when another run holds it
    try: ...
    finally: lock.release()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from hpctrain.errors import HpctrainError
from hpctrain.runtime.redact import redact_argv

log = logging.getLogger("hpctrain.runlock")

LOCK_NAME = "run.lock"
TAKEOVER_SUFFIX = ".takeover"
# The launcher's token, inherited by the ranks it starts.
TOKEN_ENV = "HPCTRAIN_RUN_LOCK"
HEARTBEAT_S = 10.0
# Generous against NFS attribute caching (actimeo up to 60 s) and clock skew between hosts.
STALE_S = 120.0
# A takeover takes milliseconds; its mutex is abandoned only if its owner died inside it.
TAKEOVER_STALE_S = 30.0
_ATTEMPTS = 50


class RunLockedError(HpctrainError):
    """The run directory is held by another live run."""


@dataclass(frozen=True)
class JobAttempt:
    """Which job this process belongs to, and which attempt of it (requeue/restart count)."""

    job: str | None
    attempt: tuple[int, int]


def current_attempt(environ: Mapping[str, str] | None = None) -> JobAttempt:
    """This process's job identity from Slurm and torchrun variables (None when neither)."""
    env = os.environ if environ is None else environ
    parts = []
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        parts.append(f"slurm:{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}")
    elif env.get("SLURM_JOB_ID"):
        parts.append(f"slurm:{env['SLURM_JOB_ID']}")
    # torchrun's default rendezvous id is the literal "none", shared by unrelated jobs.
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        parts.append(f"torchelastic:{env['TORCHELASTIC_RUN_ID']}")
    restarts = (_count(env, "SLURM_RESTART_COUNT"), _count(env, "TORCHELASTIC_RESTART_COUNT"))
    return JobAttempt("/".join(parts) or None, restarts)


class RunLock:
    """A held lock: keeps its heartbeat going until `release`."""

    def __init__(self, path: Path, info: dict[str, Any], heartbeat_s: float = HEARTBEAT_S):
        self.path = path
        self.info = info
        self.token: str = info["token"]
        # Why a stale lock was replaced to get this one (for the run's log), else None.
        self.took_over: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,),
                                         name="hpctrain-run-lock", daemon=True)
        self._thread.start()

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            holder = _read(self.path)
            if holder is None or holder.get("token") != self.token:
                log.error("run lock %s was taken by %s: two runs may now write this directory",
                          self.path, describe(holder) if holder else "nobody (removed)")
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def stop(self) -> None:
        """Stop the heartbeat; the lock file stays (e.g. to move the run directory with it)."""
        self._stop.set()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours (idempotent)."""
        self.stop()
        holder = _read(self.path)
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def acquire(root: Path, attempt: JobAttempt | None = None, *, stale_s: float = STALE_S,
            heartbeat_s: float = HEARTBEAT_S) -> RunLock:
    """Take the lock of run directory ``root`` (created if missing) or raise RunLockedError."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    attempt = attempt or current_attempt()
    info = _new_info(attempt)
    for _ in range(_ATTEMPTS):
        if _create(path, info):
            return RunLock(path, info, heartbeat_s)
        holder, key, age = _inspect(path)
        if key is None:
            continue  # released between our create and our read: try again
        why = stale_reason(holder, age, attempt, stale_s)
        if why is None:
            raise _locked_error(root, path, holder, age)
        if _take_over(path, key, info):
            lock = RunLock(path, info, heartbeat_s)
            lock.took_over = (f"took over the stale lock of {root}: {why} "
                              f"({describe(holder) if holder else 'unreadable lock file'})")
            return lock
    holder, _, age = _inspect(path)
    raise _locked_error(root, path, holder, age)


def check_held(root: Path, token: str) -> None:
    """Raise RunLockedError unless ``root``'s lock carries ``token`` (the launcher's)."""
    path = Path(root) / LOCK_NAME
    holder, _, age = _inspect(path)
    if holder is None or holder.get("token") != token:
        raise RunLockedError(
            f"this rank's launcher does not hold the lock of {root}",
            expected=f"{path} to carry the token in ${TOKEN_ENV}",
            hint=f"the lock now says: {describe(holder) if holder else 'no holder'}; start "
            f"ranks through `hpctrain train --nproc N`, or unset {TOKEN_ENV}")


def stale_reason(holder: dict[str, Any] | None, age: float, attempt: JobAttempt,
                 stale_s: float = STALE_S) -> str | None:
    """Why a lock whose file was last touched ``age`` seconds ago is stale, or None if held."""
    if holder is None:
        # Created but never written: its creator died in between (or is writing right now).
        return f"unreadable lock file untouched for {age:.0f} s" if age > stale_s else None
    job = holder.get("job")
    if job is not None and job == attempt.job:
        previous = tuple(holder.get("attempt") or (0, 0))
        if attempt.attempt > previous:
            return f"it was taken by an earlier attempt {list(previous)} of job {job}"
    if holder.get("host") == socket.gethostname():
        if not _alive(holder.get("pid"), holder.get("started")):
            return f"process {holder.get('pid')} on this host is gone"
        return None
    if age > stale_s:
        return f"no heartbeat for {age:.0f} s (more than {stale_s:.0f} s)"
    return None


def describe(holder: dict[str, Any]) -> str:
    """Host, pid, start time and job of a lock's holder, for messages."""
    started = holder.get("started")
    when = (datetime.fromtimestamp(started, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if isinstance(started, int | float) else "unknown time")
    text = f"host {holder.get('host')}, pid {holder.get('pid')}, started {when}"
    if holder.get("job"):
        text += f", job {holder['job']}"
    return text


def _locked_error(root: Path, path: Path, holder: dict[str, Any] | None,
                  age: float) -> RunLockedError:
    who = describe(holder) if holder else "a run whose lock file is still being written"
    return RunLockedError(
        f"run directory {root} is in use by another run: {who} (last heartbeat {age:.0f} s ago)",
        expected="one run per run directory",
        hint=f"wait for that run to end, or pick another run.name; if it is gone on another "
        f"host, its lock turns stale {STALE_S:.0f} s after its last heartbeat (or delete {path})")


def _new_info(attempt: JobAttempt) -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
            "started_utc": datetime.fromtimestamp(now, tz=timezone.utc).isoformat(),
            "job": attempt.job, "attempt": list(attempt.attempt),
            "token": uuid.uuid4().hex,
            # The file is world-readable: no secret from the command line goes into it.
            "command": " ".join(redact_argv(sys.argv))[:1000]}


def _create(path: Path, info: dict[str, Any]) -> bool:
    """Create ``path`` holding ``info`` if it does not exist; False if it does."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)
    return True


def _read(path: Path) -> dict[str, Any] | None:
    """The holder in a lock file, or None if it is missing or unreadable."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _inspect(path: Path) -> tuple[dict[str, Any] | None, tuple | None, float]:
    """(holder, identity of this very file, seconds since its last heartbeat); key None if gone."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None, None, 0.0
    holder = _read(path)
    token = holder.get("token") if holder else None
    # The token tells two lock files apart; inode and size do for one not (yet) written.
    return holder, (token, st.st_ino, st.st_size), max(0.0, time.time() - st.st_mtime)


def _take_over(path: Path, stale_key: tuple, info: dict[str, Any]) -> bool:
    """Replace the stale lock identified by ``stale_key`` with ours; False if we lost a race."""
    mutex = path.with_name(path.name + TAKEOVER_SUFFIX)
    if not _create(mutex, info):
        holder, key, age = _inspect(mutex)
        if key is not None and stale_reason(holder, age, JobAttempt(None, (0, 0)),
                                            TAKEOVER_STALE_S):
            # Its owner died inside a takeover. (Two processes that both find it abandoned
            # could both remove it; that needs a crash within milliseconds of a takeover.)
            with contextlib.suppress(FileNotFoundError):
                mutex.unlink()
        time.sleep(0.05)
        return False
    try:
        _, key, _ = _inspect(path)
        if key != stale_key:
            return False  # someone else replaced it meanwhile: judge the new holder afresh
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # A plain O_EXCL create by a newcomer may still win here; then it holds the lock.
        return _create(path, info)
    finally:
        with contextlib.suppress(FileNotFoundError):
            mutex.unlink()


def _alive(pid: Any, started: Any) -> bool:
    """Whether ``pid`` runs on this host and is not a younger process that reused the pid."""
    if not isinstance(pid, int):
        return False
    try:
        created = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # exists, but we may not look at it
    # A process younger than the lock only reused the holder's pid.
    return not (isinstance(started, int | float) and created > started + 1.0)


def _count(env: Mapping[str, str], name: str) -> int:
    try:
        return max(0, int(env.get(name, "0") or 0))
    except ValueError:
        return 0

