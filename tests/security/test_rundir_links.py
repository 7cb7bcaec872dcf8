"""A shared run directory must not turn into write access to its owner's other files.

Someone who can write a run directory plants a symbolic link (or a FIFO, a folder, a hard link)
at a name the run writes, pointing at a victim file outside it. The owner's next run or resume
must refuse that run directory, naming the entry, before writing anything there; and every
writer on its own refuses to write through a link, so a link planted while the run goes on is
not followed either. Files written atomically honour the umask like any other file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from conftest import REPO, train
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.store import CheckpointStore
from hpctrain.config import load_config
from hpctrain.observe.goodput import GoodputClock
from hpctrain.observe.metrics import MetricsWriter
from hpctrain.observe.profile import ProfileConfig, Profiler
from hpctrain.observe.report import write_report
from hpctrain.observe.rundata import load_run
from hpctrain.runtime.env import detect_env
from hpctrain.runtime.logs import setup_rank_logging
from hpctrain.runtime.provenance import write_provenance
from hpctrain.runtime.rundir import RunDir, write_json_atomic
from hpctrain.runtime.safe_open import UnsafeRunPath
from hpctrain.train.job import claim_run_dir

VICTIM_TEXT = "the victim's own file\n"

# Every fixed name a run writes into its run directory, and what is planted there.
FIXED_FILES = [
    "config/config.yaml", "config/source.yaml", "logs/rank-000.log", "metrics/rank-001.jsonl",
    "checkpoints/latest", "provenance/provenance.json", "provenance/packages.txt",
    "exit_info.json", "goodput.json", "goodput/attempt-0001.json", "run.lock",
    "run.lock.takeover", "forensics/fr-rank-000.json", "profiles/oom-rank-000.pickle",
    "report.html",
]
FIXED_DIRS = ["config", "logs", "metrics", "checkpoints", "provenance", "goodput",
              "forensics", "profiles", "tensorboard", "mlruns", "logs/launcher",
              "checkpoints/step-00000002"]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the run's owner outside the run directory."""
    path = tmp_path / "home" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def untouched(victim: Path) -> bool:
    """The victim file (and its folder) hold what they held before."""
    return victim.read_text() == VICTIM_TEXT and sorted(victim.parent.iterdir()) == [victim]


def plant(run: Path, name: str, target: Path) -> Path:
    """A symbolic link at ``run/name`` pointing at ``target``."""
    link = run / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def tiny_cfg(tmp_path: Path, name: str = "run"):
    overrides = [f"run.out_dir={tmp_path}", f"run.name={name}", "run.suffix=none"]
    return load_config(REPO / "configs" / "demo.yaml", overrides)


# -- the run directory is checked before anything is written -------------------------------

@pytest.mark.parametrize("name", FIXED_FILES + FIXED_DIRS)
def test_a_link_at_a_fixed_name_refuses_the_run_directory(tmp_path: Path, victim: Path,
                                                          name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = victim.parent if name in FIXED_DIRS else victim
    plant(run, name, target)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(UnsafeRunPath) as info:
        claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    assert info.value.exit_code == 2
    assert str(run / name) in info.value.what and "symbolic link" in info.value.what
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no run.lock either
    assert untouched(victim)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_fixed_file_of_another_kind_is_refused(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    entry = run / "exit_info.json"
    if kind == "fifo":
        os.mkfifo(entry)
    else:
        entry.mkdir()
    with pytest.raises(UnsafeRunPath) as info:
        claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    assert str(entry) in info.value.what
    assert not (run / "run.lock").exists()


def test_a_run_directory_writable_by_others_is_warned_about(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o775)
    claim = claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    try:
        warned = [n for n in claim.notes if "writable by" in n]
        assert len(warned) == 1 and str(run) in warned[0] and "chmod" in warned[0]
    finally:
        claim.lock.release()
    run.chmod(0o755)
    claim = claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    claim.lock.release()
    assert not [n for n in claim.notes if "writable by" in n]


def test_a_run_directory_that_is_a_link_of_the_users_own_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "scratch" / "run"
    real.mkdir(parents=True)
    (tmp_path / "run").symlink_to(real)
    claim = claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    try:
        assert claim.run_dir.root == real.resolve()
        claim.run_dir.write_exit_info(exit_code=0, reason="x", last_checkpoint=None)
        assert (real / "exit_info.json").is_file()
    finally:
        claim.lock.release()


def test_a_run_directory_that_is_another_users_link_is_refused(tmp_path: Path,
                                                               victim: Path) -> None:
    link = tmp_path / "run"
    link.symlink_to(victim.parent)
    try:
        os.lchown(link, 65534, 65534)
    except PermissionError:
        pytest.skip("only root can make a link owned by another user")
    with pytest.raises(UnsafeRunPath, match="a symbolic link made by another user"):
        claim_run_dir(tiny_cfg(tmp_path), detect_env({}))
    assert untouched(victim)


# -- each writer refuses a link planted while the run goes on ----------------------------------

def test_rank_log_is_not_written_through_a_link(tmp_path: Path, victim: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    plant(run.root, "logs/rank-000.log", victim)
    with pytest.raises(UnsafeRunPath, match="rank-000.log is a symbolic link"):
        setup_rank_logging(run, detect_env({}), console=False)
    assert untouched(victim)


def test_logs_folder_that_is_a_link_is_refused(tmp_path: Path, victim: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    plant(run.root, "logs", victim.parent)
    with pytest.raises(UnsafeRunPath, match="logs is a symbolic link"):
        run.create()
    with pytest.raises(UnsafeRunPath, match="logs is a symbolic link"):
        setup_rank_logging(run, detect_env({}), console=False)
    assert untouched(victim)


def test_metrics_are_not_appended_through_a_link_or_a_hard_link(tmp_path: Path,
                                                                victim: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    link = plant(run.root, "metrics/rank-000.jsonl", victim)
    with pytest.raises(UnsafeRunPath, match="rank-000.jsonl is a symbolic link"):
        MetricsWriter(run, detect_env({}))
    link.unlink()
    os.link(victim, link)
    with pytest.raises(UnsafeRunPath, match="hard link"):
        MetricsWriter(run, detect_env({}))
    assert victim.read_text() == VICTIM_TEXT


def test_latest_pointer_is_not_written_through_a_planted_temp_file(tmp_path: Path,
                                                                   victim: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    plant(root, ".latest.tmp", victim)
    plant(root, "latest", victim)
    store = CheckpointStore(CheckpointConfig(), root, rank=0, world_size=1)
    store.point_latest("step-00000002")
    assert untouched(victim)
    assert not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step-00000002\n"


def test_provenance_is_not_written_through_a_link(tmp_path: Path, victim: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    plant(run.root, "provenance/packages.txt", victim)
    write_provenance(run, {"packages": ["a==1"]})
    assert untouched(victim)
    assert (run.provenance_dir / "packages.txt").read_text() == "a==1\n"
    plant(run.root, "elsewhere", victim.parent)
    (run.root / "provenance").rename(run.root / "old-provenance")
    plant(run.root, "provenance", victim.parent)
    with pytest.raises(UnsafeRunPath, match="provenance is a symbolic link"):
        write_provenance(run, {"packages": ["a==1"]})
    assert untouched(victim)


def test_exit_info_is_not_written_into_a_linked_folder(tmp_path: Path, victim: Path) -> None:
    run = RunDir(tmp_path / "run" / "nested")
    (tmp_path / "run").mkdir()
    plant(tmp_path / "run", "nested", victim.parent)
    with pytest.raises(UnsafeRunPath, match="nested is a symbolic link"):
        run.write_exit_info(exit_code=0, reason="x", last_checkpoint=None)
    assert untouched(victim)


def test_goodput_ledger_is_not_written_into_a_linked_folder(tmp_path: Path,
                                                           victim: Path) -> None:
    run = tmp_path / "run"
    plant(run, "goodput", victim.parent)
    with pytest.raises(UnsafeRunPath, match="goodput is a symbolic link"):
        GoodputClock.open(run)
    assert untouched(victim)


def test_the_report_is_not_written_through_a_link(tmp_path: Path, victim: Path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "tests" / "observe"))
    from synthetic_runs import write_run

    run = tmp_path / "run"
    write_run(run)
    plant(run, ".report.html.tmp", victim)
    plant(run, "report.html", victim)
    out = write_report([load_run(run)], run / "report.html")
    assert untouched(victim)
    assert not out.is_symlink() and "<html" in out.read_text()


def profile_steps_1_to_2(run: Path) -> dict:
    profiler = Profiler(ProfileConfig(steps=[1, 2], signal=""), run, 0, torch.device("cpu"))
    profiler.step_start(1)
    torch.ones(4).sum()
    return profiler.step_end(2)


def test_profiles_are_not_written_through_links(tmp_path: Path, victim: Path) -> None:
    run = tmp_path / "run"
    plant(run, "profiles/step-000001-000002/rank-000.trace.json", victim)
    event = profile_steps_1_to_2(run)
    assert untouched(victim)
    trace = run / event["trace"]
    assert not trace.is_symlink() and json.loads(trace.read_text())
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]  # no temp left
    (run / "profiles").rename(run / "old")
    plant(run, "profiles/step-000001-000002", victim.parent)
    with pytest.raises(UnsafeRunPath, match="step-000001-000002 is a symbolic link"):
        profile_steps_1_to_2(run)
    assert untouched(victim)


# -- permissions: the umask decides, not the temp file's 0600 ---------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_honour_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "x.json", {"a": 1})
        store = CheckpointStore(CheckpointConfig(), tmp_path, rank=0, world_size=1)
        store.point_latest("step-00000002")
        shard = tmp_path / "shard.bin"
        shard.write_bytes(b"x")  # what a plain open() gives beside them
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for name in ("x.json", "latest", "shard.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want, name


# -- the real thing: a resume in a run directory with planted links -------------------------------

def test_resume_refuses_a_run_directory_with_planted_links(tmp_path: Path,
                                                           victim: Path) -> None:
    first = train(tmp_path, "shared", "parallel.strategy=none", "checkpoint.every=2",
                  steps=2).ok()
    run = first.run_dir
    (run / "logs" / "rank-000.log").unlink()
    plant(run, "logs/rank-000.log", victim)
    again = train(tmp_path, "shared", "parallel.strategy=none", "checkpoint.every=2", steps=4)
    assert again.returncode == 2, again.describe()
    assert f"{run / 'logs' / 'rank-000.log'} is a symbolic link" in again.stderr
    assert "Traceback" not in again.stderr
    assert untouched(victim)
    assert json.loads((run / "exit_info.json").read_text())["exit_code"] == 0
