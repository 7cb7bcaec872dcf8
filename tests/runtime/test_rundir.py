"""Run directory layout, run names and atomic exit info."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hpctrain.runtime.env import detect_env
from hpctrain.runtime.rundir import RunDir, run_name, write_json_atomic


def test_layout(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    run.create()  # every rank calls it; a second call must not fail
    for folder in ("config", "logs", "metrics", "checkpoints", "provenance"):
        assert (tmp_path / "run" / folder).is_dir()
    assert run.rank_log(3) == tmp_path / "run" / "logs" / "rank-003.log"
    assert run.rank_metrics(12) == tmp_path / "run" / "metrics" / "rank-012.jsonl"
    assert run.exit_info_path == tmp_path / "run" / "exit_info.json"


def test_run_names() -> None:
    local = detect_env({})
    assert run_name("llama", local) == "llama"
    assert run_name("llama", replace(local, job_id="123")) == "llama-123"
    array = replace(local, job_id="130", array_job_id="123", array_task_id="7")
    assert run_name("llama", array) == "llama-123_7"


def test_exit_info_is_complete_json(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_exit_info(
        exit_code=0, reason="finished", last_checkpoint="step-100", extra={"loss": math.nan}
    )
    info = json.loads(run.exit_info_path.read_text())
    assert info["exit_code"] == 0
    assert info["reason"] == "finished"
    assert info["last_checkpoint"] == "step-100"
    assert info["pid"] == os.getpid()
    assert info["hostname"]
    assert info["timestamp"] > 0
    assert info["extra"] == {"loss": "nan"}
    assert list(tmp_path.iterdir()) == [run.exit_info_path]  # no temp files left behind


def test_atomic_write_replaces_and_keeps_old_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 2}
    assert list(tmp_path.iterdir()) == [path]
