"""Config section ``run:``: naming, output location, seed, device and process-group settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError


@dataclass
class RunConfig:
    """Where a run writes and how its processes find each other."""

    name: str = "run"
    out_dir: str = "runs"
    # "auto" appends the Slurm job id (array: job_task), the launcher's run id, or a timestamp,
    # so two runs never share a directory by accident; "none" uses the name as it is.
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
