"""The GPU ``auto`` chooses for (hpctrain.plan.auto): this machine's, or one given by name.

    this_gpu(cfg)          # in a rank: device 0 as torch sees it (the CPU's stand-in if none)
    gpu_without_cuda(cfg)  # in a launcher: the same device read through NVML, or None
    named_gpu("h100")      # as a rank on an H100 sees it: `plan --gpu`, `tune --gpu`

Only a rank asks CUDA. The process that starts the ranks (`hpctrain train --nproc`) must not:
reading a device's properties initialises CUDA in it, which holds a context (~0.5 GB) on GPU 0
for the whole run and leaves CUDA unusable in any child it forks. It reads NVML instead, as
nvidia-smi does, which creates no context.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.parallel import DEFAULT_PEAK_TFLOPS

CPU_MEM_BYTES = 16e9  # per rank on the CPU, as tune assumes


@dataclass(frozen=True)
class Gpu:
    """What the choice is made for: the device's name, its memory and dense peak."""

    name: str
    bytes: float
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    cpu: bool = False


CPU = Gpu("cpu", CPU_MEM_BYTES, cpu=True)  # the CPU's stand-in (tests, demo, a login node)


def this_gpu(cfg) -> Gpu:
    """The GPU this process would train on (device 0: a node's GPUs are of one kind), or the
    CPU's stand-in."""
    import torch

    from hpctrain.observe.peaks import peak_tflops

    if cfg.run.device != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
        return Gpu(name, float(torch.cuda.get_device_properties(0).total_memory),
                   peak or DEFAULT_PEAK_TFLOPS)
    return CPU


def gpu_without_cuda(cfg) -> Gpu | None:
    """Device 0 read without initialising CUDA: the CPU's stand-in where no GPU is visible,
    NVML's device name and memory where nvidia-ml-py is installed, else None (only CUDA could
    tell). NVML's total memory counts the driver's reservation too, a little more than the
    ranks' torch reports: a launcher's check is never stricter than theirs."""
    import torch

    from hpctrain.observe.peaks import peak_tflops
    from hpctrain.observe.power import PowerUnavailable, load_nvml, nvml_handle

    # device_count() asks NVML first, which creates no CUDA context (torch.cuda's note).
    if cfg.run.device == "cpu" or torch.cuda.device_count() == 0:
        return CPU
    try:
        nvml = load_nvml()
    except PowerUnavailable:  # nvidia-ml-py is not installed
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:  # no driver NVML can load
        return None
    try:
        handle = nvml_handle(nvml, 0)
        name = nvml.nvmlDeviceGetName(handle)
        total = float(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    except (PowerUnavailable, nvml.NVMLError):
        return None
    finally:
        nvml.nvmlShutdown()
    name = name.decode() if isinstance(name, bytes) else name  # older pynvml: bytes
    peak = peak_tflops(name, "fp32" if cfg.train.precision == "fp32" else "bf16")
    return Gpu(name, total, peak or DEFAULT_PEAK_TFLOPS)


def named_gpu(name: str, precision: str = "bf16") -> Gpu:
    """A GPU given by name (``h100``, ``h200``...) or memory in GB, as a rank on it sees it
    (torch's device name and total memory, from the planner's table): what `plan --gpu`,
    `tune --gpu` and a login node choose for."""
    from hpctrain.plan.memory_options import gpu_named
    from hpctrain.plan.parallel import gpu_peak_tflops

    device, total = gpu_named(name)
    return Gpu(device, total, gpu_peak_tflops(name, precision) or DEFAULT_PEAK_TFLOPS)
