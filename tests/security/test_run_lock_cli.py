"""Two real runs, one run directory: the second is refused at once (exit 2, naming the holder)
and writes nothing there, whether it is one process, the ``--nproc`` launcher, ranks started
by torchrun, or a ``--fresh`` that would archive the live run. A stale lock (dead pid) is
taken over, and the lock is gone once the run has ended.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from conftest import run_cli
from lifecycle import kill_tree_of, start, train_argv

REFUSED_S = 120  # generous: each refusal still imports torch on a shared 2-core machine
# The live run is held before step 3 (the `hang` fault): alive, holding and heartbeating the
# lock, but idle, so it takes no core from the refused runs. The SIGTERM at the end wakes it.
LIVE_BUT_IDLE = {"HPCTRAIN_FAULTS": "hang@step=3,seconds=600"}


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file the *first* run could not have changed meanwhile."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and p.name not in ("run.lock",) and p.name != "rank-000.log" \
                and not {"metrics", "checkpoints", "goodput"} & set(p.parts):
            st = p.stat()
            out[str(p.relative_to(run_dir))] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_second_run_in_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    argv = train_argv(tmp_path, "shared", "parallel.strategy=none", "train.steps=100000",
                      "preempt.check_every=1")
    first = start(argv, tmp_path / "first.txt", tmp_path / "shared", env=LIVE_BUT_IDLE)
    try:
        first.wait_for("2 steps", lambda: first.steps() >= 2)
        holder = json.loads((first.run_dir / "run.lock").read_text())
        assert holder["pid"] == first.proc.pid and holder["host"] == socket.gethostname()
        before = _snapshot(first.run_dir)
        log_before = (first.run_dir / "logs" / "rank-000.log").read_text().count(
            "device binding")

        attempts = {
            "single process": argv,
            # ddp: strategy none on 2 ranks is refused by the launcher's own checks first.
            "launcher": [*argv, "--nproc", "2", "parallel.strategy=ddp"],
            "fresh": [*argv, "--fresh"],
        }
        for what, args in attempts.items():
            done = run_cli(args, timeout=REFUSED_S)
            assert done.returncode == 2, f"{what}: {done.stderr[-3000:]}"
            assert "is in use by another run" in done.stderr, f"{what}: {done.stderr}"
            assert f"pid {first.proc.pid}" in done.stderr and socket.gethostname() in done.stderr
            assert "started 20" in done.stderr and "Traceback" not in done.stderr, done.stderr

        # Ranks of torchrun (not our launcher): rank 0 checks after the group forms and both
        # ranks leave with the same error.
        # (Not first.run_dir as its run_dir: kill_tree_of must not reach the first run.)
        torchrun = start(["--standalone", "--nproc-per-node", "2", "-m", "hpctrain", *argv,
                          "parallel.strategy=ddp"], tmp_path / "torchrun.txt",
                         tmp_path / "torchrun", module="torch.distributed.run")
        try:
            assert torchrun.finish(timeout=REFUSED_S) != 0
            both = torchrun.output()
            assert both.count("is in use by another run") == 2, both[-4000:]
        finally:
            kill_tree_of(torchrun)

        # Nothing of the refused runs landed in the directory.
        assert _snapshot(first.run_dir) == before
        assert not (first.run_dir / "exit_info.json").exists()
        assert not (first.run_dir / "logs" / "rank-001.log").exists()
        log = (first.run_dir / "logs" / "rank-000.log").read_text()
        assert log.count("device binding") == log_before == 1
        assert [p.name for p in tmp_path.iterdir() if "archived" in p.name] == []

        first.proc.send_signal(signal.SIGTERM)
        assert first.finish() == 75, first.output()[-3000:]
        assert not (first.run_dir / "run.lock").exists(), "the lock outlived its run"
    finally:
        kill_tree_of(first)


def test_a_fresh_lock_of_another_host_is_respected(tmp_path: Path) -> None:
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text(json.dumps({
        "host": "gpu-node-042", "pid": 31337, "started": 1.7e9, "job": "slurm:991",
        "attempt": [0, 0], "token": "theirs"}))
    done = run_cli(train_argv(tmp_path, "elsewhere", "parallel.strategy=none", "train.steps=2"),
                   timeout=REFUSED_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "host gpu-node-042, pid 31337, started 2023-11-14 22:13:20 UTC, job slurm:991" \
        in done.stderr, done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "stale"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / "run.lock").write_text(json.dumps({
        "host": socket.gethostname(), "pid": gone.pid, "started": 1.0e9, "job": None,
        "attempt": [0, 0], "token": "left-by-a-crash"}))
    done = run_cli(train_argv(tmp_path, "stale", "parallel.strategy=none", "train.steps=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    log = (run_dir / "logs" / "rank-000.log").read_text()
    assert f"took over the stale lock of {run_dir}: process {gone.pid} on this host is gone" \
        in log, log[-2000:]
    assert not (run_dir / "run.lock").exists()
