"""benchmarks/lanes.py: lanes of commands on their own GPUs, detached, packed for the trip back."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lanes.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _lanes(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_lanes_run_side_by_side_and_come_back_in_one_tarball(tmp_path: Path) -> None:
    folder = tmp_path / "lanes"
    started = _lanes("start", str(folder),
                     "--lane", "0,1", "echo gpus=$CUDA_VISIBLE_DEVICES nvls=$NCCL_NVLS_ENABLE",
                     "echo kept > $LANE_RESULTS/a.json; false",
                     "--lane", "2,3", "echo 'quoted words' gpus=$CUDA_VISIBLE_DEVICES",
                     cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    waited = _lanes("wait", str(folder), "--seconds", "30", "--tar", str(tmp_path / "r.tgz"),
                    cwd=tmp_path)
    assert waited.returncode == 0 and "lanes done" in waited.stdout, waited.stdout
    first = (folder / "lane-0.log").read_text()
    assert "gpus=0,1 nvls=0" in first
    # Each command's own exit code, the failing one too; the lane goes on after it.
    assert [line.split()[-1] for line in first.splitlines() if " exit " in line] == ["0", "1"]
    assert "quoted words gpus=2,3" in (folder / "lane-1.log").read_text()
    with tarfile.open(tmp_path / "r.tgz") as tf:
        names = set(tf.getnames())
    assert {"DONE", "lane-0.log", "lane-1.log", "results/a.json"} <= names


def test_a_malformed_lane_or_a_reused_folder_is_refused(tmp_path: Path) -> None:
    bad = _lanes("start", str(tmp_path / "x"), "--lane", "a,b", "true", cwd=tmp_path)
    assert bad.returncode != 0 and "GPUS like 0,1" in bad.stderr
    loose = _lanes("start", str(tmp_path / "y"), "true", cwd=tmp_path)
    assert loose.returncode != 0 and "after --lane" in loose.stderr
    assert _lanes("start", str(tmp_path / "z"), "--lane", "0", "true", cwd=tmp_path
                  ).returncode == 0
    again = _lanes("start", str(tmp_path / "z"), "--lane", "0", "true", cwd=tmp_path)
    assert again.returncode != 0 and "holds lanes already" in again.stderr
