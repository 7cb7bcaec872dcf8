"""The local launcher (``hpctrain train ... --nproc N``) through the real CLI: failure teardown,
no orphaned workers, a single rank, and clean user errors.

    .venv/bin/pytest tests/launch -q

Every launch runs in its own session and is SIGKILLed with all its processes when the test leaves
it, but the orphan checks run *before* that cleanup, so they see what the launcher itself left
behind.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from taken_port import TAKEN_PORT_ENV

from conftest import (
    DDP,
    DEMO,
    QUIET,
    REFERENCE,
    TINY,
    processes_mentioning,
    run_cli,
    wait_gone,
)
from hpctrain.observe.metrics import read_metrics
from hpctrain.runtime.rundir import RunDir
from lifecycle import kill_tree_of, start

LAUNCH_TIMEOUT_S = 120.0


@dataclass
class Worker:
    """A process the launcher started, with the RANK read from its environment while alive."""

    proc: psutil.Process
    rank: int | None


@dataclass
class Launch:
    """A finished launch: exit code, console output, every worker seen while it ran."""

    returncode: int
    output: str
    workers: list[Worker]
    run_dir: RunDir

    def exit_info(self) -> dict:
        """The run's exit_info.json."""
        return json.loads(self.run_dir.exit_info_path.read_text())


def train_args(out_dir: Path, name: str, *overrides: str, nproc: int) -> list[str]:
    """CLI arguments of a tiny launched run named `name` (unique per test)."""
    return ["train", DEMO, *TINY, *QUIET, f"run.out_dir={out_dir}", f"run.name={name}",
            *overrides, "--nproc", str(nproc)]


def collect_workers(proc, seen: dict[int, Worker]) -> None:
    """Add the launcher's current descendants to `seen` (keyed by pid)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        if child.pid not in seen:
            seen[child.pid] = Worker(child, None)
        if seen[child.pid].rank is None:
            # Seen right after fork, a child still has the launcher's environment: retry.
            seen[child.pid].rank = rank_of(child)


def supervise(tmp_path: Path, name: str, *overrides: str, nproc: int = 2, on_poll=None,
              timeout: float = LAUNCH_TIMEOUT_S, module: str = "hpctrain",
              env: dict[str, str] | None = None) -> Launch:
    """Launch, watch the workers until the launcher exits, then assert none is left behind.

    `on_poll(proc, seen)` is called on every poll; it may act on the run (e.g. kill a rank).
    `module` and `env` go to lifecycle.start.
    """
    out_dir = tmp_path / "runs"
    run = start(train_args(out_dir, name, *overrides, nproc=nproc),
                tmp_path / f"{name}.console.txt", out_dir / name, module=module, env=env)
    seen: dict[int, Worker] = {}
    try:
        deadline = time.monotonic() + timeout
        while run.proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"launcher still running after {timeout:.0f}s:\n"
                            f"{run.output()[-3000:]}")
            collect_workers(run.proc, seen)
            if on_poll is not None:
                on_poll(run.proc, seen)
            time.sleep(0.05)
        output = run.output()
        # Before the cleanup below: what the launcher itself left behind.
        left = wait_gone([w.proc for w in seen.values()])
        assert not left, f"workers outlived the launcher: {[p.pid for p in left]}\n{output}"
        strays = processes_mentioning(f"run.name={name}")
        assert not strays, f"processes of run {name} still running: {strays}"
    finally:
        kill_tree_of(run)
    return Launch(run.proc.poll(), output, list(seen.values()), RunDir(out_dir / name))


def rank_of(p: psutil.Process) -> int | None:
    """The RANK a worker was started with, or None for a process that is not a rank."""
    try:
        rank = p.environ().get("RANK")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return int(rank) if rank is not None else None


@pytest.fixture(scope="module", autouse=True)
def background(tmp_path_factory: pytest.TempPathFactory, run_pool: ThreadPoolExecutor
               ) -> dict[str, Future]:
    """Launches that need no interaction run in the pool while the kill test runs in front."""

    def single_rank() -> tuple[Path, subprocess.CompletedProcess]:
        out_dir = tmp_path_factory.mktemp("single") / "runs"
        args = train_args(out_dir, "one", *REFERENCE, "train.steps=3", "run.suffix=auto",
                          nproc=1)
        return out_dir, run_cli(args, timeout=LAUNCH_TIMEOUT_S)

    def all_fail() -> Launch:
        # The launch also meets a rendezvous port taken by someone else (test_a_rendezvous_
        # port_taken_...): the test holds the port torch elastic's free-port pick returns.
        with socket.socket() as taken:
            taken.bind(("", 0))
            taken.listen()
            return supervise(tmp_path_factory.mktemp("all-fail"), "all-fail", *DDP,
                             "train.micro_batch=4000", module="taken_port",
                             env={TAKEN_PORT_ENV: str(taken.getsockname()[1])})

    # Both ranks raise a ConfigError after the process group is up: the dataset (6249 samples
    # of 32 tokens) holds fewer samples than one global batch (2 ranks x 4000).
    return {"all_fail": run_pool.submit(all_fail), "single": run_pool.submit(single_rank)}


# -- failure teardown ---------------------------------------------------------------------------


def test_killed_rank_ends_the_whole_group(tmp_path: Path) -> None:
    """SIGKILL rank 1 of a long healthy run: the launcher stops rank 0 and exits non-zero."""
    name = "killed-rank"
    metrics_1 = tmp_path / "runs" / name / "metrics" / "rank-001.jsonl"
    killed: dict[str, float | int] = {}

    def kill_rank_1(proc, seen: dict[int, Worker]) -> None:
        if killed or not metrics_1.exists():
            return
        ranks = {w.rank: w.proc for w in seen.values() if w.proc.is_running()}
        assert {0, 1} <= ranks.keys(), f"workers found: {ranks}"
        ranks[1].kill()  # SIGKILL: no Python handler, no exit info from the rank itself
        killed.update(pid=ranks[1].pid, at=time.monotonic())

    launch = supervise(tmp_path, name, *DDP, "train.steps=2000", on_poll=kill_rank_1)
    assert killed, f"rank 1 never wrote metrics:\n{launch.output[-3000:]}"
    # The elastic agent polls every 0.5 s and then SIGTERMs the survivors; 2000 steps would take
    # minutes, so finishing within seconds means the group was torn down, not run to completion.
    assert time.monotonic() - killed["at"] < 30
    assert launch.returncode == 1, launch.output[-3000:]
    assert "training failed: rank 1 exited with code -9 (SIGKILL)" in launch.output
    assert len(read_metrics(launch.run_dir.rank_metrics(0))) < 2000

    info = launch.exit_info()
    assert info["exit_code"] == 1
    assert info["reason"] == "rank 1 exited with code -9 (SIGKILL)", info
    assert 1 in info["extra"]["failed_ranks"], info


def test_every_rank_failing_ends_the_launch(background: dict[str, Future]) -> None:
    """A user error on every rank: non-zero exit, the user's message, no traceback, exit info."""
    launch = background["all_fail"].result()
    assert launch.returncode == 1, launch.output[-3000:]
    assert {w.rank for w in launch.workers} >= {0, 1}, f"ranks started: {launch.workers}"
    assert "fewer than one global batch" in launch.output, launch.output[-3000:]
    assert re.search(r"training failed: rank [01] exited with code 2", launch.output)
    assert "Traceback" not in launch.output, launch.output[-3000:]
    assert not (launch.run_dir.root / "run.lock").exists(), "the lock outlived a failed run"
    info = launch.exit_info()
    # The ranks' own account stays (a user error, code 2), not the launcher's "exited with 2".
    assert info["exit_code"] == 2, info
    assert info["extra"]["rank"] in (0, 1), info


def test_launcher_exit_info_keeps_the_ranks_reason(background: dict[str, Future]) -> None:
    """exit_info.json should still say *why* the ranks failed, not only that they did."""
    assert "fewer than one global batch" in background["all_fail"].result().exit_info()["reason"]


def test_a_rendezvous_port_taken_by_another_process_does_not_break_the_launch(
        background: dict[str, Future]) -> None:
    """The ranks meet on a store the launcher holds open, not on a port picked free, closed and
    bound again by rank 0 seconds later: anyone may take it meanwhile (a concurrent launch did
    in CI: "Failed to recv, got 0 bytes"). The all-fail launch's pick was taken by the test,
    yet its group formed: the ranks got as far as their own error."""
    launch = background["all_fail"].result()
    assert "fewer than one global batch" in launch.output, launch.output[-3000:]
    assert "EADDRINUSE" not in launch.output


# -- a single rank ------------------------------------------------------------------------------


def test_single_rank_launch(background: dict[str, Future]) -> None:
    """--nproc 1 trains; outside Slurm, run.suffix=auto keeps the plain name (a rerun of the
    same command finds the same directory), and the lock is gone after the run."""
    out_dir, done = background["single"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    (root,) = out_dir.iterdir()  # exactly one directory, shared by launcher and rank
    assert root.name == "one"
    assert not (root / "run.lock").exists()
    run = RunDir(root)
    steps = [r["step"] for r in read_metrics(run.rank_metrics(0)) if "event" not in r]
    assert steps == [1, 2, 3]
    assert not run.rank_metrics(1).exists()
    assert run.rank_log(0).exists()
    info = run.exit_info_path.read_text()
    assert '"reason": "completed"' in info and '"exit_code": 0' in info


# -- user errors at the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "messages"),
    [
        (["train.stepz=3"], ["unknown config key 'train.stepz'", "HINT: did you mean 'steps'?"]),
        (["parallel.strategy=zero3", "--nproc", "2"],
         ["parallel.strategy = 'zero3' is not a valid choice", "'none', 'ddp', 'fsdp'"]),
    ],
    ids=["unknown-key", "bad-choice-launched"],
)
def test_config_error_exits_2_without_traceback(tmp_path: Path, overrides: list[str],
                                                messages: list[str]) -> None:
    """A bad config is reported in one paragraph with exit code 2, before any rank starts."""
    out_dir = tmp_path / "runs"
    done = run_cli(["train", DEMO, f"run.out_dir={out_dir}", *overrides], timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("hpctrain: error: "), done.stderr
    for message in messages:
        assert message in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not out_dir.exists(), "no run directory for a config that never ran"


def test_the_launcher_forwards_the_profile_signal(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # `kill -URG <launcher pid>` must reach the ranks like the preemption signals do.
    from hpctrain.config import load_config
    from hpctrain.launch import local

    seen: dict = {}
    monkeypatch.setattr(local, "launch_local",
                        lambda *a, **kw: seen.update(kw))
    for signals, want in ((["profile.signal=SIGURG"], "SIGURG"), (["profile.signal="], None)):
        cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=fwd",
                                 "parallel.strategy=ddp", *signals])  # a layout for 2 ranks
        local.launch_training(cfg, Path("configs/demo.yaml"), [], 2)
        assert set(cfg.preempt.signals) <= set(seen["forward_signals"])
        assert (want in seen["forward_signals"]) if want else len(
            seen["forward_signals"]) == len(cfg.preempt.signals)
