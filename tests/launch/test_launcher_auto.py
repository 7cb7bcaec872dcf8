"""``hpctrain train --nproc N`` resolves ``auto`` before its ranks start without initialising
CUDA in the launcher (hpctrain.plan.gpu): a context there would hold GPU 0 memory for the whole
run and break CUDA in anything it forks. Here on the CPU the machine is made to look like one
with GPUs (torch.cuda's device count, NVML through a stand-in for nvidia-ml-py, which cannot
run without a driver) and CUDA's initialisation fails the test if anything calls it; the ranks
themselves are not started (the step under test is the launcher's, before them)."""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import DEMO, TINY
from hpctrain.config import load_config
from hpctrain.launch import local
from hpctrain.plan.auto import CPU, resolve_auto
from hpctrain.plan.gpu import gpu_without_cuda

H100_NAME, H100_BYTES = "NVIDIA H100 80GB HBM3", 81559 * 2**20  # as nvidia-smi shows it
# 512 samples of 32 tokens per step on 2 ranks: the CPU's stand-in caps a micro-batch at 64 of
# them, an H100 at 512, so the two choices differ.
AUTO = [*TINY, "run.device=auto", "train.global_batch_tokens=32768", "train.micro_batch=auto",
        "parallel.strategy=auto", "parallel.activation_checkpointing=auto"]


def _nvml() -> types.ModuleType:
    """What the launcher reads of nvidia-ml-py on a node with H100s."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: H100_NAME
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=H100_BYTES)
    return nvml


def _gpu_node(monkeypatch: pytest.MonkeyPatch, nvml: bool) -> None:
    """torch.cuda sees 2 GPUs; initialising CUDA fails the test."""
    def cuda_init() -> None:
        raise AssertionError("the launcher initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", cuda_init)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "pynvml", _nvml() if nvml else None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "no-nvml"])
def test_the_launcher_chooses_auto_without_initialising_cuda(
        nvml: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nvidia-ml-py: for the H100 NVML reads; without: for the CPU's stand-in (each rank
    sizes it on its GPU). Either way torch.cuda is never initialised here."""
    _gpu_node(monkeypatch, nvml)
    started = []
    monkeypatch.setattr(local, "launch_local", lambda nproc, *a, **k: started.append(nproc))
    cfg = load_config(DEMO, [*AUTO, f"run.out_dir={tmp_path}"])
    given = copy.deepcopy(cfg)

    gpu = gpu_without_cuda(cfg)
    assert (gpu.name, gpu.bytes) == (H100_NAME, H100_BYTES) if nvml else gpu is None
    local.launch_training(cfg, Path(DEMO), [], 2)

    assert started == [2] and not torch.cuda.is_initialized()
    expected = resolve_auto(given, 2, gpu or CPU).values
    assert {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in expected} \
        == expected
    assert cfg.train.micro_batch > 64 if nvml else cfg.train.micro_batch <= 64


def test_sbatch_chooses_for_the_cpu_stand_in_without_cuda(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """sbatch (and submit, which shares its checks) on a login node that has a GPU: the job's
    GPUs are elsewhere, so auto is checked for the CPU's stand-in and CUDA stays untouched."""
    from hpctrain.cli import main

    _gpu_node(monkeypatch, nvml=True)
    config = str(Path(DEMO).resolve())
    monkeypatch.chdir(tmp_path)  # its log folder is created here
    main(["sbatch", config, *AUTO, "--tasks-per-node", "2"])
    assert "#SBATCH" in capsys.readouterr().out and not torch.cuda.is_initialized()
