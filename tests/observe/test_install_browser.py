"""scripts/install-browser.sh says what failed and fails under CI=true, like install-slurm.sh.

The script runs against fakes (``id`` and ``apt-get`` first on PATH, HPCTRAIN_CHROMIUM /
HPCTRAIN_CHROMEDRIVER pointing at files that exist or not), so nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-browser.sh"


def _fake(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _run(tmp: Path, *, uid: int, ci: str | None, apt: str | None = None,
         installed: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    fakes = tmp / "fakes"
    fakes.mkdir()
    calls = tmp / "apt-calls"
    _fake(fakes, "id", f"echo {uid}")
    if apt is not None:
        _fake(fakes, "apt-get", f'echo "$*" >> {calls}\n{apt}')
    (fakes / "tr").symlink_to(shutil.which("tr"))
    browser = tmp / "chromium"
    driver = tmp / "chromedriver"
    if installed:
        _fake(tmp, "chromium", "echo Chromium 1.0")
        _fake(tmp, "chromedriver", "exit 0")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=str(fakes), HPCTRAIN_CHROMIUM=str(browser),
               HPCTRAIN_CHROMEDRIVER=str(driver))
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=60)
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("ci, code", [(None, 0), ("true", 1)])
def test_not_root_says_what_it_means(tmp_path: Path, ci: str | None, code: int) -> None:
    done, apt_calls = _run(tmp_path, uid=1000, ci=ci, apt="exit 0")
    assert done.returncode == code, done.stderr
    assert "not root" in done.stderr and "chromium" in done.stderr
    if code:
        assert "CI=true" in done.stderr and "failing now" in done.stderr
    else:
        assert "test_report_browser.py) will be SKIPPED" in done.stderr
    assert apt_calls == ""


@pytest.mark.parametrize("ci, code", [(None, 0), ("true", 1)])
def test_offline_apt_is_named_and_fails_under_ci(tmp_path: Path, ci: str | None,
                                                 code: int) -> None:
    done, apt_calls = _run(tmp_path, uid=0, ci=ci, apt="echo 'W: Failed to fetch' >&2\nexit 100")
    assert done.returncode == code, done.stderr
    assert "'apt-get update' failed (offline" in done.stderr
    assert apt_calls.strip() == "update -q"  # stopped there


def test_installed_is_a_no_op(tmp_path: Path) -> None:
    done, apt_calls = _run(tmp_path, uid=1000, ci="true", installed=True)
    assert done.returncode == 0 and "already installed" in done.stdout
    assert apt_calls == ""
