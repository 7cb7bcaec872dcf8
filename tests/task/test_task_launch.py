"""A task file before and around its run: the checks that refuse a run judge the task (never the
built-in model's default shape), and ``hpctrain sbatch my_task.py`` writes a script that runs it
as written (one run of the script, its ``srun`` a stand-in that starts the program as one task).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.cli import _world_size, main
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.runtime.config import TooLargeForCPU
from hpctrain.task import Task
from hpctrain.train import preflight
from hpctrain.train.job import check_device_fits
from hpctrain.train.task_trainer import refuse_large_task_on_cpu

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

TASK_FILE = """\
import torch
from torch import nn
from hpctrain.task import Task

def task():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Linear(4, 1), data=torch.utils.data.TensorDataset(x, x[:, :1]),
                loss=nn.functional.mse_loss)
"""


def test_preflight_judges_a_task_by_the_task_rules() -> None:
    """Refused before the run directory is touched, with the task's reason (not after start,
    on the ranks); the built-in model's size is no reason to refuse a task on a CPU."""
    tp = load_config(None, ["task=mine.py", "parallel.strategy=fsdp", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="parallel.tp = 2 with a task of your own"):
        preflight.check_config(tp, 2)
    preflight.check_config(load_config(None, ["task=mine.py", "parallel.strategy=ddp"]), 2)
    if not torch.cuda.is_available():
        check_device_fits(load_config(None, ["task=mine.py", "model.size=8b"]))
        with pytest.raises(TooLargeForCPU, match="the task's model"):  # its own size counts
            refuse_large_task_on_cpu(load_config(None, ["task=big.py"]), Task(
                model=lambda: nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(5)]),
                data=torch.zeros(8, 4), loss=nn.functional.mse_loss))


def test_the_size_check_calls_the_factory_as_the_real_build_does() -> None:
    """A factory's own ConfigError (a bad task_args value) stops the run at the size check, not
    swallowed there to be raised again by a second call; a factory that cannot build on the
    meta device (it reads weights) is left for the real build to report."""
    calls = []

    def refusing() -> nn.Module:
        calls.append(1)
        raise ConfigError("task_args.width = -1 must be positive")

    def reading() -> nn.Module:
        return nn.Linear(2, 2).load_state_dict(torch.load("/nonexistent.pt"))

    cfg = load_config(None, ["task=t.py"])
    with pytest.raises(ConfigError, match="width = -1"):
        refuse_large_task_on_cpu(cfg, Task(model=refusing, data=torch.zeros(8, 4),
                                           loss=nn.functional.mse_loss))
    assert calls == [1]
    refuse_large_task_on_cpu(cfg, Task(model=reading, data=torch.zeros(8, 4),
                                       loss=nn.functional.mse_loss))


def test_a_task_of_srun_takes_its_world_size_from_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun sets no WORLD_SIZE: without Slurm's count a task file's run on 4 tasks would get
    no data-parallel strategy (`hpctrain train my_task.py` sets ddp for several ranks)."""
    for name in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    assert _world_size(None) == 4
    # `srun -n1 hpctrain train my_task.py --nproc 2`: the ranks are the ones --nproc starts.
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1")
    assert _world_size(None) == 1
    assert _world_size(2) == 2


def test_sbatch_of_a_task_file_runs_it_as_written(project: Path) -> None:
    (project / "my tasks").mkdir()
    (project / "my tasks" / "fit me.py").write_text(TASK_FILE)
    main(["sbatch", "my tasks/fit me.py", "train.steps=2", "metrics.progress=false",
          "--tasks-per-node", "2", "-o", "two.sh"])
    two = (project / "two.sh").read_text()
    assert "parallel.strategy" not in two  # each rank sets ddp for itself, seeing 2 tasks
    # One task, so that the script's run is one process: srun starts the program itself.
    main(["sbatch", "my tasks/fit me.py", "train.steps=2", "metrics.progress=false", "-o",
          "one.sh"])
    text = (project / "one.sh").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    argv = shlex.split(line)
    assert argv[argv.index("-m") + 1:] == ["hpctrain", "train", "my tasks/fit me.py",
                                           "train.steps=2", "metrics.progress=false"]
    fake = project / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                               'SLURM_STEP_ID=0 exec "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_CPUS_PER_TASK": "1"}
    for name in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID", "HPCTRAIN_FAULTS"):
        env.pop(name, None)
    done = subprocess.run(["bash", str(project / "one.sh")], cwd="/", env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "done: 2 steps" in done.stdout, done.stdout[-3000:]
    assert (project / "runs" / "fit me-4242" / "checkpoints" / "step-00000002").is_dir()
    assert sys.executable in text


def test_k8s_of_a_task_file_carries_it_in_the_configmap(project: Path, capsys) -> None:
    import yaml

    (project / "fit_me.py").write_text(TASK_FILE)
    main(["k8s", "fit_me.py", "train.steps=2", "--image", "img:1", "--runs-pvc", "runs",
          "--nodes", "2"])
    out = capsys.readouterr()
    config_map = next(yaml.safe_load_all(out.out))
    assert config_map["kind"] == "ConfigMap"
    assert config_map["data"]["task.py"] == TASK_FILE
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config == {"task": "/etc/hpctrain/task.py", "run": {"name": "fit_me"},
                      "parallel": {"strategy": "ddp"}, "train": {"steps": 2}}
    assert "modules it imports must be in the image" in out.err


def test_checking_a_tasks_placement_does_not_import_the_trainer() -> None:
    """Writing an sbatch script for a task checks its layout without the training stack (the
    Trainer pulls in models, checkpoints and compile machinery); one fresh interpreter, as the
    test session's own has imported the Trainer long since."""
    code = ("import sys\n"
            "from hpctrain.config import load_config\n"
            "from hpctrain.launch.sbatch import check_placement\n"
            "check_placement(load_config(None, ['task=t.py', 'parallel.strategy=ddp']), 1, 2)\n"
            "print(sorted(m for m in sys.modules if m.startswith('hpctrain.train.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "hpctrain.train.task_trainer" not in out and "hpctrain.train.trainer" not in out, out
