"""What can be checked before the first step is checked then (issue 28, late discovery): a run
directory or checkpoint folder that cannot be written, and a run name longer than the file
system allows, are refused at once (exit 2, no traceback), not after the steps are trained;
and the refusal writes nothing into the run directory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, train
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.runtime.env import detect_env
from hpctrain.train.job import claim_run_dir


def cfg_for(out: Path, name: str):
    overrides = [f"run.out_dir={out}", f"run.name={name}", "run.suffix=none"]
    return load_config(REPO / "configs" / "demo.yaml", overrides)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` cannot be written, even by root (who ignores mode bits: then chattr +i)."""
    folder.chmod(0o555)
    immutable = False
    try:
        if os.access(folder, os.W_OK):
            done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make {folder} read-only here: {done.stderr!r}")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_read_only_checkpoint_folder_is_refused_before_the_first_step(tmp_path: Path) -> None:
    first = train(tmp_path, "ro", "parallel.strategy=none", "checkpoint.every=2",
                  steps=2).ok()
    before = snapshot(first.run_dir)
    with read_only(first.run_dir / "checkpoints"):
        again = train(tmp_path, "ro", "parallel.strategy=none", "checkpoint.every=2", steps=4)
    assert again.returncode == 2, again.describe()
    assert f"{first.run_dir / 'checkpoints'} is not writable" in again.stderr, again.describe()
    assert "Traceback" not in again.stderr and "step 3" not in again.stderr
    assert snapshot(first.run_dir) == before  # no log line, no exit_info, no lock left


def test_a_read_only_run_directory_is_refused_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    with read_only(root), pytest.raises(ConfigError) as info:
        claim_run_dir(cfg_for(tmp_path, "run"), detect_env({}))
    assert f"{root} is not writable" in info.value.what and info.value.exit_code == 2
    assert list(root.iterdir()) == []


def test_a_run_directory_under_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with read_only(out), pytest.raises(ConfigError) as info:
        claim_run_dir(cfg_for(out / "deeper", "run"), detect_env({}))
    assert f"cannot create {out / 'deeper' / 'run'}" in info.value.what
    assert list(out.iterdir()) == []


def test_a_run_name_longer_than_the_file_system_allows_is_refused(tmp_path: Path) -> None:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(ConfigError) as info:
        claim_run_dir(cfg_for(tmp_path, "x" * (limit + 1)), detect_env({}))
    message = info.value.render()
    assert f"{limit + 1} bytes" in message and f"at most {limit}" in message
    assert "run.name" in message
    assert list(tmp_path.iterdir()) == []
    claim_run_dir(cfg_for(tmp_path, "x" * limit), detect_env({})).lock.release()
