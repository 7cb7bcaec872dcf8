"""The script ``hpctrain sbatch -o train.sh`` writes, submitted unchanged to a real Slurm, trains.

A newcomer's session: a project folder, no virtual environment activated (so ``python3`` on PATH
has no hpctrain), ``hpctrain sbatch configs/demo.yaml ... -o train.sh``, then ``sbatch train.sh``
from that folder and from another one. Nothing between the command and Slurm touches the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from hpctrain.observe.metrics import read_metrics

from .conftest import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
TINY = ["data.max_bytes=200000", "data.seq_len=32", "model.dim=64", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "train.micro_batch=2",
        "parallel.strategy=none", "metrics.log_every=1", "metrics.progress=false",
        f"train.steps={STEPS}"]


def newcomer_env(base: dict[str, str]) -> dict[str, str]:
    """`base` as a shell that never activated the venv: no venv on PATH, no PYTHONPATH."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in base.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS")}
    env["PATH"] = ":".join(d for d in base.get("PATH", "").split(":")
                           if d and os.path.realpath(d) != os.path.realpath(venv_bin))
    return env


def submit(cluster: SlurmCluster, script: str, cwd: Path, env: dict[str, str]) -> str:
    """`sbatch SCRIPT` exactly as typed at a prompt; return the job id it prints."""
    done = cluster.run("sbatch", script, cwd=cwd, env=env)
    found = re.fullmatch(r"Submitted batch job (\d+)", done.stdout.strip())
    assert found, done.stdout
    return found.group(1)


def test_generated_script_trains_unchanged_from_any_directory(slurm_cluster: SlurmCluster,
                                                             tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (project / "configs").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(REPO / "configs" / "demo.yaml", project / "configs" / "demo.yaml")
    env = newcomer_env(slurm_cluster.env)
    # Precondition: the interpreter a bare `python3` would be cannot run hpctrain here.
    bare = shutil.which("python3", path=env["PATH"])
    if bare is not None:
        probe = subprocess.run([bare, "-c", "import hpctrain"], env=env, cwd=project,
                               capture_output=True, timeout=60)
        assert probe.returncode != 0, f"{bare} imports hpctrain: this test would prove nothing"

    # The console script `make` installs (the same command through -m where there is none).
    script_cmd = Path(sys.executable).with_name("hpctrain")
    hpctrain = [str(script_cmd)] if script_cmd.is_file() else [sys.executable, "-m", "hpctrain"]
    generated = slurm_cluster.run(*hpctrain, "sbatch", "configs/demo.yaml", *TINY,
                                  "--job-name", "newcomer", "-o", "train.sh", cwd=project,
                                  env=env, timeout=120)
    script = project / "train.sh"
    written = script.read_bytes()
    assert "sbatch train.sh" in generated.stderr, generated.stderr

    jobs = {"from its folder": submit(slurm_cluster, "train.sh", project, env),
            "from elsewhere": submit(slurm_cluster, str(script), elsewhere, env)}
    for how, job in jobs.items():
        state = slurm_cluster.wait(job, timeout=300)
        log = project / "runs" / "slurm-logs" / f"newcomer-{job}.out"
        assert log.is_file(), f"{how}: no job log {log}\n{slurm_cluster.logs()}"
        text = log.read_text(errors="replace")
        assert state == "COMPLETED", f"{how}: {slurm_cluster.job_info(job)}\n{text[-3000:]}"
        run_dir = project / "runs" / f"demo-{job}"
        info = json.loads((run_dir / "exit_info.json").read_text())
        assert info["exit_code"] == 0 and info["extra"]["steps"] == STEPS, (how, info)
        steps = [r["step"] for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl")
                 if "loss" in r]
        assert steps == list(range(1, STEPS + 1)), (how, steps)
        assert f"hpctrain: job {job} restart 0" in text, text[-3000:]
    assert not (elsewhere / "runs").exists()  # relative paths meant the project folder
    assert script.read_bytes() == written
