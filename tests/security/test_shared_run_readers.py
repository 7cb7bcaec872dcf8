"""A shared run directory read back by `runs` and `report`, and written mid-run by a save.

Cases found reviewing issue 28's change, each failing on the code before its fix: a FIFO
planted at a metrics file hung `hpctrain runs`; a `run.lock` holding only a host name gave
`report` a KeyError traceback; a link planted at a checkpoint's temporary folder made the save
fail (and the folder was group-writable while the ranks wrote into it); a start racing a live
save's rename gave a traceback; shard manifests were written through a predictable temp name.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import torch

from hpctrain.checkpoint import store as store_module
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.store import CheckpointStore
from hpctrain.data.shards import atomic_write
from hpctrain.observe.report import write_report
from hpctrain.observe.rundata import load_run
from hpctrain.observe.runs import runs_table
from hpctrain.runtime import rundir


def _run_dir(root: Path) -> Path:
    """A finished-looking run directory: config, one metrics row, exit info."""
    run = root / "run"
    for folder in ("config", "metrics", "logs"):
        (run / folder).mkdir(parents=True)
    (run / "config" / "config.yaml").write_text("train: {steps: 2}\n")
    (run / "metrics" / "rank-000.jsonl").write_text(
        json.dumps({"ts": 1.0, "step": 1, "rank": 0, "loss": 2.5, "tokens_per_s": 10.0}) + "\n")
    (run / "exit_info.json").write_text(json.dumps(
        {"exit_code": 0, "reason": "done", "last_checkpoint": None, "timestamp": 2.0}))
    return run


def _finishes(fn, timeout_s: float = 20.0) -> None:
    """``fn()`` returns (or raises) within ``timeout_s``: it does not wait on a FIFO."""
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(_call(fn)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert outcome, f"{fn} still waiting after {timeout_s} s (a FIFO opened for reading)"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]


def _call(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - handed back to the test's thread
        return e


def test_a_fifo_at_a_metrics_file_does_not_hang_runs_or_report(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    os.mkfifo(run / "metrics" / "rank-001.jsonl")
    (run / "metrics" / "rank-000.jsonl").unlink()
    os.mkfifo(run / "metrics" / "rank-000.jsonl")
    os.mkfifo(run / "logs" / "rank-000.log")
    _finishes(lambda: runs_table(tmp_path, squeue="/nonexistent/squeue"))
    _finishes(lambda: load_run(run))


def test_a_run_lock_with_only_a_host_does_not_crash_runs_or_report(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname()}))
    (row,) = runs_table(tmp_path, squeue="/nonexistent/squeue")
    # Judged as `acquire` judges it: an invalid lock still being touched counts as held.
    assert row["state"] == "running"
    write_report([load_run(run)], run / "report.html")
    assert (run / "report.html").is_file()


def test_a_link_planted_at_a_checkpoints_temp_folder_is_removed_not_followed(
        tmp_path: Path, pg: None) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / ".tmp-step-00000002").symlink_to(victim)
    store = CheckpointStore(CheckpointConfig(), root, rank=0, world_size=1)
    store.write(2, {"w": torch.ones(3)}, {"step": 2}, {"cpu": torch.get_rng_state()},
                group=None)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    step = root / "step-00000002"
    assert step.is_dir() and not step.is_symlink()
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(step.stat().st_mode) == 0o777 & ~umask


def test_a_checkpoint_temp_folder_is_owner_only_while_written(tmp_path: Path, pg: None,
                                                             monkeypatch) -> None:
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    modes = []
    real = store_module._save_durable

    def spy(obj, path):  # each rank's rng file, written after its DCP shards
        modes.append(stat.S_IMODE(os.stat(Path(path).parent).st_mode))
        return real(obj, path)

    monkeypatch.setattr(store_module, "_save_durable", spy)
    store = CheckpointStore(CheckpointConfig(), root, rank=0, world_size=1)
    store.write(2, {"w": torch.ones(3)}, {"step": 2}, {"cpu": torch.get_rng_state()},
                group=None)
    assert modes and all(m == 0o700 for m in modes), [oct(m) for m in modes]


def test_entries_that_vanish_during_the_start_check_are_skipped(tmp_path: Path,
                                                                monkeypatch) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step-00000004").mkdir(parents=True)
    (run / "checkpoints" / "gone").write_text("x")
    real = os.scandir

    def racing(folder):
        entries = list(real(folder))
        # A live run's save commits between the listing and the look at each entry.
        for entry in entries:
            if entry.name in ("gone", ".tmp-step-00000004"):
                path = Path(entry.path)
                path.rmdir() if path.is_dir() else path.unlink()
        return iter(entries)

    monkeypatch.setattr(rundir.os, "scandir", racing)
    assert rundir.check_run_dir(run) == []


def test_shard_files_are_not_written_through_a_planted_temp_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    out = tmp_path / "data"
    out.mkdir()
    (out / "manifest.json.tmp").symlink_to(victim)
    atomic_write(out / "manifest.json", [b"{}\n"])
    assert victim.read_text() == "mine\n"
    assert (out / "manifest.json").read_text() == "{}\n"
