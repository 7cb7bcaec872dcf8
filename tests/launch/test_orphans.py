"""Ranks die with their launcher: ``kill -9`` of ``hpctrain train --nproc 2`` leaves no rank
training on as an orphan, and a rerun in the same run directory then resumes (issue 33 item 2).

The lock side (a lock whose launcher is gone stays held while its ranks heartbeat) is in
tests/security/test_run_lock_fields.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import wait_gone
from hpctrain.runtime.orphans import LAUNCHER_PID_ENV, die_with_launcher
from lifecycle import kill_tree_of, start, train_argv

DDP = ["parallel.strategy=ddp", "checkpoint.every=2"]


def test_kill_9_of_the_launcher_takes_its_ranks_and_a_rerun_resumes(tmp_path: Path) -> None:
    argv = train_argv(tmp_path, "orphans", *DDP, "train.steps=10", "--nproc", "2")
    run = start(argv, tmp_path / "first.txt", tmp_path / "orphans",
                env={"HPCTRAIN_FAULTS": "slow@step=3-100,seconds=0.3"})
    try:
        run.wait_for("a committed checkpoint", lambda: run.latest() is not None)
        ranks = [run.rank_process(0), run.rank_process(1)]
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=15)
        left = wait_gone(ranks, timeout=5.0)
        assert not left, f"ranks outlived their launcher: {left}"
    finally:
        kill_tree_of(run)
    assert (run.run_dir / "run.lock").exists()  # nobody released it: stale now
    again = start(train_argv(tmp_path, "orphans", *DDP, "train.steps=6", "--nproc", "2"),
                  tmp_path / "again.txt", tmp_path / "orphans")
    try:
        code = again.finish()
        output = again.output()
        assert code == 0, output[-4000:]
        assert "took over the stale lock" in output and "resumed from step-" in output, \
            output[-4000:]
    finally:
        kill_tree_of(again)


CHILD = """
import os, sys, time
from hpctrain.runtime.orphans import die_with_launcher
die_with_launcher()
print("watching", flush=True)
time.sleep(20)
"""


def test_a_rank_whose_launcher_died_before_it_started_watching_exits(tmp_path: Path) -> None:
    """The race prctl cannot cover: the launcher pid the rank was given is not its parent."""
    env = {**os.environ, LAUNCHER_PID_ENV: str(_dead_pid())}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "watching" not in done.stdout
    assert "launcher" in done.stderr


def test_without_a_launcher_nothing_is_watched(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    die_with_launcher()  # a plain process: returns, sets nothing


def test_a_launched_rank_is_killed_when_its_launcher_is(tmp_path: Path) -> None:
    """The launcher's stand-in starts a rank that watches it, then is killed with -9."""
    pid_file = tmp_path / "rank.pid"
    launcher = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
os.environ["{LAUNCHER_PID_ENV}"] = str(os.getpid())
subprocess.Popen([sys.executable, "-c", '''
import os, time
from hpctrain.runtime.orphans import die_with_launcher
die_with_launcher()
open({str(pid_file)!r}, "w").write(str(os.getpid()))
time.sleep(120)
'''])
time.sleep(120)
"""])
    rank = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.05)
        rank = psutil.Process(int(pid_file.read_text()))
        launcher.kill()
        launcher.wait()
        assert not wait_gone([rank], timeout=5.0)
    finally:
        launcher.kill()
        launcher.wait()
        if rank is not None:
            with contextlib.suppress(psutil.Error):
                rank.kill()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
