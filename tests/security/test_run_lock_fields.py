"""A run lock read back from disk is not trusted: absurd fields, a folder or a link at its name,
a heartbeat from the future; and the ranks of a killed launcher keep its lock held.

Every case ends in a clear error (exit 2) or a takeover that says why, never a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from hpctrain.errors import HpctrainError
from hpctrain.runtime import runlock
from hpctrain.runtime.runlock import JobAttempt, RunLockedError, acquire
from hpctrain.runtime.safe_open import UnsafeRunPath

LOCAL = JobAttempt(None, (0, 0))
HOST = socket.gethostname()


def write_holder(root: Path, holder: dict, *, age_s: float = 0.0) -> Path:
    """A lock file holding ``holder`` as JSON, its heartbeat ``age_s`` seconds old (< 0: future)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / runlock.LOCK_NAME
    path.write_text(json.dumps(holder))
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def valid(**fields) -> dict:
    base = {"host": "other-node", "pid": 4242, "started": time.time() - 60, "job": None,
            "attempt": [0, 0], "token": "hand-written"}
    return {**base, **fields}


ABSURD = {
    "huge pid": {"host": HOST, "pid": 10**30},
    "negative pid": {"host": HOST, "pid": -5},
    "pid as text": {"host": HOST, "pid": "1"},
    "time 10**30": {"started": 10**30},
    "time as text": {"started": "yesterday"},
    "host as number": {"host": 5},
    "attempt of text": {"attempt": "zz"},
    "attempt of three": {"attempt": [1, 2, 3]},
    "token as list": {"token": ["x"]},
    "job as number": {"job": 3},
}


@pytest.mark.parametrize("case", sorted(ABSURD))
def test_an_invalid_lock_is_held_while_fresh_and_taken_over_once_old(tmp_path: Path,
                                                                      case: str) -> None:
    root = tmp_path / "run"
    write_holder(root, valid(**ABSURD[case]))
    with pytest.raises(RunLockedError) as info:
        acquire(root, LOCAL)
    assert "invalid lock file" in info.value.what and "stale" in info.value.render()
    write_holder(root, valid(**ABSURD[case]), age_s=runlock.STALE_S + 30)
    lock = acquire(root, LOCAL)
    try:
        assert lock.took_over and "invalid lock file" in lock.took_over
        assert json.loads((root / "run.lock").read_text())["token"] == lock.token
    finally:
        lock.release()


def test_a_lock_that_is_a_folder_or_a_link_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / runlock.LOCK_NAME).mkdir(parents=True)
    old = time.time() - runlock.STALE_S - 30
    os.utime(root / runlock.LOCK_NAME, (old, old))
    with pytest.raises(UnsafeRunPath) as info:
        acquire(root, LOCAL)
    assert isinstance(info.value, HpctrainError) and info.value.exit_code == 2
    assert f"{root / runlock.LOCK_NAME} is not a regular file" in info.value.what
    assert (root / runlock.LOCK_NAME).is_dir()

    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps(valid()))
    before = victim.read_text()
    (root / runlock.LOCK_NAME).rmdir()
    (root / runlock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(UnsafeRunPath, match="run.lock is a symbolic link"):
        acquire(root, LOCAL)
    assert victim.read_text() == before


def test_a_heartbeat_from_the_future_is_not_trusted(tmp_path: Path) -> None:
    root = tmp_path / "run"
    # A little ahead: another host's clock may be skewed; still held.
    write_holder(root, valid(), age_s=-30)
    with pytest.raises(RunLockedError):
        acquire(root, LOCAL)
    # Far ahead: no clock is that skewed, and by ours it has not beaten for ages.
    write_holder(root, valid(), age_s=-10**6)
    lock = acquire(root, LOCAL)
    assert lock.took_over and "no heartbeat" in lock.took_over
    lock.release()


def test_a_start_time_in_the_future_does_not_make_a_live_pid_the_holder(tmp_path: Path) -> None:
    """A live process (our parent) with a lock dated after its start: not its lock."""
    root = tmp_path / "run"
    holder = valid(host=HOST, pid=os.getppid(), started=time.time() + 10**6)
    write_holder(root, holder, age_s=runlock.STALE_S + 30)
    lock = acquire(root, LOCAL)
    assert lock.took_over and "invalid lock file" in lock.took_over
    lock.release()


def test_the_ranks_of_a_killed_launcher_keep_its_lock_until_they_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runlock, "RANK_HEARTBEAT_S", 0.1)
    monkeypatch.setattr(runlock, "RANK_STALE_S", 1.0)
    root = tmp_path / "run"
    gone = _dead_pid()
    write_holder(root, valid(host=HOST, pid=gone, token="launcher", ranks=True))
    rank = runlock.follow(root, "launcher")  # a rank of that launcher, still running
    try:
        time.sleep(1.5)  # longer than RANK_STALE_S: only the rank's heartbeat keeps it fresh
        with pytest.raises(RunLockedError) as info:
            acquire(root, LOCAL)
        assert f"pid {gone}" in info.value.render() and "ranks" in info.value.render()
    finally:
        rank.release()
    assert (root / runlock.LOCK_NAME).exists()  # a rank never removes its launcher's lock
    lock = acquire(root, LOCAL)  # waits out RANK_STALE_S, then takes it
    assert lock.took_over and f"process {gone}" in lock.took_over
    lock.release()


def test_a_dead_single_process_lock_is_still_taken_at_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_holder(root, valid(host=HOST, pid=_dead_pid()))
    start = time.monotonic()
    acquire(root, LOCAL).release()
    assert time.monotonic() - start < 1.0


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
