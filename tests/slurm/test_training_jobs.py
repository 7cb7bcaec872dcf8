"""hpctrain's preemption protocol against a real Slurm: signal → checkpoint → requeue → resume.

The batch scripts are the ones `hpctrain sbatch` generates; ranks are `srun` tasks on CPU (gloo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.checkpoint.manifest import read_manifest, verify_files
from hpctrain.launch.sbatch import SbatchParams, create_log_dir, render_sbatch
from hpctrain.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = ["run.device=cpu", "data.source=stdlib", "data.max_bytes=300000", "data.seq_len=64",
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "train.micro_batch=2", "train.precision=fp32",
        "train.deterministic=true", "optim.warmup_steps=2", "metrics.log_every=1",
        "metrics.progress=false", "checkpoint.interval=none", "preempt.check_every=1"]


def _script(tmp: Path, name: str, overrides: list[str], *, pause_at: int | None = None,
            **params) -> Path:
    """The generated batch script; ``pause_at`` holds step N for 4 s (an injected, harmless
    stall) so a signal sent after N-1 logged steps lands mid-run, however fast the steps are."""
    python = sys.executable
    if pause_at is not None:
        python = str(tmp / f"{name}-python.sh")
        Path(python).write_text("#!/bin/bash\n"
                                f"export HPCTRAIN_FAULTS='hang@step={pause_at},seconds=4'\n"
                                f'exec {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    p = SbatchParams(config="configs/demo.yaml", workdir=str(REPO), python=python,
                     overrides=[*TINY, f"run.out_dir={tmp / 'runs'}", f"run.name={name}",
                                *overrides],
                     job_name=name, log_dir=str(tmp / "logs"), **params)
    path = tmp / f"{name}.sh"
    path.write_text(render_sbatch(p))
    create_log_dir(p)  # as `hpctrain sbatch` does: Slurm does not create --output directories
    return path


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics" / "rank-000.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for r in read_metrics(path) if "loss" in r)


def _wait_for_steps(cluster, job: str, run_dir: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _steps_logged(run_dir) < n:
        state = cluster.job_info(job)["JobState"]
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} ended ({state}) before {n} steps:\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_dir} logged fewer than {n} steps in {timeout:.0f} s")
        time.sleep(0.3)


def _exit_info(run_dir: Path) -> dict:
    return json.loads((run_dir / "exit_info.json").read_text())


def _reference_final_loss(tmp: Path, ranks: int, steps: int, strategy: str) -> float:
    """The same training, uninterrupted, through the local launcher."""
    cmd = [sys.executable, "-m", "hpctrain", "train", "configs/demo.yaml", *TINY,
           f"run.out_dir={tmp / 'ref'}", "run.name=ref", "run.suffix=none",
           f"train.steps={steps}", f"parallel.strategy={strategy}"]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300, capture_output=True)
    return _exit_info(tmp / "ref" / "ref")["extra"]["final_loss"]


@pytest.mark.slow
def test_signal_checkpoint_requeue_resume_exact(slurm_cluster, tmp_path: Path) -> None:
    steps = 30
    script = _script(tmp_path, "preempt", [f"train.steps={steps}", "parallel.strategy=ddp"],
                     pause_at=6, tasks_per_node=2, time="10:00")
    job = slurm_cluster.sbatch(script, cwd=REPO)
    run_dir = tmp_path / "runs" / f"preempt-{job}"
    _wait_for_steps(slurm_cluster, job, run_dir, 5)
    slurm_cluster.scancel(job, signal="USR2")  # to every task of the step, as --signal does
    state = slurm_cluster.wait(job, timeout=240)
    log = (tmp_path / "logs" / f"preempt-{job}.out").read_text()
    info = slurm_cluster.job_info(job)
    assert state == "COMPLETED", f"{info}\n{log[-3000:]}"
    assert info["RestartCnt"] == "1"
    assert "preempted by SIGUSR2" in log
    assert "resumed from step-" in log
    done = _exit_info(run_dir)
    assert done["exit_code"] == 0 and done["extra"]["steps"] == steps
    # The preempted-and-requeued run ends exactly where an uninterrupted one does.
    assert done["extra"]["final_loss"] == _reference_final_loss(tmp_path, 2, steps, "ddp")


@pytest.mark.slow
def test_walltime_signal_reaches_the_ranks(slurm_cluster, tmp_path: Path) -> None:
    # A real --time with --signal=USR2@100: Slurm signals ~20 s in (it may be up to a minute
    # late). max_requeues=0: checkpoint and stop, so the job ends instead of looping.
    script = _script(tmp_path, "walltime", ["train.steps=1000000", "checkpoint.max_requeues=0",
                                            "parallel.strategy=none"],
                     time="2", signal_lead_s=100)
    job = slurm_cluster.sbatch(script, cwd=REPO)
    start = time.monotonic()
    state = slurm_cluster.wait(job, timeout=180)
    run_dir = tmp_path / "runs" / f"walltime-{job}"
    log = (tmp_path / "logs" / f"walltime-{job}.out").read_text()
    info = _exit_info(run_dir)
    assert state == "FAILED", log[-3000:]  # exit 75: preempted, not completed
    assert slurm_cluster.job_info(job)["ExitCode"].startswith("75:"), log[-3000:]
    assert info["exit_code"] == 75 and "preempted by SIGUSR2" in info["reason"]
    assert "reached checkpoint.max_requeues" in info["extra"]["requeue"]
    assert time.monotonic() - start < 120, "the signal came after the time limit"
    ckpt = run_dir / "checkpoints" / info["last_checkpoint"]
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest["files"], sorted(manifest["files"]))


@pytest.mark.slow
def test_array_task_requeues_only_itself(slurm_cluster, tmp_path: Path) -> None:
    script = _script(tmp_path, "arr", ["train.steps=40", "parallel.strategy=none"],
                     pause_at=6, time="10:00", array="0-1")
    job = slurm_cluster.sbatch(script, cwd=REPO)
    run_1 = tmp_path / "runs" / f"arr-{job}_1"
    _wait_for_steps(slurm_cluster, f"{job}_1", run_1, 5)
    slurm_cluster.scancel(f"{job}_1", signal="USR2")
    assert slurm_cluster.wait(f"{job}_1", timeout=240) == "COMPLETED"
    assert slurm_cluster.wait(f"{job}_0", timeout=240) == "COMPLETED"
    assert slurm_cluster.job_info(f"{job}_0")["RestartCnt"] == "0"
    assert slurm_cluster.job_info(f"{job}_1")["RestartCnt"] == "1"
    assert _exit_info(tmp_path / "runs" / f"arr-{job}_0")["extra"]["steps"] == 40
    assert _exit_info(run_1)["extra"]["steps"] == 40
