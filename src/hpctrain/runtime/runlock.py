"""An exclusive lock on a run directory that works on NFS and Lustre, where ``flock`` may not.

Two runs writing one run directory interleave metrics and checkpoints, so a run holds
``<run>/run.lock`` from start to exit:

- the file is created with ``O_CREAT | O_EXCL``, atomic on local disks, NFSv3+ and Lustre; it
  holds JSON naming the holder: host, pid, start time, job (Slurm job or array task, torchrun
  run id) and attempt (Slurm restart count, torchrun restart count), and a random token;
- a daemon thread refreshes its mtime every ``HEARTBEAT_S`` (the heartbeat);
- a lock is stale when its holder is an earlier attempt of the same job (a requeue or a
  restart: Slurm and torchrun stop the old processes first), when it is on this host and its
  process is gone (and, for the local launcher, its ranks stopped heartbeating too), or when
  it is on another host and its heartbeat is older than ``STALE_S`` by our own clock (a
  heartbeat from the future counts as old as far ahead as it is);
- every field read back is checked (types, ranges, a start time not in the future): a lock
  that fails is "invalid", held while its file changes and stale ``STALE_S`` after it stopped;
- the file is never read or touched through a link, and a folder at its name is refused;
- taking over a stale lock goes through a second ``O_EXCL`` file, ``run.lock.takeover``: of
  several processes that find the same stale lock, exactly one replaces it.

The local launcher holds the lock across ``--max-restarts`` and hands its token to the ranks in
``HPCTRAIN_RUN_LOCK``; a rank with that token checks that the lock is still its launcher's and
heartbeats it too (`follow`): a launcher killed with -9 leaves the lock held for as long as any
of its ranks runs.

    lock = acquire(Path("runs/demo"))      # RunLockedError (exit 2) when another run holds it
    try: ...
    finally: lock.release()
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import stat
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
from hpctrain.runtime.safe_open import UnsafeRunPath, read_bytes, refuse
from hpctrain.shown import quoted

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
# The ranks of the local launcher heartbeat its lock more often: once its process is gone, the
# lock is stale as soon as they have stopped too (they die with it, see runtime/orphans.py).
RANK_HEARTBEAT_S = 2.0
RANK_STALE_S = 3 * RANK_HEARTBEAT_S
# Marks a holder whose fields failed the check, with the reason (never written to a lock).
INVALID = "invalid"
_PID_MAX = 2**31 - 1


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
    """A held lock: keeps its heartbeat going until `release` (``owner``: removes it then)."""

    def __init__(self, path: Path, info: dict[str, Any], heartbeat_s: float = HEARTBEAT_S, *,
                 owner: bool = True):
        self.path = path
        self.info = info
        self.token: str = info["token"]
        self.owner = owner
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
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(self.path, follow_symlinks=False)

    def stop(self) -> None:
        """Stop the heartbeat; the lock file stays (e.g. to move the run directory with it)."""
        self._stop.set()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours (idempotent)."""
        self.stop()
        holder = _read(self.path)
        if self.owner and holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def acquire(root: Path, attempt: JobAttempt | None = None, *, stale_s: float = STALE_S,
            heartbeat_s: float = HEARTBEAT_S, ranks: bool = False) -> RunLock:
    """Take the lock of run directory ``root`` (created if missing) or raise RunLockedError.

    ``ranks``: the caller is the local launcher, whose ranks `follow` the lock.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    attempt = attempt or current_attempt()
    info = _new_info(attempt, ranks)
    # The ranks of a launcher that was just killed die with it within a heartbeat or two:
    # a rerun right after waits for that rather than failing.
    orphans_deadline = time.monotonic() + 2 * RANK_STALE_S
    for _ in range(_ATTEMPTS):
        if _create(path, info):
            return RunLock(path, info, heartbeat_s)
        holder, key, age = inspect_lock(path)
        if key is None:
            continue  # released between our create and our read: try again
        why = stale_reason(holder, age, attempt, stale_s)
        if why is None and _ranks_only(holder) and time.monotonic() < orphans_deadline:
            time.sleep(RANK_STALE_S / 10)  # 20 looks at most, within _ATTEMPTS
            continue
        if why is None:
            raise _locked_error(root, path, holder, age)
        if _take_over(path, key, info):
            lock = RunLock(path, info, heartbeat_s)
            lock.took_over = (f"took over the stale lock of {root}: {why} "
                              f"({describe(holder) if holder else 'unreadable lock file'})")
            return lock
    holder, _, age = inspect_lock(path)
    raise _locked_error(root, path, holder, age)


def follow(root: Path, token: str, heartbeat_s: float | None = None) -> RunLock:
    """As a rank of the local launcher: check its lock (`check_held`) and heartbeat it until
    `release`, which leaves the file to the launcher."""
    check_held(root, token)
    return RunLock(Path(root) / LOCK_NAME, {"token": token},
                   RANK_HEARTBEAT_S if heartbeat_s is None else heartbeat_s, owner=False)


def check_held(root: Path, token: str) -> None:
    """Raise RunLockedError unless ``root``'s lock carries ``token`` (the launcher's)."""
    path = Path(root) / LOCK_NAME
    holder, _, age = inspect_lock(path)
    if holder is None or holder.get("token") != token:
        raise RunLockedError(
            f"this rank's launcher does not hold the lock of {root}",
            expected=f"{path} to carry the token in ${TOKEN_ENV}",
            hint=f"the lock now says: {describe(holder) if holder else 'no holder'}; start "
            f"ranks through `hpctrain train --nproc N`, or unset {TOKEN_ENV}")


def stale_reason(holder: dict[str, Any] | None, age: float, attempt: JobAttempt,
                 stale_s: float = STALE_S) -> str | None:
    """Why a lock whose file was last touched ``age`` seconds ago is stale, or None if held."""
    if holder is None or INVALID in holder:
        # Created but never written: its creator died in between (or is writing right now).
        # An invalid one may be a live run of another version: wait for it to stop changing.
        what = f"invalid lock file ({holder[INVALID]})" if holder else "unreadable lock file"
        return f"{what} untouched for {age:.0f} s" if age > stale_s else None
    job = holder.get("job")
    if job is not None and job == attempt.job:
        previous = tuple(holder.get("attempt") or (0, 0))
        if attempt.attempt > previous:
            return f"it was taken by an earlier attempt {list(previous)} of job {job}"
    if holder.get("host") == socket.gethostname():
        if _alive(holder["pid"], holder["started"]) or _ranks_only(holder, age):
            return None
        ranks = " and its ranks stopped" if holder.get("ranks") else ""
        return f"process {holder['pid']} on this host is gone{ranks}"
    if age > stale_s:
        return f"no heartbeat for {age:.0f} s (more than {stale_s:.0f} s)"
    return None


def _ranks_only(holder: dict[str, Any] | None, age: float | None = None) -> bool:
    """Whether only the ranks of a gone local launcher (on this host) keep the lock fresh."""
    if not (holder and holder.get("ranks") and INVALID not in holder
            and holder.get("host") == socket.gethostname()
            and not _alive(holder["pid"], holder["started"])):
        return False
    return age is None or age <= RANK_STALE_S


def describe(holder: dict[str, Any]) -> str:
    """Host, pid, start time and job of a lock's holder, for messages."""
    if INVALID in holder:
        return f"an invalid lock file ({holder[INVALID]})"
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
    if holder and INVALID in holder:
        return RunLockedError(
            f"run directory {root} holds {who}, changed {age:.0f} s ago",
            expected="a lock file written by hpctrain",
            hint=f"it is taken as stale once untouched for {STALE_S:.0f} s (a live run of "
            f"another hpctrain version keeps touching it); or delete {path}")
    if _ranks_only(holder, age):
        return RunLockedError(
            f"run directory {root} is in use: the launcher ({describe(holder)}) is gone but "
            f"its ranks still heartbeat the lock ({age:.0f} s ago)",
            expected="one run per run directory",
            hint=f"stop those ranks (processes with {TOKEN_ENV}={holder['token']} in their "
            "environment); the lock is stale once they are gone")
    return RunLockedError(
        f"run directory {root} is in use by another run: {who} (last heartbeat {age:.0f} s ago)",
        expected="one run per run directory",
        hint=f"wait for that run to end, or pick another run.name; if it is gone on another "
        f"host, its lock turns stale {STALE_S:.0f} s after its last heartbeat (or delete {path})")


def _new_info(attempt: JobAttempt, ranks: bool = False) -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
            "started_utc": datetime.fromtimestamp(now, tz=timezone.utc).isoformat(),
            "job": attempt.job, "attempt": list(attempt.attempt),
            "token": uuid.uuid4().hex, "ranks": ranks,
            # The file is world-readable: no secret from the command line goes into it.
            "command": " ".join(redact_argv(sys.argv))[:1000]}


def _create(path: Path, info: dict[str, Any]) -> bool:
    """Create ``path`` holding ``info`` if it does not exist; False if it does."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
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
    """The holder in a lock file (with ``INVALID`` if a field fails its check), or None if it
    is missing, unreadable or a link."""
    try:
        holder = json.loads(read_bytes(path))
    except (OSError, ValueError, UnsafeRunPath):
        return None
    if not isinstance(holder, dict):
        return None
    why = _invalid(holder)
    return holder if why is None else {INVALID: why, "token": None}


def _invalid(holder: dict[str, Any]) -> str | None:
    """Why a holder read back from a lock file cannot be trusted, or None."""
    def whole(v: Any, low: int, high: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high

    pid, started, attempt = holder.get("pid"), holder.get("started"), holder.get("attempt")
    if not (isinstance(holder.get("host"), str) and 0 < len(holder["host"]) <= 255):
        return f"host {quoted(holder.get('host'), 40)} is not a host name"
    if not whole(pid, 1, _PID_MAX):
        return f"pid {quoted(pid, 40)} is not a process id"
    # Our own clock judges: a start in the future (beyond another host's clock skew) is made up.
    if not (isinstance(started, int | float) and not isinstance(started, bool)
            and math.isfinite(started) and 0 <= started <= time.time() + STALE_S):
        return f"start time {quoted(started, 40)} is not a time up to now"
    if holder.get("host") == socket.gethostname() and started > time.time() + 1:
        return f"start time {quoted(started, 40)} is in this host's future"
    if not (isinstance(attempt, list) and len(attempt) == 2
            and all(whole(a, 0, _PID_MAX) for a in attempt)):
        return f"attempt {quoted(attempt, 40)} is not two restart counts"
    if not (holder.get("job") is None or isinstance(holder["job"], str)):
        return f"job {quoted(holder['job'], 40)} is not a job id"
    if not (isinstance(holder.get("token"), str) and holder["token"]):
        return f"token {quoted(holder.get('token'), 40)} is not a token"
    if not isinstance(holder.get("ranks", False), bool):
        return f"ranks {quoted(holder['ranks'], 40)} is not true or false"
    return None


def inspect_lock(path: Path) -> tuple[dict[str, Any] | None, tuple | None, float]:
    """(holder, identity of this very file, seconds since its last heartbeat); key None if gone.
    Every reader of a lock (acquire, `runs`, `report`) judges it through this.

    The age is the distance to our clock either way: a heartbeat in the future is no sign of
    life (only a skew within ``STALE_S`` is forgiven). UnsafeRunPath if it is not a file.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None, 0.0
    if stat.S_ISLNK(st.st_mode):
        raise refuse(path, "a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise refuse(path, "not a regular file")
    holder = _read(path)
    token = holder.get("token") if holder else None
    # The token tells two lock files apart; inode and size do for one not (yet) written.
    return holder, (token, st.st_ino, st.st_size), abs(time.time() - st.st_mtime)


def _take_over(path: Path, stale_key: tuple, info: dict[str, Any]) -> bool:
    """Replace the stale lock identified by ``stale_key`` with ours; False if we lost a race."""
    mutex = path.with_name(path.name + TAKEOVER_SUFFIX)
    if not _create(mutex, info):
        holder, key, age = inspect_lock(mutex)
        if key is not None and stale_reason(holder, age, JobAttempt(None, (0, 0)),
                                            TAKEOVER_STALE_S):
            # Its owner died inside a takeover. (Two processes that both find it abandoned
            # could both remove it; that needs a crash within milliseconds of a takeover.)
            with contextlib.suppress(FileNotFoundError):
                mutex.unlink()
        time.sleep(0.05)
        return False
    try:
        _, key, _ = inspect_lock(path)
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
    except (psutil.NoSuchProcess, OverflowError, ValueError):
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

