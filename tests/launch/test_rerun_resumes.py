"""Rerunning the same command after an interruption resumes the same run; ``--fresh`` starts
over and archives the old run instead of destroying it.

The run is held before step 5 (``hang`` fault), SIGTERMed there, so it checkpoints step 5 and
exits 75; the identical command then has to continue from step 6 in the same directory.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import DDP, run_cli
from hpctrain.observe.metrics import read_metrics
from lifecycle import kill_tree_of, start, train_argv

# The hold must outlast the SIGTERM's way to the ranks (through the launcher) on a loaded
# machine, or a later step is saved (with 4 s the launcher case failed once under two workers).
# A held run wakes at the signal, so the hold can be far longer than the run is held.
HOLD_S = 300
FAULTS = {"HPCTRAIN_FAULTS": f"hang@step=5,seconds={HOLD_S}"}
# run.suffix=auto is the default (conftest's QUIET sets none; this puts it back).
COMMON = ["run.suffix=auto", "train.steps=12", "preempt.check_every=1", "preempt.grace_s=30"]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl")
            if "event" not in r]


@pytest.mark.parametrize("layout", [["parallel.strategy=none"], ["--nproc", "2", *DDP]],
                         ids=["single-process", "launcher"])
def test_rerunning_the_same_command_resumes(tmp_path: Path, layout: list[str]) -> None:
    argv = train_argv(tmp_path, "again", *COMMON, *layout)
    run_dir = tmp_path / "again"
    first = start(argv, tmp_path / "first.txt", run_dir, env=FAULTS)
    try:
        first.wait_for("4 steps", lambda: first.steps() >= 4)
        first.proc.send_signal(signal.SIGTERM)
        # Answered at once: checkpointed and gone long before the hold would have ended.
        assert first.finish(timeout=HOLD_S / 3) == 75, first.output()[-3000:]
    finally:
        kill_tree_of(first)
    assert first.latest() == "step-00000005"
    assert _steps(run_dir) == [1, 2, 3, 4, 5]

    second = start(argv, tmp_path / "second.txt", run_dir, env=FAULTS)
    try:
        assert second.finish() == 0, second.output()[-3000:]
    finally:
        kill_tree_of(second)
    assert "resumed from step-00000005" in second.output(), second.output()[-3000:]
    assert _steps(run_dir) == list(range(1, 13))  # 1-5 from the first run, 6-12 resumed
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["again"]


def test_fresh_archives_the_old_run_and_starts_over(tmp_path: Path) -> None:
    argv = train_argv(tmp_path, "over", *COMMON, "train.steps=3", "parallel.strategy=none")
    assert run_cli(argv).returncode == 0
    again = run_cli(argv)  # the same command: resumes the finished run, trains nothing new
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-00000003" in again.stderr
    old = (tmp_path / "over" / "metrics" / "rank-000.jsonl").read_text()

    info = (tmp_path / "over" / "exit_info.json").read_text()
    log = (tmp_path / "over" / "logs" / "rank-000.log").read_text()
    never = run_cli([*argv, "--resume", "never"])  # refused before it touches the old run
    assert never.returncode == 2, never.stderr[-3000:]
    assert "already holds checkpoints and checkpoint.resume=never" in never.stderr
    assert "add --fresh to archive it and start over" in never.stderr
    assert (tmp_path / "over" / "exit_info.json").read_text() == info
    assert (tmp_path / "over" / "logs" / "rank-000.log").read_text() == log

    fresh = run_cli([*argv, "--fresh"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (archived,) = [p for p in tmp_path.iterdir() if p.name.startswith("over-archived-")]
    assert f"previous run {tmp_path / 'over'} archived to {archived}" in fresh.stderr
    assert "no checkpoint to resume from" in fresh.stderr
    assert (archived / "metrics" / "rank-000.jsonl").read_text() == old
    assert (archived / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert not (archived / "run.lock").exists()
    assert _steps(tmp_path / "over") == [1, 2, 3]
