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


def test_an_archived_run_names_no_job_of_its_own(tmp_path: Path) -> None:
    """`--fresh` renames a run to <name>-archived-<%Y%m%d-%H%M%S>: the time is no Slurm job, and
    an archived Slurm run keeps its job id but not the live run's queue state."""
    write_run(tmp_path / "demo-archived-20261127-215300", ranks=1, steps=2)
    write_run(tmp_path / "demo-archived-20261127-215300-2", ranks=1, steps=2)
    write_run(tmp_path / "llama-4242-archived-20261127-215300", ranks=1, steps=2)
    write_run(tmp_path / "llama-4242", ranks=1, steps=2)
    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho '{\"jobs\": [{\"job_id\": 4242, "
                    "\"job_state\": \"RUNNING\"}]}'\n")
    fake.chmod(0o755)
    rows = {r["run"]: r for r in runs_table(tmp_path, squeue=str(fake))}
    assert rows["demo-archived-20261127-215300"]["slurm_job"] is None
    assert rows["demo-archived-20261127-215300-2"]["slurm_job"] is None
    archived = rows["llama-4242-archived-20261127-215300"]
    assert (archived["slurm_job"], archived["slurm_state"]) == ("4242", None)
    assert (rows["llama-4242"]["slurm_job"], rows["llama-4242"]["slurm_state"]) == \
        ("4242", "RUNNING")


def test_tokens_per_s_is_the_number_the_run_recorded(tmp_path: Path) -> None:
    """One definition: the rate the run wrote into exit_info.json when it ended (its `done:`
    line's), not the last window's; a running run shows its last window; none recorded: none."""
    from hpctrain.observe.report import build_report
    from hpctrain.observe.rundata import load_run

    _states(tmp_path)
    info = json.loads((tmp_path / "done" / "exit_info.json").read_text())
    info["extra"] = {"steps": 5, "final_loss": 3.3, "tokens_per_s": 1234.0, "world_size": 2}
    (tmp_path / "done" / "exit_info.json").write_text(json.dumps(info))
    rows = {r["run"]: r for r in runs_table(tmp_path, squeue="/nonexistent/squeue")}
    assert rows["done"]["tokens_per_s"] == 1234.0  # the windows say 2010..2050
    assert rows["live-4242"]["tokens_per_s"] == 2050.0  # its last window, while it runs
    assert rows["bad"]["tokens_per_s"] is None
    html = build_report([load_run(tmp_path / "done")], tmp_path / "r.html")
    summary = html.split("</table>")[0]
    assert "<td>1234</td>" in summary and "2035" not in summary  # not the windows' mean
