"""The GPU ``auto`` chooses for (hpctrain.plan.auto): this machine's, or one given by name.

    this_gpu(cfg)          # in a rank: device 0 as torch sees it (the CPU's stand-in if none)
    gpu_without_cuda(cfg)  # in a launcher: the same device read through NVML, or None
    node_gpu(cfg)          # in tune and bench model: NVML, else a child process asks CUDA
    gpu_name(0)            # a benchmark's caption, in the process that starts the ranks
    named_gpu("h100")      # as a rank on an H100 sees it: `plan --gpu`, `tune --gpu`

Only a rank asks CUDA. The process that starts the ranks (`hpctrain train --nproc`, `tune`,
`bench model`) must not: reading a device's properties initialises CUDA in it, which holds a
context (~0.5 GB) on GPU 0 for the whole run, less memory for the runs it measures, and leaves
CUDA unusable in any child it forks. It reads NVML instead, as nvidia-smi does, which creates
no context.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

from hpctrain.errors import RuntimeEnvError
from hpctrain.plan.parallel import DEFAULT_PEAK_TFLOPS

CPU_MEM_BYTES = 16e9  # per rank on the CPU, as tune assumes

log = logging.getLogger("hpctrain.plan")


@dataclass(frozen=True)
class Gpu:
    """What the choice is made for: the device's name, its memory and dense peak."""

    name: str
    bytes: float
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    cpu: bool = False
    capability: tuple[int, int] | None = None  # CUDA's (major, minor), where it was read


CPU = Gpu("cpu", CPU_MEM_BYTES, cpu=True)  # the CPU's stand-in (tests, demo, a login node)


def this_gpu(cfg) -> Gpu:
    """The GPU this process would train on (device 0: a node's GPUs are of one kind), or the
    CPU's stand-in."""
    import torch

    if cfg.run.device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return _gpu(cfg, props.name, float(props.total_memory), (props.major, props.minor))
    return CPU


def gpu_without_cuda(cfg) -> Gpu | None:
    """Device 0 read without initialising CUDA: the CPU's stand-in where no GPU is visible,
    NVML's device name and memory where NVML can read it, else None (logged why; only CUDA
    could tell). NVML's total memory counts the driver's reservation too, a little more than
    the ranks' torch reports: a launcher's check is never stricter than theirs."""
    from hpctrain.observe.power import PowerUnavailable

    if _no_gpu(cfg):
        return CPU
    try:
        return _gpu(cfg, *nvml_reading(0))
    except PowerUnavailable as e:
        log.warning("GPU 0 not read through NVML (%s): the GPU's limits are checked only as "
                    "each rank starts", e.what)
        return None


def node_gpu(cfg) -> Gpu:
    """Device 0 for a process that runs GPU work in child processes (tune, bench model): the
    CPU's stand-in where no GPU is visible, NVML's reading, else what a short-lived child
    process reads of CUDA (its context ends with it; ~2 s of imports)."""
    from hpctrain.observe.power import PowerUnavailable

    if _no_gpu(cfg):
        return CPU
    try:
        return _gpu(cfg, *nvml_reading(0))
    except PowerUnavailable as e:
        return _gpu_from_child(cfg, nvml_said=e.what)


def gpu_name(index: int = 0) -> str:
    """CUDA device ``index``'s name as NVML reads it (``GPU N (unread: why)`` where it cannot),
    for a process that starts ranks and so must hold no CUDA context: a benchmark's caption."""
    from hpctrain.observe.power import PowerUnavailable

    try:
        return nvml_reading(index)[0]
    except PowerUnavailable as e:
        return f"GPU {index} (unread: {e.what})"


def nvml_reading(index: int) -> tuple[str, float, tuple[int, int]]:
    """(name, total memory, CUDA capability) of CUDA device ``index`` through NVML, which
    creates no CUDA context; PowerUnavailable says why NVML cannot read it here."""
    from hpctrain.observe.power import PowerUnavailable, load_nvml, nvml_handle, start_nvml

    nvml = load_nvml()
    start_nvml(nvml)
    try:
        handle = nvml_handle(nvml, index)
        name = nvml.nvmlDeviceGetName(handle)
        total = float(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except nvml.NVMLError as e:
        raise PowerUnavailable(f"NVML could not read GPU {index}: {e}") from None
    finally:
        nvml.nvmlShutdown()
    name = name.decode() if isinstance(name, bytes) else name  # older pynvml: bytes
    return name, total, (major, minor)


def _no_gpu(cfg) -> bool:
    """A CPU run, or no CUDA device visible (device_count() asks NVML first, which creates no
    CUDA context: torch.cuda's note)."""
    import torch

    return cfg.run.device == "cpu" or torch.cuda.device_count() == 0


# Run by `python -c` in a child: device 0's properties as JSON.
_ASK_CUDA = ("import json, torch; p = torch.cuda.get_device_properties(0); "
             "print(json.dumps([p.name, p.total_memory, p.major, p.minor]))")


def _gpu_from_child(cfg, nvml_said: str) -> Gpu:
    """Device 0 as a child process's CUDA reads it (``nvml_said``: why NVML could not)."""
    name, total, major, minor = _child_reading(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                               nvml_said)
    return _gpu(cfg, name, float(total), (major, minor))


@functools.cache
def _child_reading(visible: str | None, nvml_said: str) -> tuple[str, int, int, int]:
    """(name, total memory, CUDA capability) of device 0 among ``visible``, read once per
    process (tune reads it again for every candidate it runs)."""
    try:
        done = subprocess.run([sys.executable, "-c", _ASK_CUDA], capture_output=True,
                              text=True, timeout=300)
        name, total, major, minor = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _unreadable([str(e)], nvml_said) from None
    except (ValueError, IndexError):  # it printed no properties: its error says why
        raise _unreadable(done.stderr.strip().splitlines()[-3:], nvml_said) from None
    return name, total, major, minor


def _unreadable(lines: list[str], nvml_said: str) -> RuntimeEnvError:
    return RuntimeEnvError(
        "GPU 0 could not be read: a child process asking CUDA for its properties failed:",
        lines=lines, expected="a GPU that CUDA can use (torch.cuda.device_count() > 0 here)",
        hint=f"NVML could not read it either ({nvml_said}); check the node with `hpctrain "
        "doctor` and `nvidia-smi`; run.device=cpu runs on the CPU")


def _gpu(cfg, name: str, total: float, capability: tuple[int, int] | None) -> Gpu:
    """A GPU read by name and memory, with its dense peak for the config's precision."""
    from hpctrain.observe.peaks import peak_tflops

    peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
    return Gpu(name, total, peak or DEFAULT_PEAK_TFLOPS, capability=capability)


def named_gpu(name: str, precision: str = "bf16") -> Gpu:
    """A GPU given by name (``h100``, ``h200``...) or memory in GB, as a rank on it sees it
    (torch's device name and total memory, from the planner's table): what `plan --gpu`,
    `tune --gpu` and a login node choose for."""
    from hpctrain.plan.memory_options import gpu_named
    from hpctrain.plan.parallel import gpu_peak_tflops

    device, total = gpu_named(name)
    return Gpu(device, total, gpu_peak_tflops(name, precision) or DEFAULT_PEAK_TFLOPS)
