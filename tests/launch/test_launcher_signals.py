"""What the local launcher (``--nproc``) and a single process say when stopped: SIGTERM means
"checkpoint and exit 75", Ctrl-C means one line, exit 130 and how to continue, and after a
``kill -9`` of a rank exit_info.json blames that rank and names the last committed checkpoint.

Real processes, real signals: the tiny demo on CPU, signalled once it has logged a few steps.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from conftest import DDP, wait_gone
from hpctrain.launch.local import blamed_failure
from lifecycle import kill_tree_of, start, train_argv

LONG = ["train.steps=5000", "preempt.check_every=1", "preempt.grace_s=60"]


def _no_noise(output: str) -> None:
    for noise in ("Traceback", "SignalException", "KeyboardInterrupt", "ChildFailedError"):
        assert noise not in output, output[-4000:]


def test_sigterm_to_the_launcher_checkpoints_and_exits_75(tmp_path: Path) -> None:
    run = start(train_argv(tmp_path, "term", *DDP, *LONG, "--nproc", "2"),
                tmp_path / "console.txt", tmp_path / "term")
    try:
        run.wait_for("3 steps", lambda: run.steps() >= 3)
        workers = run.workers()
        run.proc.send_signal(signal.SIGTERM)  # the launcher only, as Slurm or kill would
        code = run.finish()
        output = run.output()
        assert code == 75, output[-4000:]
        _no_noise(output)
        assert "preempted" in output
        info = run.exit_info()
        assert info["exit_code"] == 75, info
        assert info["last_checkpoint"] == run.latest() is not None, info
        assert not wait_gone(workers), "ranks outlived the launcher"
    finally:
        kill_tree_of(run)


@pytest.mark.parametrize("nproc", [None, 2], ids=["single-process", "launcher"])
def test_ctrl_c_is_one_line_exit_130_and_a_hint(tmp_path: Path, nproc: int | None) -> None:
    extra = [*LONG, "checkpoint.interval=steps", "checkpoint.every=2"]
    extra += [*DDP, "--nproc", str(nproc)] if nproc else ["parallel.strategy=none"]
    run = start(train_argv(tmp_path, "ctrlc", *extra), tmp_path / "console.txt",
                tmp_path / "ctrlc")
    try:
        run.wait_for("a committed checkpoint", lambda: run.latest() is not None)
        before = len(run.output())
        workers = run.workers()
        os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        code = run.finish()
        output = run.output()
        after = output[before:]
        assert code == 130, output[-4000:]
        _no_noise(output)
        said = [line for line in after.splitlines() if "interrupted" in line.lower()]
        assert len(said) == 1, after
        assert said[0].startswith("hpctrain: interrupted"), said
        assert "rerun the same command" in said[0] and run.latest() in said[0], said
        assert not [line for line in after.splitlines() if "torch.distributed" in line], after
        info = run.exit_info()
        assert info["exit_code"] == 130, info
        assert not wait_gone(workers), "ranks outlived the launcher"
        assert not (run.run_dir / "run.lock").exists()
    finally:
        kill_tree_of(run)


def test_kill_9_of_rank_0_blames_rank_0_and_names_the_committed_checkpoint(
        tmp_path: Path) -> None:
    run = start(train_argv(tmp_path, "kill0", *DDP, *LONG, "checkpoint.interval=steps",
                           "checkpoint.every=2", "--nproc", "2"),
                tmp_path / "console.txt", tmp_path / "kill0")
    try:
        run.wait_for("a committed checkpoint", lambda: run.latest() is not None)
        run.rank_process(0).kill()
        code = run.finish()
        output = run.output()
        assert code == 1, output[-4000:]
        assert "training failed: rank 0 exited with code -9 (SIGKILL)" in output, output[-4000:]
        info = run.exit_info()
        assert info["reason"] == "rank 0 exited with code -9 (SIGKILL)", info
        assert info["last_checkpoint"] == run.latest() is not None, info
        assert not (run.run_dir / "run.lock").exists()
    finally:
        kill_tree_of(run)


def test_restarted_ranks_keep_the_launchers_lock(tmp_path: Path) -> None:
    """--max-restarts: the launcher holds the lock across the restart, the new ranks run."""
    run = start(train_argv(tmp_path, "restart", *DDP, "train.steps=8", "checkpoint.every=2",
                           "--max-restarts", "1", "--nproc", "2"),
                tmp_path / "console.txt", tmp_path / "restart",
                env={"HPCTRAIN_FAULTS": "hang@step=4,seconds=3"})
    try:
        run.wait_for("a committed checkpoint", lambda: run.latest() is not None)
        token = json.loads((run.run_dir / "run.lock").read_text())["token"]
        run.rank_process(1).kill()
        code = run.finish()
        output = run.output()
        assert code == 0, output[-4000:]
        assert "resumed from step-" in output, output[-4000:]
        assert output.count("device binding: host") == 2  # rank 0, before and after
        assert "in use by another run" not in output and token
        assert not (run.run_dir / "run.lock").exists()
    finally:
        kill_tree_of(run)


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                             error_file="/nonexistent")
    failure.timestamp = timestamp
    return failure


def test_a_rank_stopped_by_the_agents_sigterm_is_a_victim_not_the_cause() -> None:
    """Timestamps are whole seconds: rank 1, SIGTERMed by the agent, can tie with rank 0's
    SIGKILL and come first in the dict; torch's own choice then blames rank 1."""
    failures = {1: _failure(1, -signal.SIGTERM, 100), 0: _failure(0, -signal.SIGKILL, 100)}
    assert ChildFailedError("x", failures).get_first_failure()[0] == 1  # torch's pick
    assert blamed_failure(failures)[0] == 0
    # A rank that exited by itself (an error) is blamed before one that died of SIGTERM.
    failures = {0: _failure(0, -signal.SIGTERM, 99), 1: _failure(1, 2, 100)}
    assert blamed_failure(failures)[0] == 1
    # A rank killed by a signal is blamed before a peer that exited on the broken connection.
    failures = {0: _failure(0, 1, 99), 1: _failure(1, -signal.SIGKILL, 100)}
    assert blamed_failure(failures)[0] == 1
    # A peer that aborted (std::terminate on gloo's "Connection closed by peer") after a rank
    # was SIGKILLed; the aborted rank's time (from its error file) can read earlier than the
    # time the agent noticed the SIGKILL: the SIGKILL is the cause.
    failures = {1: _failure(1, -signal.SIGABRT, 99), 0: _failure(0, -signal.SIGKILL, 100)}
    assert blamed_failure(failures)[0] == 0
    # ... and an abort ranks before a peer that raised on the broken connection and exited.
    failures = {1: _failure(1, 1, 100), 0: _failure(0, -signal.SIGABRT, 100)}
    assert blamed_failure(failures)[0] == 0
    # Otherwise the earliest.
    failures = {0: _failure(0, 1, 101), 1: _failure(1, 1, 100)}
    assert blamed_failure(failures)[0] == 1


def test_a_rank_the_agent_sigkilled_after_its_grace_is_a_victim_not_the_cause() -> None:
    """Rank 0 raised; rank 1, busy, outlived the agent's SIGTERM and was SIGKILLed 30 s later
    (torch's close() timeout): rank 0 is the cause. A SIGKILL noticed with the others' failures
    (the OOM killer, say) still comes first."""
    failures = {0: _failure(0, 2, 100), 1: _failure(1, -signal.SIGKILL, 130)}
    assert blamed_failure(failures)[0] == 0
    failures = {0: _failure(0, 1, 100), 1: _failure(1, -signal.SIGKILL, 101)}
    assert blamed_failure(failures)[0] == 1


def test_sigterm_while_the_launcher_starts_is_not_lost(tmp_path: Path) -> None:
    """SIGTERM right after the launcher took the lock, before or while the ranks start: it
    stops the run (75 if the ranks got to checkpoint, else 143), never lets it train on."""
    run = start(train_argv(tmp_path, "early", *DDP, *LONG, "--nproc", "2"),
                tmp_path / "console.txt", tmp_path / "early")
    try:
        run.wait_for("the run lock", (run.run_dir / "run.lock").exists, timeout=120)
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish()
        output = run.output()
        assert code in (75, 143), output[-4000:]
        _no_noise(output)
        assert not (run.run_dir / "run.lock").exists()
        assert run.exit_info()["exit_code"] == code
    finally:
        kill_tree_of(run)
