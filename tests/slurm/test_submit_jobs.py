"""``hpctrain submit`` against a real Slurm: a dependency is honoured (afterok on a failed parent
cancels the job; afterany runs it after the parent), and an array's tasks train into the run
directories the command printed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpctrain.cli import main

from .conftest import SlurmCluster
from .jobs import TINY
from .test_cluster import write_script

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
REPO = Path(__file__).resolve().parents[2]


def _submit(capsys: pytest.CaptureFixture, *args: str) -> tuple[str, str]:
    main(["submit", "configs/demo.yaml", *TINY, "train.steps=2", "parallel.strategy=none",
          *args])
    out, err = capsys.readouterr()
    return out.strip(), err


def test_dependency_and_array(slurm_cluster: SlurmCluster, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture) -> None:
    project = tmp_path / "proj"
    (project / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", project / "configs")
    monkeypatch.chdir(project)
    for key in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(key, slurm_cluster.env[key])

    # Held until both dependants are submitted: they name a parent that has not ended yet,
    # however long the submissions take.
    parent = slurm_cluster.sbatch(write_script(tmp_path / "fails.sh", "exit 3\n"), "--hold",
                                  f"--output={tmp_path}/fails.out")
    never, _ = _submit(capsys, "--job-name", "never", "--dependency", f"afterok:{parent}")
    after, err = _submit(capsys, "--job-name", "after", "--array", "0-1",
                         "--dependency", f"afterany:{parent}")
    slurm_cluster.run("scontrol", "release", parent)
    assert slurm_cluster.wait(parent, timeout=60) == "FAILED"
    # afterok on a failed parent: cancelled, not pending forever.
    assert slurm_cluster.wait(never, timeout=60) == "CANCELLED", slurm_cluster.job_info(never)
    parent_end = slurm_cluster.job_info(parent)["EndTime"]
    for task in (0, 1):
        job = f"{after}_{task}"
        state = slurm_cluster.wait(job, timeout=240)
        log = project / "runs" / "slurm-logs" / f"after-{job}.out"
        assert state == "COMPLETED", log.read_text()[-3000:]
        assert slurm_cluster.job_info(job)["StartTime"] >= parent_end
        run_dir = project / "runs" / f"demo-{job}"
        assert str(run_dir) in err, err
        info = json.loads((run_dir / "exit_info.json").read_text())
        assert info["exit_code"] == 0 and info["extra"]["steps"] == 2, info
    assert (project / "runs" / "slurm-logs" / f"after-{after}.sh").is_file()
