"""Profiles on demand: a PyTorch profiler trace per rank, and CUDA memory snapshots.

    hpctrain train cfg.yaml profile.steps=[20,22]     # steps 20..22, every rank
    kill -URG <pid of any rank>                       # the next profile.signal_steps steps
    scancel --signal=URG <job id>                     # the same under Slurm (every task)

SIGURG, not SIGUSR1: NCCL may use SIGUSR1, and SIGUSR2/SIGTERM mean preemption here. SIGURG's
default action is to ignore it, so it is harmless to a process that does not handle it (the
launcher, the batch shell, srun) and one ``scancel --signal=URG`` to the whole step is safe. A
rank only notes the signal; the ranks agree at the next logging window (the straggler exchange
carries the flag) and all profile the same steps, starting at the next step.

Run directory (documented contract):

    profiles/step-000020-000022/rank-000.trace.json   Chrome trace (chrome://tracing, Perfetto)
    profiles/step-000020-000022/rank-000.memory.pickle  CUDA memory snapshot of those steps
                                                        (allocation history; pytorch.org/memory_viz)
    profiles/oom-rank-000.pickle                       CUDA memory snapshot at an out-of-memory

and a metrics event per profile: ``{"event": "profile", "first_step", "last_step", "trigger",
"trace", "memory_snapshot"}`` (paths relative to the run directory).

On CUDA an out-of-memory error writes ``profiles/oom-rank-NNN.pickle`` from PyTorch's OOM
observer, while the memory is still held; with ``profile.memory_history=true`` the allocator
records every allocation from the start (about 2 us each), so that snapshot shows what led to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpctrain.errors import ConfigError
from hpctrain.runtime.safe_open import make_dir, write_atomic

log = logging.getLogger("hpctrain.profile")

PROFILES_DIR = "profiles"
# Allocation events kept while a profile records memory history (several KB each).
_HISTORY_ENTRIES = 100_000


@dataclass
class ProfileConfig:
    """Config section ``profile:``: profiler traces and CUDA memory snapshots."""

    # [first, last]: profile these training steps (inclusive) on every rank. Empty: none.
    steps: list[int] = field(default_factory=list)
    # Signal that asks a running job for a profile; "" turns the trigger off.
    signal: str = "SIGURG"
    # Steps profiled after a signal.
    signal_steps: int = 3
    # On CUDA: record the allocation history during a profile and write a memory snapshot.
    memory: bool = True
    # On CUDA: record the allocation history for the whole run (an OOM snapshot then shows
    # what allocated the memory; costs ~2 us per allocation).
    memory_history: bool = False

    def validate(self) -> None:
        """steps is [first, last] with 1 <= first <= last; the signal is a catchable one."""
        if self.steps and (len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]):
            raise ConfigError(f"profile.steps = {self.steps} is not [first, last]",
                              expected="two step numbers, 1 <= first <= last, e.g. [20, 22]")
        if self.signal and (not hasattr(signal, self.signal)
                            or self.signal in ("SIGKILL", "SIGSTOP")):
            raise ConfigError(f"profile.signal = {self.signal!r} is not a catchable signal",
                              expected="a name such as SIGURG, or '' for no signal")
        if self.signal_steps < 1:
            raise ConfigError(f"profile.signal_steps = {self.signal_steps} must be >= 1")


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def oom_snapshot_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its out-of-memory snapshot."""
    return Path(run_dir) / PROFILES_DIR / f"oom-rank-{rank:03d}.pickle"


def write_oom_snapshot(run_dir: Path, rank: int) -> Path | None:
    """Write the CUDA memory snapshot of an OOM (once per process); None where there is none."""
    path = oom_snapshot_path(run_dir, rank)
    if os.path.lexists(path) or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        make_dir(path.parent)
        write_atomic(path, pickle.dumps(torch.cuda.memory._snapshot()))
    except Exception as e:  # the OOM is the story; a failed snapshot must not replace it
        log.warning("could not write the OOM memory snapshot %s: %s", path, e)
        return None
    log.error("out of memory: CUDA memory snapshot written to %s (open it at "
              "https://pytorch.org/memory_viz)", path)
    return path


def install_oom_snapshot(run_dir: Path, rank: int, device: torch.device,
                         history: bool) -> bool:
    """On CUDA, write a snapshot from PyTorch's OOM observer; True if the observer is installed."""
    if not _cuda(device):
        return False
    if history:
        torch.cuda.memory._record_memory_history("all", max_entries=_HISTORY_ENTRIES,
                                                 stacks="python")
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False

    def observer(device_index: int, alloc: int, device_alloc: int, device_free: int) -> None:
        write_oom_snapshot(run_dir, rank)

    attach(observer)
    return True


class Profiler:
    """Starts and stops the torch profiler at step boundaries; one per rank."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.device = device
        self.signalled = False  # set by the signal handler, read at the next window
        self._planned: list[tuple[int, int, str]] = []
        if cfg.steps:
            self._planned.append((cfg.steps[0], cfg.steps[1], "config"))
        self._active: tuple[Any, int, int, str] | None = None
        self._previous_handler: Any = None
        self._signum: int | None = None

    def install_signal(self) -> None:
        """Catch ``profile.signal`` (only notes it: the profile starts at a step boundary)."""
        if not self.cfg.signal:
            return
        self._signum = getattr(signal, self.cfg.signal)
        with contextlib.suppress(ValueError):  # not the main thread (an embedded trainer)
            self._previous_handler = signal.signal(self._signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def restore_signal(self) -> None:
        """Put the previous handler back."""
        if self._signum is not None and self._previous_handler is not None:
            with contextlib.suppress(ValueError):
                signal.signal(self._signum, self._previous_handler)

    def request(self, next_step: int) -> None:
        """Profile ``profile.signal_steps`` steps from ``next_step`` (all ranks agreed on it)."""
        self.signalled = False
        if self._active is None:
            self._planned.append((next_step, next_step + self.cfg.signal_steps - 1, "signal"))

    def step_start(self, step: int) -> None:
        """Start a planned profile that begins at ``step``."""
        if self._active is not None or not self._planned:
            return
        for plan in list(self._planned):
            first, last, trigger = plan
            if first <= step <= last:
                self._planned.remove(plan)
                self._start(step, last, trigger)
                return

    def step_end(self, step: int) -> dict[str, Any] | None:
        """Stop the profile that ends at ``step``; returns its metrics event."""
        if self._active is None or step < self._active[2]:
            return None
        return self._stop(step)

    def close(self, step: int) -> dict[str, Any] | None:
        """Stop a profile still running (the run ended inside it, at ``step``)."""
        event = self._stop(step) if self._active is not None else None
        self.restore_signal()
        return event

    def _start(self, first: int, last: int, trigger: str) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if _cuda(self.device):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.cfg.memory:
                torch.cuda.memory._record_memory_history("all", max_entries=_HISTORY_ENTRIES,
                                                         stacks="python")
        prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                      with_stack=False)
        prof.__enter__()
        self._active = (prof, first, last, trigger)
        log.info("profiling steps %d..%d (%s)", first, last, trigger)

    def _stop(self, last: int) -> dict[str, Any]:
        prof, first, _, trigger = self._active
        self._active = None
        prof.__exit__(None, None, None)
        folder = self.run_dir / PROFILES_DIR / f"step-{first:06d}-{last:06d}"
        make_dir(folder)
        trace = folder / f"rank-{self.rank:03d}.trace.json"
        # torch opens the path itself: give it a fresh random name, then replace the final one
        # (which a link planted there would otherwise have redirected, see safe_open.py).
        staged = folder / f".{trace.name}.{secrets.token_hex(8)}.tmp"
        try:
            prof.export_chrome_trace(str(staged))
            os.replace(staged, trace)
        finally:
            staged.unlink(missing_ok=True)
        memory = None
        if _cuda(self.device) and self.cfg.memory:
            memory = folder / f"rank-{self.rank:03d}.memory.pickle"
            write_atomic(memory, pickle.dumps(torch.cuda.memory._snapshot()))
            if not self.cfg.memory_history:  # keep recording for an OOM snapshot if asked
                torch.cuda.memory._record_memory_history(None)
        log.info("profile of steps %d..%d written to %s", first, last, folder)
        return {"event": "profile", "first_step": first, "last_step": last, "trigger": trigger,
                "trace": str(trace.relative_to(self.run_dir)),
                "memory_snapshot": str(memory.relative_to(self.run_dir)) if memory else None}
