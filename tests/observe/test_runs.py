"""`hpctrain runs`: one row per run with its state, last window, goodput and Slurm state."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from synthetic_runs import write_run

from hpctrain.cli import main
from hpctrain.observe.runs import runs_table, squeue_states


def _states(tmp_path: Path) -> None:
    write_run(tmp_path / "done", ranks=2, steps=5)
    write_run(tmp_path / "hung", ranks=2, steps=5, exit_code=124)
    write_run(tmp_path / "pre", ranks=2, steps=5, exit_code=75, goodput=False)
    write_run(tmp_path / "bad", ranks=2, steps=5, exit_code=1)
    live = write_run(tmp_path / "live-4242", ranks=2, steps=5)
    (live / "exit_info.json").unlink()
    (live / "run.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time() - 5,
         "job": "slurm:4242", "token": "t"}))
    gone = write_run(tmp_path / "gone", ranks=2, steps=5)
    (gone / "exit_info.json").unlink()
    (gone / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "t"}))
    old = time.time() - 3600
    os.utime(gone / "run.lock", (old, old))  # no heartbeat for an hour
    (tmp_path / "not-a-run").mkdir()


def test_states_steps_and_goodput(tmp_path: Path) -> None:
    _states(tmp_path)
    rows = {r["run"]: r for r in runs_table(tmp_path, squeue="/nonexistent/squeue")}
    assert {name: r["state"] for name, r in rows.items()} == {
        "done": "done", "hung": "hung", "pre": "preempted", "bad": "failed",
        "live-4242": "running", "gone": "unknown"}
    assert rows["done"]["step"] == 5 and rows["done"]["loss"] == pytest.approx(5.0 / 1.5)
    assert rows["done"]["goodput"] == pytest.approx(10.0 / 15.8)
    assert rows["pre"]["goodput"] is None
    assert rows["live-4242"]["slurm_job"] == "4242"


@pytest.mark.parametrize("state", ['"RUNNING"', '["RUNNING", "COMPLETING"]'])
def test_slurm_state_from_squeue_json(tmp_path: Path, state: str, capsys) -> None:
    """Slurm 22.05 writes job_state as a string, 23.02 and later as a list."""
    _states(tmp_path)
    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\n"
                    f"echo '{{\"jobs\": [{{\"job_id\": 4242, \"job_state\": {state}}}]}}'\n")
    fake.chmod(0o755)
    rows = {r["run"]: r for r in runs_table(tmp_path, squeue=str(fake))}
    assert rows["live-4242"]["slurm_state"] == state.strip('"[]').replace('", "', ",")
    assert (tmp_path / "args").read_text().split() == ["--json", "--jobs", "4242"]


def test_squeue_failing_or_missing_gives_no_state(tmp_path: Path) -> None:
    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert squeue_states(["1"], str(fake)) == {}
    assert squeue_states(["1"], str(tmp_path / "missing")) == {}
    assert squeue_states([], str(fake)) == {}


def test_array_tasks_match_by_job_and_task(tmp_path: Path) -> None:
    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho '{\"jobs\": [{\"job_id\": 11, \"job_state\": [\"PENDING\"],"
                    " \"array_job_id\": {\"set\": true, \"number\": 10}, \"array_task_id\": "
                    "{\"set\": true, \"number\": 3}}]}'\n")
    fake.chmod(0o755)
    assert squeue_states(["10_3"], str(fake)) == {"11": "PENDING", "10_3": "PENDING"}


def test_cli_table_and_json(tmp_path: Path, capsys) -> None:
    _states(tmp_path)
    main(["runs", str(tmp_path), "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["run"] for r in rows} == {"done", "hung", "pre", "bad", "live-4242", "gone"}
    main(["runs", str(tmp_path)])
    table = capsys.readouterr().out
    assert "STATE" in table and "preempted" in table and "63.3%" in table


def test_cli_missing_dir_is_a_user_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["runs", str(tmp_path / "nope")])
    assert done.value.code == 2 and "is not a directory" in capsys.readouterr().err
