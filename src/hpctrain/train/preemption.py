"""Preemption: a signal only sets a flag; all ranks agree at the next step boundary.

Saving inside a signal handler is the classic way to lose a checkpoint (the handler interrupts
arbitrary code, collectives included, and a second signal interrupts the save). Here the handler
records the signal and returns; after each step the ranks exchange their flags through one
small all-reduce on a CPU (gloo) group, so they all save at the same step or none does.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.runtime import early_signals
from hpctrain.runtime.exit_codes import PREEMPTED

log = logging.getLogger("hpctrain.preempt")


@dataclass
class PreemptConfig:
    """Config section ``preempt:``: which signals mean "checkpoint and stop"."""

    # SIGUSR2 rather than USR1: NCCL may use SIGUSR1 (submitit moved away for that reason).
    signals: list[str] = field(default_factory=lambda: ["SIGUSR2", "SIGTERM"])
    # The local launcher waits this long after forwarding SIGTERM before SIGKILL. Under Slurm
    # the same role is played by KillWait (and --signal=SIG@seconds ahead of the time limit).
    grace_s: float = 120.0
    # Steps between the ranks' agreement on signals (and time-based saves): each agreement is
    # a CPU collective that makes the ranks' host threads wait for each other.
    check_every: int = 10

    def validate(self) -> None:
        """Every name must be a real catchable signal; the grace positive."""
        if self.grace_s <= 0:
            raise ConfigError(f"preempt.grace_s = {self.grace_s} must be positive")
        if self.check_every < 1:
            raise ConfigError(f"preempt.check_every = {self.check_every} must be >= 1")
        for name in self.signals:
            if not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(f"preempt.signals: {name!r} is not a catchable signal",
                                  expected="names such as SIGUSR2, SIGTERM, SIGUSR1")


class Preempted(HpctrainError):
    """Training stopped after a preemption signal (a checkpoint was committed)."""

    exit_code = PREEMPTED


class PreemptionFlag:
    """Installs the handlers; ``requested`` names the first signal received."""

    def __init__(self, cfg: PreemptConfig):
        # A signal caught while the process was still starting (python -m hpctrain).
        early = [name for name in early_signals.received if name in cfg.signals]
        early_signals.uninstall()
        self.requested: str | None = early[0] if early else None
        self._previous = {}
        for name in cfg.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
        # A second signal changes nothing: the save that is coming or running stays intact.

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ControlChannel:
    """One all-reduce (MAX) of a few CPU integers per step over a dedicated gloo group."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._buf = torch.zeros(2, dtype=torch.int32)

    def exchange(self, preempt: bool, save: bool) -> tuple[bool, bool]:
        """(any rank was signalled, any rank asks for a save) — the same answer on every rank."""
        self._buf[0], self._buf[1] = int(preempt), int(save)
        if self.group is not None:
            dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._buf[0]), bool(self._buf[1])
