"""Goodput accounting and the checkpoint writer process in real CLI runs on CPU.

Each run is the session's tiny reference (1 process, 6 steps: conftest's ``reference_run``)
with checkpoints every 2 steps written by the writer process, and one fault:

- preempted (SIGUSR2) while the save of step 2 is still being written (``slow_save``), then
  the same command again: the wait is recorded, step 4 is committed before exit 75, the rerun
  resumes bit-exactly; two attempts, nothing lost, no gap (a new allocation);
- kill -9 of the only rank after step 5 under ``--max-restarts 1``: its writer dies with it,
  the restart resumes from step 4 bit-exactly; exactly 1 step lost, a restart gap counted;
- three NaN steps (``once``) each half-way between blocking checkpoints, rolled back each
  time: exactly 12 steps lost; and Daly's model (``plan goodput``), fed the run's measured
  costs (save, restore, interval, failures per second of run), predicts its goodput. The
  failures are placed, not drawn: each loses half an interval, the model's expectation for
  work between saves; the tolerance allows for the saves they never land in (see the test).

Timing without races: ``hang@step=S,seconds=T`` holds a run before step S while the test acts.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

import forked
from conftest import (
    DEMO,
    QUIET,
    REFERENCE,
    STEPS,
    TINY,
    RunResult,
    cli_env,
    kill_group,
)
from hpctrain.observe.goodput import PARTS
from hpctrain.observe.metrics import read_metrics
from hpctrain.plan.goodput import predict_goodput

TIMEOUT_S = 180.0
BASE = [*TINY, *QUIET, *REFERENCE, "checkpoint.every=2", "checkpoint.writer=process",
        "preempt.check_every=1"]


def _args(out: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return ["train", DEMO, *BASE, f"train.steps={steps}", f"run.out_dir={out}",
            f"run.name={name}", *extra]


def _start(args: list[str], faults: str) -> forked.Popen:
    """A run the test signals or kills, forked (tests/forked.py)."""
    return forked.Popen(args, {**cli_env(), "HPCTRAIN_FAULTS": faults})


def _finish(proc: forked.Popen, args: list[str], run_dir: Path) -> RunResult:
    """Wait for the run; whatever happens, nothing of it outlives the call."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = "", f"[test] TIMEOUT after {TIMEOUT_S:.0f} s"
    finally:
        kill_group(proc)
    return RunResult(args, proc.returncode, out, err, run_dir)


def _logged(run_dir: Path) -> int:
    path = run_dir / "metrics" / "rank-000.jsonl"
    return sum(1 for r in read_metrics(path) if "loss" in r) if path.is_file() else 0


def _wait_for(proc: forked.Popen, what: str, ok, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert proc.poll() is None and time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _log(run_dir: Path) -> str:
    with suppress(OSError):
        return (run_dir / "logs" / "rank-000.log").read_text()
    return ""


def _latest(run_dir: Path) -> str | None:
    with suppress(OSError):
        return (run_dir / "checkpoints" / "latest").read_text().strip()
    return None


def _preempt_in_flight(out: Path) -> tuple[RunResult, RunResult]:
    """SIGUSR2 while step 2's save is held 6 s in the writer; the rerun finishes the run."""
    args = _args(out, "preempt")
    faults = "slow_save@step=2,seconds=6;hang@step=4,seconds=3"
    proc = _start(args, faults)
    try:
        # Inside step 4's hang: once step 3 is logged, its preemption check may still be to
        # come, and a signal there preempts at step 3.
        _wait_for(proc, "step 4's hang", lambda: "hanging 3 s before step 4" in _log(
            out / "preempt"))
        proc.send_signal(signal.SIGUSR2)
    finally:
        first = _finish(proc, args, out / "preempt")
    second = _finish(_start(args, faults), args, out / "preempt")
    return first, second


def _kill_and_restart(out: Path) -> tuple[RunResult, bool]:
    """kill -9 of the rank after step 5 (held before step 6); True if its writer died too."""
    args = [*_args(out, "kill9"), "--nproc", "1", "--max-restarts", "1"]
    run_dir = out / "kill9"
    proc = _start(args, "hang@step=6,seconds=3")
    writer_gone = False
    try:
        _wait_for(proc, "step 5 and checkpoint 4", lambda: _logged(run_dir) >= 5
                  and _latest(run_dir) == "step-00000004")
        rank = [p for p in psutil.Process(proc.pid).children(recursive=True)
                if "hpctrain" in " ".join(p.cmdline())]
        assert len(rank) == 1, rank
        writers = [p for p in rank[0].children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(writers) == 1, writers
        rank[0].send_signal(signal.SIGKILL)
        writer_gone = not psutil.wait_procs(writers, timeout=20)[1]
    finally:
        result = _finish(proc, args, run_dir)
    return result, writer_gone


def _rollbacks(out: Path) -> RunResult:
    """40 steps, blocking checkpoints every 8, a NaN loss (once each) at steps 12, 28 and 36."""
    args = _args(out, "rollback", "checkpoint.every=8", "checkpoint.async_save=false",
                 "guard.max_consecutive=1", steps=40)
    faults = ";".join(f"nan@step={s},once=1" for s in (12, 28, 36))
    return _finish(_start(args, faults), args, out / "rollback")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, run_pool: ThreadPoolExecutor,
         reference_run: Future[RunResult]) -> dict[str, Future]:
    """Submit the runs at once; each test waits for what it checks."""
    out = tmp_path_factory.mktemp("goodput")
    return {
        "preempt": run_pool.submit(_preempt_in_flight, out),
        "kill9": run_pool.submit(_kill_and_restart, out),
        "rollback": run_pool.submit(_rollbacks, out),
        "reference": reference_run,
    }


def _account(run: RunResult) -> dict:
    account = json.loads((run.run_dir / "goodput.json").read_text())
    parts = account["parts"]
    assert set(parts) == set(PARTS)
    assert all(v >= 0 for v in parts.values()), parts
    assert math.isclose(sum(parts.values()), account["wall_s"], rel_tol=0.02), account
    attempts = account["attempts"]
    assert math.isclose(account["wall_s"], sum(a["end"] - a["start"] for a in attempts)
                        + parts["restart_gap"], rel_tol=0.02), account
    assert account["goodput"] == pytest.approx(parts["productive"] / account["wall_s"])
    return account


def _losses(run: RunResult) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics()}


def _events(run: RunResult, kind: str) -> list[dict]:
    return [r for r in read_metrics(run.run_dir / "metrics" / "rank-000.jsonl")
            if r.get("event") == kind]


def test_preemption_waits_for_the_save_in_flight_then_commits(runs: dict[str, Future]) -> None:
    first, second = runs["preempt"].result()
    assert first.returncode == 75, first.describe()
    info = json.loads((first.run_dir / "goodput" / "attempt-0001.json").read_text())
    assert info["exit_code"] == 75 and info["last_step"] == 4
    stalls = {e["step"]: e for e in _events(second, "checkpoint_stall")}
    # The preemption's save waited for step 2's write (held 6 s, from before step 3).
    assert stalls[4]["wait_s"] > 1.0 and not stalls[4]["async"], stalls
    saves = {e["step"]: e for e in _events(second, "checkpoint")}
    assert saves[2]["writer"] == saves[4]["writer"] == "process", saves
    assert saves[4]["wait_s"] == stalls[4]["wait_s"] and saves[2]["bytes"] > 0
    second.ok()
    assert "resumed from step-00000004" in (second.run_dir / "logs" / "rank-000.log").read_text()
    reference = runs["reference"].result().ok()
    assert _losses(second) == dict(enumerate(reference.losses(), start=1))
    account = _account(second)
    assert [(a["exit_code"], a["resumed_from_step"], a["last_step"])
            for a in account["attempts"]] == [(75, None, 4), (0, 4, STEPS)]
    # Two commands, two allocations: the time between them is not the job's.
    assert account["lost_steps"] == 0 and account["parts"]["restart_gap"] == 0
    assert account["parts"]["lost_work"] == 0
    goodput = _events(second, "goodput")
    assert len(goodput) == 1 and goodput[0]["wall_s"] == account["wall_s"]
    assert "goodput" in second.stderr and "over 2 attempts" in second.stderr


def test_kill_9_restart_counts_one_lost_step_and_the_gap(runs: dict[str, Future]) -> None:
    run, writer_gone = runs["kill9"].result()
    run.ok()
    assert writer_gone, "the killed rank's writer process outlived it"
    reference = runs["reference"].result().ok()
    assert _losses(run) == dict(enumerate(reference.losses(), start=1))
    account = _account(run)
    first, second = account["attempts"]
    assert (first["resumed_from_step"], first["last_step"]) == (None, 5), account
    assert (second["resumed_from_step"], second["last_step"]) == (4, STEPS), account
    assert first["exit_code"] is None and second["exit_code"] == 0
    assert account["lost_steps"] == 1  # step 5, computed again
    assert account["parts"]["lost_work"] > 0 and account["parts"]["restart_gap"] > 0


def test_rollbacks_lose_exactly_their_steps_as_daly_predicts(runs: dict[str, Future]) -> None:
    run = runs["rollback"].result().ok()
    rollbacks = _events(run, "rollback")
    assert [(r["from_step"], r["checkpoint"]) for r in rollbacks] == [
        (12, "step-00000008"), (28, "step-00000024"), (36, "step-00000032")], rollbacks
    account = _account(run)
    assert account["lost_steps"] == 12 and len(account["attempts"]) == 1
    parts = account["parts"]
    ledger = json.loads((run.run_dir / "goodput" / "attempt-0001.json").read_text())
    restore_s = sum(r["restore_s"] for r in ledger["rollbacks"]) / len(rollbacks)
    # What the model covers: training, checkpoints, and failures with their recovery.
    covered = parts["productive"] + parts["checkpoint"] + parts["lost_work"]
    save_s = account["checkpoint_cost_s"]
    predicted = predict_goodput(mttf_s=covered / len(rollbacks), save_s=save_s,
                                restart_s=restore_s,
                                interval_s=parts["productive"] / account["saves"])
    measured = parts["productive"] / covered
    # A random failure lands inside a save in δ/(τ+δ) of the cases and then loses that save
    # too: on average (τ+δ)/2 of work. These placed failures lose τ/2 (and the restore), so
    # the run may beat the model by up to δ/2 per failure; beyond that, 0.05 of noise.
    bias = len(rollbacks) * save_s / 2 / covered
    assert -0.05 <= measured - predicted.goodput <= bias + 0.05, (predicted, measured, account)
