"""``plan memory`` for a user's own task (hpctrain.plan.task_memory), on CPU: the counted states
against a real optimizer step, FSDP's shards and gathered units counted by hand, the
extrapolation from two measured peaks, and the CPU report saying it measured nothing. (The
measured step itself needs a CUDA GPU: the lead runs it on the device machine.)"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.plan.task_memory import (
    MeasuredStep,
    TaskMemory,
    extrapolate,
    task_memory,
)
from hpctrain.task import load_task

TASK = """\
import torch
from torch import nn
from hpctrain.task import Task

def task():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Sequential(nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 3)),
                data=torch.utils.data.TensorDataset(x, x[:, :3]),
                loss=nn.functional.mse_loss)
"""
# The model's parameters: (10, 16), (10,), (3, 10), (3,).
PARAMS = 16 * 10 + 10 + 10 * 3 + 3


@pytest.fixture(scope="module")
def task_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("task") / "mem_task.py"
    path.write_text(textwrap.dedent(TASK))
    return path


def _cfg(task_file: Path, *overrides: str):
    return load_config(None, [f"task={task_file}", "train.micro_batch=4", *overrides])


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_states_are_what_a_real_optimizer_step_holds(task_file: Path, optim: str) -> None:
    cfg = _cfg(task_file, f"optim.name={optim}", "optim.weight_decay=0.0001",
               "parallel.strategy=none")
    report = task_memory(cfg, gpus=1, device=torch.device("cpu"))
    assert report.n_params == PARAMS
    model = load_task(str(task_file)).build_model()
    opt = (torch.optim.AdamW(model.parameters(), fused=True) if optim == "adamw" else
           torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True))
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    held = [*model.parameters(), *(p.grad for p in model.parameters()),
            *(t for s in opt.state.values() for t in s.values())]
    assert report.states == sum(t.numel() * t.element_size() for t in held)
    assert report.params == report.grads == 4 * PARAMS and report.gathered == 0
    assert report.peak is None and report.working is None  # nothing measured on CPU


def test_fsdp_shards_each_tensor_and_gathers_units(task_file: Path) -> None:
    cfg = _cfg(task_file, "parallel.strategy=fsdp", "train.precision=bf16")
    report = task_memory(cfg, gpus=4, device=torch.device("cpu"))
    # Dim 0 padded to a multiple of 4: 10 rows -> 3 per rank, 3 rows -> 1 per rank.
    local = 3 * 16 + 3 + 1 * 10 + 1
    assert (report.params, report.grads) == (4 * local, 4 * local)
    assert report.optimizer == 2 * 4 * local + 4 * 4  # two fp32 moments, a step per tensor
    # Both Linear units gathered in bf16 (running + prefetched), the larger one's fp32
    # gradients before their reduce-scatter; the root holds no parameters of its own.
    assert report.gathered == 2 * PARAMS + 4 * (16 * 10 + 10)
    kept = task_memory(_cfg(task_file, "parallel.strategy=fsdp", "train.precision=bf16",
                            "parallel.reshard_after_forward=false"), gpus=4,
                       device=torch.device("cpu"))
    assert kept.gathered == report.gathered  # two units: all of them either way


def test_fsdp_holds_two_of_three_units_unless_told_to_keep_them(tmp_path: Path) -> None:
    path = tmp_path / "wide_task.py"
    path.write_text(WIDE_TASK)
    big, first, last = 2048 * 2048 + 2048, 64 * 2048 + 2048, 2048 * 64 + 64
    for keep, held in (("true", big + first), ("false", big + first + last)):
        cfg = _cfg(path, "parallel.strategy=fsdp", "train.precision=bf16",
                   f"parallel.reshard_after_forward={keep}")
        # One rank shards nothing, yet its units are freed after their forward all the same.
        report = task_memory(cfg, gpus=1, device=torch.device("cpu"))
        assert report.gathered == 2 * held + 4 * big


def test_activations_grow_by_the_measured_slope() -> None:
    measured = MeasuredStep({1: 1000.0, 2: 1300.0}, update=900.0, states=500.0)
    assert extrapolate(measured, 8) == (200.0, 2400.0, 300.0, 400.0)
    # The peak is the larger moment: backward at micro-batch 8, the update at 1 (0 activations
    # would leave 200 of working memory below the update's 400).
    report = TaskMemory(1, 100.0, 100.0, 300.0, 0.0, *extrapolate(measured, 8), "GPU")
    assert (report.peak, report.peak_moment) == (500 + 200 + 2400, "backward")
    small = TaskMemory(1, 100.0, 100.0, 300.0, 0.0, 200.0, 0.0, 300.0, 400.0, "GPU")
    assert (small.peak, small.peak_moment) == (500 + 400, "optimizer update")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's report")
def test_plan_memory_of_a_task_config_says_it_measured_nothing_on_cpu(task_file: Path,
                                                                      capsys) -> None:
    """``hpctrain plan memory`` (in process) sizes the task's model, not the built-in one the
    config's model section would describe."""
    command = ["plan", "memory", f"task={task_file}", "train.micro_batch=4",
               "parallel.strategy=ddp", "--gpus", "2"]
    main([*command, "--gpu", "h100"])
    out = capsys.readouterr().out
    assert f"task {task_file} ({PARAMS} params), ddp over 2 GPUs" in out
    assert "not measured" in out and "CPU: nothing measured" in out
    assert "fits: states alone" in out
    main([*command, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["peak"] is None and data["activations"] is None and data["gpus"] == 2
    assert data["params"] == 4 * PARAMS  # DDP: whole on every rank


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's report")
def test_plan_takes_a_task_file_as_train_does(task_file: Path, capsys) -> None:
    """``hpctrain plan SUBCOMMAND my_task.py KEY=VALUE`` (in process), as ``hpctrain train
    my_task.py`` reads it: memory sizes the task's model (DDP on --gpus 2, as train --nproc 2
    would), interval and goodput read its checkpoint keys, parallel says why it does not
    apply."""
    main(["plan", "memory", str(task_file), "train.micro_batch=4", "--gpus", "2", "--gpu",
          "h100"])
    assert f"task {task_file} ({PARAMS} params), ddp over 2 GPUs" in capsys.readouterr().out
    main(["plan", "interval", str(task_file), "checkpoint.mttf_gpu_hours=800", "--gpus", "8",
          "--save-min", "1"])
    assert "job MTTF 100.00 h" in capsys.readouterr().out
    main(["plan", "goodput", str(task_file), "checkpoint.mttf_gpu_hours=800", "--gpus", "8",
          "--save-s", "60", "--restart-s", "300"])
    assert "job MTTF 100.00 h" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "parallel", str(task_file), "--gpu", "h100"])
    err = capsys.readouterr().err
    assert exc.value.code != 0 and "plan parallel: task" in err and "plan memory TASK" in err


WIDE_TASK = """\
import torch
from torch import nn
from hpctrain.task import Task

def task():
    x = torch.randn(32, 512, 64, generator=torch.Generator().manual_seed(0))
    return Task(model=lambda: nn.Sequential(nn.Linear(64, 2048), nn.GELU(),
                                            nn.Linear(2048, 2048), nn.GELU(),
                                            nn.Linear(2048, 64)),
                data=torch.utils.data.TensorDataset(x, x.flip(-1)),
                loss=nn.functional.mse_loss)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a step on a CUDA GPU")
def test_cuda_prediction_matches_a_measured_step(tmp_path: Path) -> None:
    """On a GPU: the peak extrapolated from micro-batches 1 and 2 is the peak a step at 16
    reaches (same model, precision and optimizer), within 5%; activations (512 rows a sample)
    are a large part of it."""
    from hpctrain.plan.task_memory import measure_step

    path = tmp_path / "wide_task.py"
    path.write_text(WIDE_TASK)
    cfg = _cfg(path, "train.micro_batch=16", "parallel.strategy=none", "train.precision=bf16")
    report = task_memory(cfg, gpus=1)
    real = measure_step(load_task(str(path)), cfg, torch.device("cuda"), sizes=(16,))
    peak = max(real.forward_backward[16], real.update)
    assert report.measured_on and report.activations > 0.2 * peak, (report, real)
    assert abs(report.peak - peak) <= 0.05 * peak, (report, real)
