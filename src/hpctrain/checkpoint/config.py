"""Config section ``checkpoint:``: when to save, how many to keep, how to resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.errors import ConfigError


@dataclass
class CheckpointConfig:
    """Save cadence, retention and the async/verification switches."""

    # When to save. Left unset it follows from the keys below: `every` (steps) or
    # `every_minutes` (wall time) when one is given, else auto: Daly's optimum from the measured
    # save cost and the job's MTTF, never so often that saves cost more than `max_overhead` of
    # the run, the first after `first_minutes`. none: only on preemption, before the Slurm time
    # limit and at the end.
    interval: Literal["auto", "steps", "minutes", "none"] | None = None
    every: int | None = None  # steps between saves (interval=steps; 100 when unset)
    every_minutes: float | None = None  # minutes of wall time between saves (interval=minutes)
    # interval=auto: the first save, before any save was measured. A save of up to 18 s then
    # costs at most 1% of the time before it.
    first_minutes: float = 30.0
    # interval=auto: the largest share of the run that periodic saves may cost (the floor on
    # the interval is save cost / max_overhead, whatever Daly says).
    max_overhead: float = 0.01
    # Under Slurm, one save is made when the job's end time (its --time limit) is nearer than
    # the measured save time plus this margin, so a job that runs out of time loses nothing.
    # 0: no such save (nor is there one when the run saves nothing: interval=none and
    # save_at_end=false).
    limit_margin_minutes: float = 5.0
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
    # Write the shard files with O_DIRECT (no page cache: the device's speed at a fraction of
    # the CPU, as `hpctrain bench disk` measures it), where the file system allows it; false
    # writes them through the page cache, for a file system that takes O_DIRECT badly.
    direct_io: bool = True
    save_at_end: bool = True
    # auto: resume from the newest verified checkpoint of this run if any; never: start fresh
    # (refused if the run directory already holds checkpoints); or a checkpoint directory.
    resume: str = "auto"
    # Requeues per job allowed after preemption (compared with SLURM_RESTART_COUNT).
    max_requeues: int = 10

    def validate(self) -> None:
        """Check cadence and retention values."""
        self._check_cadence()
        for key in ("first_minutes", "max_overhead"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"checkpoint.{key} = {getattr(self, key)} must be positive")
        if self.max_overhead >= 1:
            raise ConfigError(f"checkpoint.max_overhead = {self.max_overhead} is the whole run",
                              expected="a fraction below 1, e.g. 0.01 for 1%")
        if not self.limit_margin_minutes >= 0:
            raise ConfigError(f"checkpoint.limit_margin_minutes = {self.limit_margin_minutes} "
                              "must be >= 0", hint="0 turns the save before the time limit off")
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

    @property
    def cadence(self) -> str:
        """The interval in force: ``interval``, or when unset what ``every`` (steps) or
        ``every_minutes`` implies, else auto."""
        if self.interval is not None:
            return self.interval
        return ("steps" if self.every is not None else
                "minutes" if self.every_minutes is not None else "auto")

    @property
    def saves_before_limit(self) -> bool:
        """Whether a save is made ahead of the Slurm time limit: a margin is set and the run
        saves at all (not interval=none with save_at_end=false, as benchmarks run)."""
        return self.limit_margin_minutes > 0 and (self.cadence != "none" or self.save_at_end)

    @property
    def every_steps(self) -> int:
        """Steps between saves under the steps cadence (100 when ``every`` is unset)."""
        return self.every if self.every is not None else 100

    def _check_cadence(self) -> None:
        """One vocabulary: ``every`` counts steps, ``every_minutes`` minutes; the old
        ambiguous spellings are refused with the new one."""
        if self.every is not None and self.every_minutes is not None:
            raise ConfigError(
                f"checkpoint.every = {self.every} (steps) and checkpoint.every_minutes = "
                f"{self.every_minutes} both set", expected="one cadence",
                hint="keep one; or leave both unset for the automatic interval")
        if self.interval == "minutes" and self.every_minutes is None:
            raise ConfigError(
                "checkpoint.interval = minutes needs checkpoint.every_minutes"
                + (f" (checkpoint.every = {self.every} counts steps)" if self.every else ""),
                hint=f"write checkpoint.every_minutes={self.every or 60} instead")
        # A cadence key the interval in force does not read would be silently ignored.
        ignored = {"steps": ("every_minutes",), "auto": ("every_minutes",),
                   "none": ("every", "every_minutes")}.get(self.interval or "", ())
        for key in ignored:
            if getattr(self, key) is not None:
                raise ConfigError(
                    f"checkpoint.{key} = {getattr(self, key)} is ignored under "
                    f"checkpoint.interval = {self.interval}",
                    expected=f"no checkpoint.{key} with interval={self.interval}",
                    hint=f"drop checkpoint.{key} (checkpoint.{key}=null on the command line "
                    f"when a config file sets it), or drop checkpoint.interval to save by it")
        if self.interval == "auto" and self.every is not None:
            raise ConfigError(
                f"checkpoint.every = {self.every} counts steps, but checkpoint.interval = auto",
                hint=f"drop checkpoint.interval to save every {self.every} steps; under auto "
                f"the first save comes after checkpoint.first_minutes={self.every} instead")
        if self.every is not None and self.every < 1:
            raise ConfigError(f"checkpoint.every = {self.every} must be >= 1 step",
                              hint="use checkpoint.interval=none to save only at the end")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ConfigError(f"checkpoint.every_minutes = {self.every_minutes} must be "
                              "positive", hint="use checkpoint.interval=none to save only at "
                              "the end")
