"""A two-node job on the test Slurm (two slurmd on this machine, ``hpctrain-n1`` on 127.0.0.1 and
``hpctrain-n2`` on 127.0.0.2): the script ``hpctrain sbatch --preflight --container IMAGE``
generates runs the doctor on every task, then one rank per node; the ranks find rank 0 through
``SLURM_JOB_NODELIST`` (gloo), train, checkpoint on the preemption signal, are requeued and
resume exactly where an uninterrupted run ends. A preflight that finds a problem (a node with
another torch, injected) stops the job before it trains.

This is the path every multi-node user takes; only the GPUs and the network are missing. The
container runtime is a stand-in (``apptainer`` first on the job's PATH; Apptainer itself is not
installed here): it checks its arguments and runs the program as a container would see the
host, without Slurm's tools. So rank 0 cannot requeue with ``scontrol`` and asks the batch
script to, through the job log: the container path of the requeue protocol.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hpctrain.launch.containers import Container
from hpctrain.launch.doctor import INJECT_ENV
from hpctrain.runtime.requeue import SCRIPT_MARKER

from .conftest import CLIENTS, SlurmCluster
from .jobs import PREEMPT_STEPS, REPO, ReferenceLosses, diagnosis, exit_info, script, wait_for_steps

FAKE_APPTAINER = """#!/bin/bash
# Stand-in for `apptainer exec [--nv] --bind A,B IMAGE PROGRAM...`: checks the image and that
# the working folder is bound, then runs PROGRAM without the host's Slurm tools on PATH.
echo "$SLURMD_NODENAME $*" >> {record}
[ "$1" = exec ] || {{ echo "fake apptainer: $1?" >&2; exit 64; }}
shift
binds=
while [ $# -gt 0 ]; do
    case "$1" in
        --nv) shift ;;
        --bind) binds=$2; shift 2 ;;
        *) break ;;
    esac
done
[ -f "$1" ] || {{ echo "fake apptainer: no image $1" >&2; exit 255; }}
shift
case ",$binds," in *",$PWD,"*) ;; *) echo "fake apptainer: $PWD not bound" >&2; exit 255 ;; esac
PATH={no_slurm} exec "$@"
"""


def fake_apptainer(tmp: Path) -> tuple[dict[str, str], Path, Path]:
    """(PATH for the job with the stand-in first, its record file, an image file)."""
    no_slurm = tmp / "no-slurm-bin"
    no_slurm.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name not in CLIENTS:
            os.symlink(tool, no_slurm / tool.name)
    assert shutil.which("scontrol", path=str(no_slurm)) is None
    fake = tmp / "fake-bin"
    fake.mkdir()
    record = tmp / "apptainer-calls"
    (fake / "apptainer").write_text(FAKE_APPTAINER.format(record=record, no_slurm=no_slurm))
    (fake / "apptainer").chmod(0o755)
    image = tmp / "hpctrain.sif"
    image.write_bytes(b"stand-in image")
    return {"PATH": f"{fake}:{os.environ['PATH']}"}, record, image


@pytest.mark.slow
def test_two_node_job_preempted_requeued_resumes_exactly(slurm_two_nodes: SlurmCluster,
                                                         tmp_path, reference: ReferenceLosses
                                                         ) -> None:
    steps = PREEMPT_STEPS
    expected = reference.preemption()  # (started by test_cluster.py where that runs first)
    where = tmp_path / "where"
    path_env, calls, image = fake_apptainer(tmp_path)
    container = Container(str(image), "apptainer", [str(REPO), str(tmp_path)])
    path = script(tmp_path, "twonode", [f"train.steps={steps}", "parallel.strategy=ddp"],
                  pause_at=6, where=where, nodes=2, tasks_per_node=1, time="10:00",
                  preflight=True, container=container)
    env = {**slurm_two_nodes.env, "PATH": f"{path_env['PATH']}:{slurm_two_nodes.env['PATH']}"}
    job = slurm_two_nodes.sbatch(path, cwd=REPO, env=env)
    run_dir = tmp_path / "runs" / f"twonode-{job}"
    wait_for_steps(slurm_two_nodes, job, run_dir, 5)
    slurm_two_nodes.scancel(job, signal="USR2")
    state = slurm_two_nodes.wait(job, timeout=240)
    log = (tmp_path / "logs" / f"twonode-{job}.out").read_text()
    info = slurm_two_nodes.job_info(job)
    assert state == "COMPLETED", diagnosis(slurm_two_nodes, job, run_dir)
    assert info["RestartCnt"] == "1" and info["NodeList"] == "hpctrain-n[1-2]", info
    # Both steps (doctor, training) of both runs (before and after the requeue): rank 0 on the
    # first node, rank 1 on the second.
    ranks = sorted(where.read_text().splitlines())
    assert ranks == ["hpctrain-n1 0"] * 4 + ["hpctrain-n2 1"] * 4, (ranks, log[-3000:])
    assert "preempted by SIGUSR2" in log and "resumed from step-" in log, log[-3000:]
    assert log.count("doctor: 11 checks, no problems") == 2, log[-3000:]
    assert "2 ranks on 2 nodes: hpctrain-n1, hpctrain-n2" in log
    # Inside the container rank 0 found no scontrol: the batch script requeued the job.
    assert f"{SCRIPT_MARKER} restart=0 target={job}" in log, log[-3000:]
    assert "scontrol not found (container?)" in log, log[-3000:]
    runs = calls.read_text().splitlines()
    assert len(runs) == 8 and all(f"exec --bind {REPO},{tmp_path} {image} " in r
                                  for r in runs), runs
    done = exit_info(run_dir)
    assert done["exit_code"] == 0 and done["extra"]["steps"] == steps, done
    assert done["extra"]["final_loss"] == expected.result(), (done, log[-3000:])


def test_a_failed_preflight_stops_the_job_before_it_trains(slurm_two_nodes: SlurmCluster,
                                                           tmp_path) -> None:
    path = script(tmp_path, "sick", ["train.steps=3", "parallel.strategy=ddp"], nodes=2,
                  tasks_per_node=1, time="10:00", preflight=True)
    env = {**slurm_two_nodes.env, INJECT_ENV: '{"1": {"torch": "2.10.0+cu126"}}'}
    job = slurm_two_nodes.sbatch(path, cwd=REPO, env=env)
    state = slurm_two_nodes.wait(job, timeout=120)
    log = (tmp_path / "logs" / f"sick-{job}.out").read_text()
    assert state == "FAILED" and slurm_two_nodes.job_info(job)["ExitCode"] == "1:0", \
        slurm_two_nodes.diagnosis(job)
    (line,) = [ln for ln in log.splitlines() if ln.startswith("PROBLEM")]
    assert "versions differ across the job: hpctrain-n1 (rank 0): torch " in line, line
    assert "vs hpctrain-n2 (rank 1): torch 2.10.0+cu126 -- fix: " in line, line
    assert not (tmp_path / "runs").exists()  # training never started
