"""CI cannot go green without the real-Slurm tests: ``.ci/run`` sets CI=true itself, and
``scripts/install-slurm.sh`` says what failed when it cannot install, failing under CI=true.

The script runs against fakes (``id``, ``apt-get``, ``make`` first on PATH; INSTALL_SLURM_PATH
pointing at a folder that has, or lacks, the Slurm binaries), so no package is installed and
/usr/sbin/policy-rc.d is never touched: every case ends before the install step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-slurm.sh"
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel",
            "munged")


def _fake(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run(tmp: Path, *, uid: int, ci: str | None, apt: str | None = None,
         installed: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """Run install-slurm.sh as user `uid` with `apt` as apt-get's body (None: no apt-get)."""
    fakes, search = tmp / "fakes", tmp / "search"
    fakes.mkdir()
    search.mkdir()
    calls = tmp / "apt-calls"
    _fake(fakes, "id", f"echo {uid}")
    if apt is not None:
        _fake(fakes, "apt-get", f'echo "$*" >> {calls}\n{apt}')
    if installed:
        for name in BINARIES:
            _fake(search, name, "exit 0")
    # PATH holds the fakes and the one external tool the script needs before it would install
    # (tr), nothing else: the real apt-get must be unreachable.
    tools = tmp / "tools"
    tools.mkdir()
    (tools / "tr").symlink_to(shutil.which("tr"))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=f"{fakes}:{tools}", INSTALL_SLURM_PATH=str(search))
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=60)
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("ci, code", [(None, 0), ("true", 1), ("TRUE", 1), ("1", 1)])
def test_not_root_says_what_it_means(tmp_path: Path, ci: str | None, code: int) -> None:
    done, apt_calls = _run(tmp_path, uid=1000, ci=ci, apt="exit 0")
    assert done.returncode == code, done.stderr
    assert "not root" in done.stderr and "missing: slurmctld" in done.stderr, done.stderr
    if code:
        assert "CI=true" in done.stderr and "failing now" in done.stderr, done.stderr
    else:
        assert "tests/slurm will be SKIPPED" in done.stderr, done.stderr
    assert apt_calls == ""


@pytest.mark.parametrize("ci, code", [(None, 0), ("true", 1)])
def test_offline_apt_is_named_and_fails_under_ci(tmp_path: Path, ci: str | None,
                                                 code: int) -> None:
    offline = ("echo \"W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease"
               "  Temporary failure resolving 'deb.debian.org'\" >&2\nexit 100")
    done, apt_calls = _run(tmp_path, uid=0, ci=ci, apt=offline)
    assert done.returncode == code, done.stderr
    assert "'apt-get update' failed (offline" in done.stderr, done.stderr
    assert apt_calls.split("\n")[0].startswith("update"), apt_calls
    assert "install" not in apt_calls  # it stopped there: nothing half-installed


def test_no_apt_get_fails_under_ci(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, uid=0, ci="yes", apt=None)
    assert done.returncode == 1 and "no apt-get" in done.stderr, done.stderr


def test_already_installed_needs_neither_root_nor_apt(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, uid=1000, ci="true", apt=None, installed=True)
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stderr


def test_ci_run_sets_ci_true_itself(tmp_path: Path) -> None:
    """Whatever the CI service exports (here: nothing), `make test` runs with CI=true."""
    seen = tmp_path / "make-saw"
    _fake(tmp_path, "make", f'echo "CI=${{CI:-}} $*" > {seen}')
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = f"{tmp_path}:{env.get('PATH', '/usr/bin:/bin')}"
    done = subprocess.run([str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert seen.read_text().strip() == "CI=true test"
