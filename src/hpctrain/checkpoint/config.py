"""Config section ``checkpoint:``: when to save, how many to keep, how to resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError


@dataclass
class CheckpointConfig:
    """Save cadence, retention and the async/verification switches."""

    # steps: every `every` steps; minutes: every `every` minutes of wall time; auto: the
    # Young/Daly optimum from the measured save cost and the job's MTTF (first save after
    # `every` minutes); none: only on preemption and at the end.
    interval: Literal["steps", "minutes", "auto", "none"] = "steps"
    every: float = 100
    # Mean time to failure of ONE GPU; the job's MTTF is this divided by the number of GPUs.
    # Llama 3's 16k-GPU run saw ~50k GPU-hours per interruption.
    mttf_gpu_hours: float = 50_000.0
    keep_last: int = 2
    # Also keep every checkpoint whose step is a multiple of this (0: none).
    keep_every: int = 0
    # Stage to host memory, write in the background; the loop blocks only for the copy.
    async_save: bool = True
    # Who writes background saves: process (a writer process per rank: serialisation, writes
    # and checksums never hold the training process's GIL or slow its steps), thread (a thread
    # of the training process), or auto: process on GPUs; thread on CPU ranks, which share
    # their cores with any writer and would pay an interpreter start per run.
    writer: Literal["auto", "process", "thread"] = "auto"
    # Files each rank writes at once (DCP's thread_count; each thread serialises one file).
    # One thread wrote ~0.5 GB/s on an H200 host, bound by serialisation rather than the disk.
    # 0: auto, half the CPU cores this rank has, from 1 to 8.
    write_threads: int = 0
    save_at_end: bool = True
    # auto: resume from the newest verified checkpoint of this run if any; never: start fresh
    # (refused if the run directory already holds checkpoints); or a checkpoint directory.
    resume: str = "auto"
    # Requeues per job allowed after preemption (compared with SLURM_RESTART_COUNT).
    max_requeues: int = 10

    def validate(self) -> None:
        """Check cadence and retention values."""
        if self.interval != "none" and self.every <= 0:
            raise ConfigError(f"checkpoint.every = {self.every} must be positive",
                              hint="use checkpoint.interval=none to save only at the end")
        if self.interval == "steps" and self.every != int(self.every):
            raise ConfigError(f"checkpoint.every = {self.every} must be a whole number of steps")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last = {self.keep_last} must be >= 1",
                              hint="the newest checkpoint is always kept")
        if self.writer not in ("auto", "process", "thread"):
            raise ConfigError(f"checkpoint.writer = {self.writer!r} is not a writer",
                              expected="auto, process or thread")
        if self.write_threads < 0:
            raise ConfigError(f"checkpoint.write_threads = {self.write_threads} must be >= 0",
                              hint="0 picks half the CPU cores of each rank, at most 8")
        if self.keep_every < 0 or self.max_requeues < 0:
            raise ConfigError("checkpoint.keep_every and checkpoint.max_requeues must be >= 0")
        if self.mttf_gpu_hours <= 0:
            raise ConfigError(f"checkpoint.mttf_gpu_hours = {self.mttf_gpu_hours} must be > 0")
