"""``hpctrain submit`` against a fake ``sbatch`` (first on PATH): what it writes, creates, passes
and prints, and how a refusal comes back. tests/slurm/test_submit_jobs.py submits for real.

    .venv/bin/pytest tests/launch/test_submit.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch.submit import array_indices

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def fake_sbatch(folder: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """An ``sbatch`` first on PATH that records its argv, cwd and script, then runs `body`."""
    bin_dir = folder / "fake-bin"
    bin_dir.mkdir()
    calls = folder / "sbatch-calls"
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\n"
        f'echo "$PWD $*" >> {calls}\n'
        f'cp "${{@: -1}}" {folder}/submitted.sh\n'
        f"{body}\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return calls


def _submit(capsys: pytest.CaptureFixture, *args: str, code: int = 0) -> tuple[str, str]:
    if code:
        with pytest.raises(SystemExit) as exc:
            main(["submit", *args])
        assert exc.value.code == code
    else:
        main(["submit", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return out, err


def test_submit_prints_the_job_id_and_keeps_the_script_beside_its_log(
        project: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch, 'echo "4242;cluster"')
    out, err = _submit(capsys, "configs/demo.yaml", "train.steps=3", "--job-name", "demo")
    assert out == "4242\n"  # jid=$(hpctrain submit ...) works
    logs = project / "runs" / "slurm-logs"
    kept = logs / "demo-4242.sh"
    assert kept.read_text() == (tmp_path / "submitted.sh").read_text()
    assert "#SBATCH --output=" + str(logs / "demo-%j.out") in kept.read_text()
    assert [p.name for p in logs.iterdir()] == ["demo-4242.sh"]  # no temporary left behind
    cwd, argv = calls.read_text().strip().split(" ", 1)
    assert cwd == str(project) and argv.startswith("--parsable ")
    assert (project / "runs").is_dir()  # the run's output folder exists before the job
    assert f"run directory {project / 'runs' / 'demo-4242'}" in err, err
    assert f"log {logs / 'demo-4242.out'}" in err, err


def test_array_and_dependency(project: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    fake_sbatch(tmp_path, monkeypatch, "echo 77")
    out, err = _submit(capsys, "configs/demo.yaml", "run.name=sweep", "--array", "0-4:2%1",
                       "--dependency", "afterok:17")
    assert out == "77\n"
    script = (tmp_path / "submitted.sh").read_text().splitlines()
    assert "#SBATCH --array=0-4:2%1" in script and "#SBATCH --dependency=afterok:17" in script
    for task in (0, 2, 4):
        assert str(project / "runs" / f"sweep-77_{task}") in err, err
    assert "sweep-77_1" not in err
    assert str(project / "runs" / "slurm-logs" / "hpctrain-77_<task>.out") in err, err


def test_fixed_run_name_without_suffix(project: Path, tmp_path: Path, monkeypatch,
                                       capsys) -> None:
    fake_sbatch(tmp_path, monkeypatch, "echo 5")
    _, err = _submit(capsys, "configs/demo.yaml", "run.suffix=none", "run.out_dir=out")
    assert f"run directory {project / 'out' / 'demo'}" in err, err


def test_dry_run_creates_and_submits_nothing(project: Path, tmp_path: Path, monkeypatch,
                                             capsys) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch, "echo 1")
    out, err = _submit(capsys, "configs/demo.yaml", "--dry-run")
    assert out.startswith("#!/bin/bash\n") and "srun " in out
    assert "dry run" in err and "sbatch --parsable" in err, err
    assert not calls.exists()
    assert not (project / "runs").exists()


def test_a_refusal_comes_back_with_sbatch_words_and_the_script(project: Path, tmp_path: Path,
                                                               monkeypatch, capsys) -> None:
    fake_sbatch(tmp_path, monkeypatch,
                'echo "sbatch: error: invalid partition specified: gpu" >&2\nexit 1')
    out, err = _submit(capsys, "configs/demo.yaml", "--partition", "gpu", code=1)
    assert out == ""
    assert "invalid partition specified: gpu" in err, err
    kept = list((project / "runs" / "slurm-logs").glob("*.sh"))
    assert len(kept) == 1 and str(kept[0]) in err, err


def test_without_sbatch_it_says_where_to_run(project: Path, tmp_path: Path, monkeypatch,
                                             capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    _, err = _submit(capsys, "configs/demo.yaml", code=1)
    assert "sbatch not found" in err and "--dry-run" in err, err


def test_a_bad_config_never_reaches_sbatch(project: Path, tmp_path: Path, monkeypatch,
                                           capsys) -> None:
    calls = fake_sbatch(tmp_path, monkeypatch, "echo 1")
    _, err = _submit(capsys, "configs/demo.yaml", "train.stepz=3", code=2)
    assert "stepz" in err
    assert not calls.exists()


@pytest.mark.parametrize("spec, indices", [
    ("0-3", [0, 1, 2, 3]), ("1,3,5", [1, 3, 5]), ("0-15:4%2", [0, 4, 8, 12]), ("7", [7]),
])
def test_array_indices(spec: str, indices: list[int]) -> None:
    assert array_indices(spec) == indices
