"""Goodput accounting on a fake clock: every second lands in exactly one part, across attempts.

The ledgers are the real files under a temporary run directory; only time (``time.time`` and
the process start time) is faked, so each expected part is known to the second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hpctrain.observe import goodput as gp
from hpctrain.observe.goodput import GoodputClock, compute_goodput, summary
from hpctrain.runtime.rundir import write_json_atomic


class FakeTime:
    """A clock the test moves by hand."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime(1000.0)
    monkeypatch.setattr(gp.time, "time", fake)

    class Process:
        def create_time(self) -> float:
            return fake.now  # each attempt's process "starts" when opened

    monkeypatch.setattr(gp.psutil, "Process", Process)
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    return fake


def _steps(c: GoodputClock, t: FakeTime, first: int, last: int, *, step_s: float = 1.0,
           data_s: float = 0.0, writing: bool = False) -> None:
    """Steps ``first..last``, each its own logging window."""
    for step in range(first, last + 1):
        with c.part("data_wait"):
            t.advance(data_s)
        t.advance(step_s)
        c.step_done(step, writing=writing)
        c.window_closed()


def _save(c: GoodputClock, t: FakeTime, step: int, stall_s: float) -> None:
    with c.part("checkpoint"):
        t.advance(stall_s)
    c.saved(step, background=True)


def _check_sums(account: dict) -> None:
    assert math.isclose(sum(account["parts"].values()), account["wall_s"], rel_tol=1e-9)


def test_one_attempt_every_part(tmp_path: Path, clock: FakeTime) -> None:
    c = GoodputClock.open(tmp_path)
    clock.advance(10)  # imports, process group, model build
    c.started(None)
    _steps(c, clock, 1, 1, step_s=4.0)  # warm-up window: 3 s over the typical step
    _steps(c, clock, 2, 4, data_s=0.5)
    _save(c, clock, 4, stall_s=0.25)
    _steps(c, clock, 5, 6, step_s=1.5, writing=True)  # beside the background write
    _steps(c, clock, 7, 8)
    with c.part("validation"):
        clock.advance(2)
    clock.advance(0.75)  # the exit
    account = c.finish(exit_code=0)
    assert account == json.loads((tmp_path / "goodput.json").read_text())
    parts = account["parts"]
    assert parts["startup"] == pytest.approx(10 + 3 + 0.75)
    assert parts["checkpoint"] == pytest.approx(0.25 + 2 * 0.5)
    assert parts["productive"] == pytest.approx(8 * 1.0)
    assert parts["data_wait"] == pytest.approx(1.5) and parts["validation"] == pytest.approx(2)
    assert account["wall_s"] == pytest.approx(clock.now - 1000)
    assert account["checkpoint_cost_s"] == pytest.approx(1.25) and account["saves"] == 1
    assert account["goodput"] == pytest.approx(8 / account["wall_s"])
    _check_sums(account)
    assert account["attempts"] == [{"attempt": 1, "start": 1000.0, "end": clock.now,
                                    "exit_code": 0, "resumed_from_step": None,
                                    "last_step": 8,
                                    # no part marked before the loop: all of it is "other"
                                    "startup_parts": {"other": 10.0, "first_step": 4.0}}]
    assert "goodput" in summary(account) and "1 attempt " in summary(account)


def _killed_after_step_6(tmp_path: Path, clock: FakeTime) -> float:
    """Attempt 1: saves at step 4, dies (no finish) after step 6; returns its last update."""
    c = GoodputClock.open(tmp_path)
    clock.advance(5)
    c.started(None)
    _steps(c, clock, 1, 4)
    _save(c, clock, 4, stall_s=0.5)
    _steps(c, clock, 5, 6, data_s=0.25)
    return clock.now


def _resume(tmp_path: Path, clock: FakeTime, at: int, until: int) -> dict:
    c = GoodputClock.open(tmp_path)
    clock.advance(5)
    c.started(at)
    _steps(c, clock, at + 1, until)
    return c.finish(exit_code=0)


@pytest.mark.parametrize("same_allocation", [True, False], ids=["restart", "requeue"])
def test_restart_loses_the_steps_after_its_checkpoint(tmp_path: Path, clock: FakeTime,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      same_allocation: bool) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    last = _killed_after_step_6(tmp_path, clock)
    clock.advance(30)  # detection and restart (or the queue)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0" if same_allocation else "1")
    account = _resume(tmp_path, clock, at=4, until=8)
    first, second = account["attempts"]
    assert first["end"] == last and first["exit_code"] is None and first["last_step"] == 6
    assert second["resumed_from_step"] == 4
    assert account["lost_steps"] == 2
    parts = account["parts"]
    assert parts["lost_work"] == pytest.approx(2 * 1.25)  # steps 5, 6 with their data waits
    assert parts["productive"] == pytest.approx(4 + 4)  # steps 1-4, then 5-8 again
    assert parts["restart_gap"] == pytest.approx(30 if same_allocation else 0)
    _check_sums(account)
    held = sum(a["end"] - a["start"] for a in account["attempts"]) + parts["restart_gap"]
    assert account["wall_s"] == pytest.approx(held)
    assert account["restart_cost_s"] == pytest.approx((30 if same_allocation else 0) + 5)


def test_watchdog_exit_is_hang_time(tmp_path: Path, clock: FakeTime) -> None:
    last = _killed_after_step_6(tmp_path, clock)
    write_json_atomic(tmp_path / "exit_info.json", {"exit_code": 124, "timestamp": last + 600})
    clock.advance(640)
    account = _resume(tmp_path, clock, at=4, until=6)
    first = account["attempts"][0]
    assert first["exit_code"] == 124 and first["end"] == last + 600
    assert account["parts"]["hang"] == pytest.approx(600)
    assert account["parts"]["restart_gap"] == pytest.approx(40)  # one process: one allocation
    _check_sums(account)


def test_rollback_loses_the_steps_since_the_restored_checkpoint(tmp_path: Path,
                                                               clock: FakeTime) -> None:
    c = GoodputClock.open(tmp_path)
    c.started(None)
    _steps(c, clock, 1, 4)
    _save(c, clock, 4, stall_s=0.5)
    _steps(c, clock, 5, 7)
    with c.part("lost_work"):
        clock.advance(0.5)  # the restore
    c.rolled_back(from_step=7, to_step=4, restore_s=0.5)
    _steps(c, clock, 5, 8)
    account = c.finish(exit_code=0)
    assert account["lost_steps"] == 3
    assert account["parts"]["lost_work"] == pytest.approx(3 + 0.5)
    assert account["parts"]["productive"] == pytest.approx(8)
    assert account["attempts"][0]["last_step"] == 8
    ledger = json.loads((tmp_path / "goodput" / "attempt-0001.json").read_text())
    assert ledger["rollbacks"] == [{"from_step": 7, "to_step": 4, "lost_steps": 3,
                                    "lost_s": pytest.approx(3.5), "restore_s": 0.5}]
    _check_sums(account)


def test_a_ledger_mid_run_is_whole_json(tmp_path: Path, clock: FakeTime) -> None:
    """Rewritten in place after every step, shorter or longer: always one JSON document."""
    c = GoodputClock.open(tmp_path)
    c.started(None)
    for step in range(1, 30):
        _steps(c, clock, step, step)
        if step % 5 == 0:
            _save(c, clock, step, 0.1)
        ledger = json.loads(c._ledger.read_text())
        assert ledger["last_step"] == step and not ledger["ended"]
    assert compute_goodput(tmp_path)["attempts"][0]["last_step"] == 29


def test_the_final_flush_is_checkpoint_time_but_not_a_save_cost(tmp_path: Path,
                                                                 clock: FakeTime) -> None:
    """The wait at exit for the last background write (measured on an H200: 24.5 s against
    a 0.3 s stall per save) is paid once per attempt: in the checkpoint part, not per save."""
    c = GoodputClock.open(tmp_path)
    clock.advance(10)
    c.started(None)
    _steps(c, clock, 1, 4)
    _save(c, clock, 4, stall_s=0.25)
    _steps(c, clock, 5, 8)
    _save(c, clock, 8, stall_s=0.25)
    with c.part("flush"):  # the end: the save of step 8 commits
        clock.advance(20)
    account = c.finish(exit_code=0)
    assert account["parts"]["checkpoint"] == pytest.approx(0.5 + 20)
    assert account["checkpoint_cost_s"] == pytest.approx(0.25) and account["saves"] == 2
    _check_sums(account)


def test_a_run_whose_only_save_is_the_final_one_costs_that_save(tmp_path: Path,
                                                                 clock: FakeTime) -> None:
    c = GoodputClock.open(tmp_path)
    clock.advance(10)
    c.started(None)
    _steps(c, clock, 1, 4)
    with c.part("flush"):
        clock.advance(15)
    c.saved(4, background=False, periodic=False)
    account = c.finish(exit_code=0)
    assert account["saves"] == 0 and account["checkpoint_cost_s"] == pytest.approx(15)
    _check_sums(account)


def test_an_older_ledger_without_the_flush_still_counts(tmp_path: Path, clock: FakeTime) -> None:
    c = GoodputClock.open(tmp_path)
    clock.advance(5)
    c.started(None)
    _steps(c, clock, 1, 4)
    _save(c, clock, 4, stall_s=0.5)
    _steps(c, clock, 5, 6)
    account = c.finish(exit_code=0)
    ledger = tmp_path / "goodput" / "attempt-0001.json"
    state = json.loads(ledger.read_text())
    for key in ("flush", "final_saves"):
        del state["buckets"][key]
    write_json_atomic(ledger, state)
    again = compute_goodput(tmp_path)
    assert again["checkpoint_cost_s"] == pytest.approx(account["checkpoint_cost_s"])
    assert again["wall_s"] == pytest.approx(account["wall_s"])
