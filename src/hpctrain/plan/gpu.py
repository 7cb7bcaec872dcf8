"""The GPU ``auto`` chooses for (hpctrain.plan.auto): this machine's, or one given by name.

    this_gpu(cfg)          # device 0 of this machine (the CPU's stand-in where there is none)
    named_gpu("h100")      # as a rank on an H100 sees it: `plan --gpu`, `tune --gpu`
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


def named_gpu(name: str, precision: str = "bf16") -> Gpu:
    """A GPU given by name (``h100``, ``h200``...) or memory in GB, as a rank on it sees it
    (torch's device name and total memory, from the planner's table): what `plan --gpu`,
    `tune --gpu` and a login node choose for."""
    from hpctrain.plan.memory_options import gpu_named
    from hpctrain.plan.parallel import gpu_peak_tflops

    device, total = gpu_named(name)
    return Gpu(device, total, gpu_peak_tflops(name, precision) or DEFAULT_PEAK_TFLOPS)
