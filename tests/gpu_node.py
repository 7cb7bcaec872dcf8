"""A CPU machine made to look like a node with H100s, for the processes that must read its GPU
without initialising CUDA (hpctrain.plan.gpu): torch.cuda sees 2 devices, nvidia-ml-py is a
stand-in answering as NVML does on an H100 (or is missing), and CUDA's initialisation fails the
test if anything calls it."""

from __future__ import annotations

import sys
import types

import pytest
import torch

H100_NAME, H100_BYTES = "NVIDIA H100 80GB HBM3", 81559 * 2**20  # as nvidia-smi shows it


def _nvml() -> types.ModuleType:
    """What a process reads of nvidia-ml-py on a node with H100s."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: H100_NAME
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=H100_BYTES)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    return nvml


def gpu_node(monkeypatch: pytest.MonkeyPatch, nvml: bool) -> None:
    """torch.cuda sees 2 GPUs, NVML (``nvml``) an H100; initialising CUDA fails the test."""
    def cuda_init() -> None:
        raise AssertionError("this process initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", cuda_init)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "pynvml", _nvml() if nvml else None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
