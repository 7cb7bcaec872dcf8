"""The run-directory lock: one run per directory, stale locks, requeues and racing takeovers.

Unit tests drive `hpctrain.runtime.runlock` with hand-written lock files (another "host", a dead
pid, an earlier Slurm attempt); the race test starts real processes that all find the same stale
lock at once. End-to-end tests with two real `hpctrain train` runs are in test_run_lock_cli.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.runtime import runlock
from hpctrain.runtime.runlock import JobAttempt, RunLockedError, acquire, current_attempt

LOCAL = JobAttempt(None, (0, 0))


def write_lock(root: Path, *, host: str, pid: int, started: float | None = None,
               job: str | None = None, attempt: tuple[int, int] = (0, 0),
               age_s: float = 0.0) -> Path:
    """A lock file written by hand, its heartbeat `age_s` seconds old."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / runlock.LOCK_NAME
    started = time.time() - 60 if started is None else started
    path.write_text(json.dumps({"host": host, "pid": pid, "started": started, "job": job,
                                "attempt": list(attempt), "token": f"hand-{host}-{pid}"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_release_and_second_taker_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lock = acquire(root, LOCAL)
    try:
        holder = json.loads((root / "run.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunLockedError) as info:
            acquire(root, LOCAL)  # this process is alive and on this host: held
        assert info.value.exit_code == 2
        message = info.value.render()
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "started 20" in message and "UTC" in message
    finally:
        lock.release()
    assert not (root / "run.lock").exists()
    acquire(root, LOCAL).release()  # free again


def test_stale_lock_of_a_dead_pid_on_this_host_is_taken_at_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_lock(root, host=socket.gethostname(), pid=dead_pid())  # heartbeat fresh
    lock = acquire(root, LOCAL)
    assert json.loads((root / "run.lock").read_text())["token"] == lock.token
    lock.release()


def test_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    """The holder's pid now belongs to a process started after the lock: stale."""
    root = tmp_path / "run"
    write_lock(root, host=socket.gethostname(), pid=os.getppid(), started=time.time() - 10**7)
    # Our parent started long after a lock dated 1990-ish... so it only reused the pid.
    acquire(root, LOCAL).release()


def test_fresh_lock_of_another_host_is_refused_with_its_holder(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_lock(root, host="other-node-17", pid=4242, started=1_700_000_000.0, age_s=5)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(RunLockedError) as info:
        acquire(root, LOCAL)
    message = info.value.render()
    assert "other-node-17" in message and "pid 4242" in message
    assert "2023-11-14 22:13:20 UTC" in message
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written by the refusal


def test_lock_of_another_host_without_heartbeat_is_stale(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_lock(root, host="other-node-17", pid=4242, age_s=runlock.STALE_S + 30)
    lock = acquire(root, LOCAL)
    assert json.loads((root / "run.lock").read_text())["host"] == socket.gethostname()
    lock.release()


def test_requeued_slurm_job_takes_its_earlier_attempts_lock(tmp_path: Path) -> None:
    """A requeue may land on another node within seconds: the old lock's heartbeat is fresh."""
    root = tmp_path / "run"
    write_lock(root, host="node-a", pid=99, job="slurm:123", attempt=(0, 0))
    with pytest.raises(RunLockedError):  # the same attempt again is a second run
        acquire(root, current_attempt({"SLURM_JOB_ID": "123"}))
    with pytest.raises(RunLockedError):  # another job
        acquire(root, current_attempt({"SLURM_JOB_ID": "124", "SLURM_RESTART_COUNT": "1"}))
    lock = acquire(root, current_attempt({"SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "1"}))
    assert json.loads((root / "run.lock").read_text())["attempt"] == [1, 0]
    lock.release()


def test_job_identity_of_array_tasks_and_torchrun() -> None:
    array = current_attempt({"SLURM_JOB_ID": "131", "SLURM_ARRAY_JOB_ID": "130",
                             "SLURM_ARRAY_TASK_ID": "1", "SLURM_RESTART_COUNT": "2"})
    assert array == JobAttempt("slurm:130_1", (2, 0))
    elastic = current_attempt({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert elastic == JobAttempt("torchelastic:abc", (0, 3))
    # torchrun's default id "none" is shared by unrelated jobs: no identity.
    assert current_attempt({"TORCHELASTIC_RUN_ID": "none"}) == LOCAL
    assert current_attempt({}) == LOCAL


def test_heartbeat_refreshes_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lock = acquire(root, LOCAL, heartbeat_s=0.05)
    try:
        path = root / "run.lock"
        os.utime(path, (time.time() - 1000, time.time() - 1000))
        deadline = time.monotonic() + 30
        while time.time() - path.stat().st_mtime > 500:
            assert time.monotonic() < deadline, "heartbeat never touched the lock"
            time.sleep(0.05)
    finally:
        lock.release()


def test_release_leaves_a_lock_taken_by_someone_else(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lock = acquire(root, LOCAL)
    write_lock(root, host="other-node", pid=7)  # e.g. an operator removed ours, a run took it
    lock.release()
    assert json.loads((root / "run.lock").read_text())["host"] == "other-node"


def test_takeover_of_a_lock_already_replaced_is_refused(tmp_path: Path) -> None:
    """B judged the old lock stale, but A replaced it first: B must not remove A's lock."""
    root = tmp_path / "run"
    path = write_lock(root, host=socket.gethostname(), pid=dead_pid())
    _, stale_key, _ = runlock.inspect_lock(path)
    a = acquire(root, LOCAL)  # A takes over
    b_info = runlock._new_info(LOCAL)
    assert runlock._take_over(path, stale_key, b_info) is False
    assert json.loads(path.read_text())["token"] == a.token
    assert not path.with_name("run.lock.takeover").exists()
    a.release()


def test_unwritten_lock_file_counts_as_held_until_old(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "run.lock").write_text("")  # a creator between O_EXCL and its write
    with pytest.raises(RunLockedError):
        acquire(root, LOCAL)
    old = time.time() - runlock.STALE_S - 30
    os.utime(root / "run.lock", (old, old))
    acquire(root, LOCAL).release()


CONTENDER = """
import json, sys, time
from pathlib import Path
from hpctrain.runtime.runlock import JobAttempt, RunLockedError, acquire
root, go, done = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
try:
    lock = acquire(root, JobAttempt(None, (0, 0)))
except RunLockedError:
    print("LOST", flush=True)
    sys.exit(0)
print("WON " + lock.token, flush=True)
while not done.exists():
    time.sleep(0.01)
lock.release()
"""


@pytest.mark.parametrize("round_", range(4))
def test_concurrent_takeover_of_a_stale_lock_has_one_winner(tmp_path: Path, round_: int) -> None:
    root = tmp_path / "run"
    write_lock(root, host=socket.gethostname(), pid=dead_pid())
    go, done = tmp_path / "go", tmp_path / "done"
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(root), str(go), str(done)],
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    try:
        time.sleep(1.0)  # let them all reach the spin loop (a late one simply finds it held)
        go.touch()
        lines = [p.stdout.readline().strip() for p in procs]
        winners = [line for line in lines if line.startswith("WON")]
        assert len(winners) == 1, lines
        assert lines.count("LOST") == len(procs) - 1, lines
        assert json.loads((root / "run.lock").read_text())["token"] == winners[0].split()[1]
    finally:
        done.touch()
        for p in procs:
            p.wait(timeout=60)
            p.stdout.close()
    assert not (root / "run.lock").exists()


def test_lock_file_holds_no_secret_from_the_command_line(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The lock file is world-readable; the command in it must not carry a token.
    monkeypatch.setattr(sys, "argv", ["hpctrain", "train", "c.yaml", "tracking.api_token=s3cr3t",
                                      "--hf-token", "s3cr3t2", "run.name=x"])
    lock = acquire(tmp_path / "run")
    try:
        text = (tmp_path / "run" / "run.lock").read_text()
    finally:
        lock.release()
    assert "s3cr3t" not in text
    assert "run.name=x" in json.loads(text)["command"]
