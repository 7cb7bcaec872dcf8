"""checkpoint.interval=auto, the default: one vocabulary for cadences, Daly under a 1% cap,
postponed while a save writes, the same answer as ``plan interval``; and the save before the
Slurm time limit and the final save's cost, in one in-process run (no Slurm needed).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from conftest import DEMO, QUIET, TINY
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.schedule import SaveSchedule
from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.plan.interval import auto_interval, daly_interval, job_mttf
from hpctrain.runtime.time_limit import job_end_time


def settled(**kw) -> CheckpointConfig:
    cfg = CheckpointConfig(**kw)
    cfg.validate()
    return cfg


def test_cadence_vocabulary() -> None:
    """Unset: auto; every counts steps, every_minutes minutes; old ambiguous spellings refused."""
    assert settled().cadence == "auto"
    assert (settled(every=5).cadence, settled(every=5).every_steps) == ("steps", 5)
    assert settled(every_minutes=30).cadence == "minutes"
    assert settled(interval="steps").every_steps == 100  # the old default cadence
    assert settled(interval="none").cadence == "none"
    with pytest.raises(ConfigError) as e:
        settled(interval="minutes", every=30)  # the old way to say every 30 minutes
    assert "checkpoint.every_minutes=30" in e.value.hint
    with pytest.raises(ConfigError) as e:
        settled(interval="auto", every=30)  # the old way to set the first auto save
    assert "checkpoint.first_minutes=30" in e.value.hint
    # A cadence key that the interval in force would ignore is refused, naming that key.
    for interval, key, value in (("steps", "every_minutes", 5.0), ("auto", "every_minutes", 5.0),
                                 ("none", "every", 10), ("none", "every_minutes", 5.0)):
        with pytest.raises(ConfigError) as e:
            settled(interval=interval, **{key: value})
        assert f"checkpoint.{key} = {value}" in e.value.what
        assert f"checkpoint.interval = {interval}" in e.value.what
    for bad in ({"every": 2, "every_minutes": 1.0}, {"max_overhead": 1.5},
                {"max_overhead": 0.0}, {"every_minutes": -1.0}, {"limit_margin_minutes": -1}):
        with pytest.raises(ConfigError):
            settled(**bad)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_auto_interval_daly_cap_postpone_and_log(caplog: pytest.LogCaptureFixture) -> None:
    """First save after first_minutes; then Daly, or save cost / max_overhead when larger;
    never while a save is still writing; the log says each new interval once."""
    clock = Clock()
    cfg = settled(first_minutes=10, mttf_gpu_hours=8.0)  # 8 GPUs: job MTTF 1 h
    s = SaveSchedule(cfg, n_gpus=8, clock=clock)
    clock.t += 9 * 60
    assert not s.due_by_time()
    clock.t += 60
    assert s.due_by_time() and not s.due_by_time(in_flight=True)
    caplog.set_level(logging.INFO, "hpctrain.checkpoint")
    s.saved(10.0)  # Daly ~4.5 min; 10 s / 1% = 16.7 min wins
    assert s.choice.bound_by_overhead and s.minutes * 60 == pytest.approx(1000.0)
    assert s.choice.daly_s == pytest.approx(daly_interval(10.0, 3600.0))
    s.saved(10.2)  # within 10%: no new line
    s.saved(0.5)  # counted as 1 s: the cap (100 s) still above Daly (~85 s): a new line
    lines = [r.getMessage() for r in caplog.records if "checkpoint interval:" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "overhead cap" in lines[0] and "16.7 min" in lines[0]
    cheap = settled(mttf_gpu_hours=50_000.0)
    s = SaveSchedule(cheap, n_gpus=1, clock=clock)
    s.saved(10.0)  # job MTTF 50k h: Daly ~16 h, far above the 1000 s cap
    assert not s.choice.bound_by_overhead and "Daly's optimum" in s.choice.reason()


def test_plan_interval_gives_the_training_answer(capsys: pytest.CaptureFixture) -> None:
    """``hpctrain plan interval`` prints the interval the schedule picks for the same inputs."""
    cfg = settled(mttf_gpu_hours=5000.0, max_overhead=0.02)
    s = SaveSchedule(cfg, n_gpus=64)
    s.saved(42.0)
    main(["plan", "interval", "--save-min", str(42.0 / 60), "checkpoint.mttf_gpu_hours=5000",
          "--gpus", "64", "checkpoint.max_overhead=0.02"])
    out = capsys.readouterr().out
    assert f"auto:  checkpoint every {s.choice.reason()}" in out
    assert s.choice == auto_interval(42.0, job_mttf(5000.0 * 3600, 64), 0.02)


def test_time_limit_save_once_and_only_for_runs_that_save() -> None:
    """Due once when the end is nearer than the longest save + margin; never for a run that
    saves nothing (interval=none, save_at_end=false: benchmarks)."""
    clock = Clock()
    s = SaveSchedule(settled(limit_margin_minutes=1), 1, end_time=clock.t + 100,
                     wall_clock=clock)
    s.committed(30.0)
    assert not s.due_by_time()  # 100 s left > 30 s + 60 s
    clock.t += 15
    assert s.due_by_time(in_flight=True) and not s.due_by_time()
    quiet = settled(interval="none", save_at_end=False)
    assert not SaveSchedule(quiet, 1, end_time=clock.t, wall_clock=clock).due_by_time()


def test_intervals_follow_the_monotonic_clock_not_wall_clock_steps() -> None:
    """An NTP step of the wall clock neither fires a save nor holds one back; the wall clock
    is read only against the Slurm end time."""
    assert SaveSchedule(settled(every_minutes=1), 1).clock is time.monotonic
    steady, wall = Clock(), Clock()
    s = SaveSchedule(settled(every_minutes=1), 1, clock=steady, wall_clock=wall)
    wall.t += 3600  # stepped an hour ahead
    assert not s.due_by_time()
    wall.t -= 7200  # and back
    steady.t += 60
    assert s.due_by_time()


def test_job_end_time_from_env_or_squeue(tmp_path: Path) -> None:
    """SLURM_JOB_END_TIME first; else squeue's %e (local time); N/A or no job: None."""
    assert job_end_time({"SLURM_JOB_END_TIME": "1800000000"}) == 1.8e9
    assert job_end_time({}) is None
    squeue = tmp_path / "squeue"
    squeue.write_text('#!/bin/sh\n[ "$3" = 7 ] && echo 2026-11-28T02:30:00 || echo N/A\n')
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    local = time.mktime((2026, 11, 28, 2, 30, 0, 0, 0, -1))
    assert job_end_time({"SLURM_JOB_ID": "7"}, squeue=str(squeue)) == local
    assert job_end_time({"SLURM_JOB_ID": "8"}, squeue=str(squeue)) is None


def test_a_failing_squeue_is_logged_with_its_exit_code(tmp_path: Path, caplog) -> None:
    """Not silently None: the exit code and squeue's first line of stderr, escaped."""
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\nprintf 'slurm_load_jobs error: \\033[31mdown\\n"
                      "second line\\n' >&2\nexit 3\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    with caplog.at_level(logging.WARNING, logger="hpctrain.runtime"):
        assert job_end_time({"SLURM_JOB_ID": "7"}, squeue=str(squeue)) is None
    assert "exit code 3" in caplog.text
    assert "'slurm_load_jobs error: \\x1b[31mdown'" in caplog.text
    assert "second line" not in caplog.text and "\x1b" not in caplog.text


def test_saves_once_before_the_time_limit_and_times_the_final_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_faults) -> None:
    """A job ending within the margin saves once at the first control exchange, as a time-based
    save; the final save is made in the background and goodput says what it cost."""
    from hpctrain.config import load_config
    from hpctrain.train.job import run_training

    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 120))  # margin: 5 min
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(DEMO, [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4",
                             "train.steps=6", "preempt.check_every=2", "data.val_fraction=0.1",
                             f"run.out_dir={tmp_path}", "run.name=limit"])
    assert cfg.checkpoint.cadence == "auto"
    run_training(cfg)
    run = tmp_path / "limit"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-00000002", "step-00000006"]  # once at the limit, then the final save
    account = json.loads((run / "goodput.json").read_text())
    assert account["saves"] == 1 and account["final_save_s"] >= 0.0
    assert os.environ["SLURM_JOB_END_TIME"]  # unchanged by the run
