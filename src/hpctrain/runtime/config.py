"""Config section ``run:``: naming, output location, seed, device and process-group settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError

# With run.device=auto and no GPU, larger models are refused rather than trained on the CPU:
# a GPU config landing on a login node would otherwise grow to tens of GB and crawl for days.
# 300M parameters are ~5 GB of fp32 weights, gradients and AdamW moments.
CPU_AUTO_MAX_PARAMS = 300_000_000


@dataclass
class RunConfig:
    """Where a run writes and how its processes find each other."""

    name: str = "run"
    out_dir: str = "runs"
    # "auto" appends the Slurm job id (array: job_task) under Slurm, which a requeue keeps;
    # outside Slurm the name is used as it is. Either way the same command finds the same
    # directory again and resumes (the run lock keeps two live runs out of one directory).
    suffix: Literal["auto", "none"] = "auto"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # A rank that waits longer than this for its peers (init, a collective) fails instead of
    # hanging the allocation.
    timeout_s: float = 600.0

    def validate(self) -> None:
        """Reject names that would escape the output directory and non-positive timeouts."""
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(
                f"run.name = {self.name!r} is not a plain directory name",
                expected="letters, digits, '-', '_' (no '/', not starting with '.')",
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"run.timeout_s = {self.timeout_s} must be positive")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "run.backend = 'nccl' needs CUDA devices but run.device = 'cpu'",
                hint="use run.backend=gloo (or auto) on CPU",
            )


class TooLargeForCPU(ConfigError):
    """A GPU-sized model would land on the CPU (run.device=auto, no GPU visible)."""


def refuse_large_model_on_cpu(n_params: int, *, model: str, force: str) -> None:
    """Raise TooLargeForCPU for a model above CPU_AUTO_MAX_PARAMS that would land on the CPU."""
    if n_params <= CPU_AUTO_MAX_PARAMS:
        return
    # fp32 weights + gradients + AdamW's two moments, before any activation.
    state_gb = n_params * 16 / 1e9
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    raise TooLargeForCPU(
        f"{model} has {n_params / 1e9:.2f}B parameters and no GPU is visible: it would train on "
        f"the CPU, needing ~{state_gb:.0f} GB for weights, gradients and optimizer state alone",
        expected=f"a GPU, or at most {CPU_AUTO_MAX_PARAMS / 1e6:.0f}M parameters on the CPU",
        hint=f"run on a GPU node (CUDA_VISIBLE_DEVICES={visible}), "
        f"pick a smaller model, or set {force} to train it on the CPU anyway",
    )
