"""Remember preemption signals that arrive while the interpreter is still starting up.

Importing torch takes seconds, and Slurm may send `--signal` early (its timer resolution is up
to a minute): a SIGUSR2 in that window would kill the process with no checkpoint. ``python -m
hpctrain`` installs these handlers first thing; the trainer's preemption flag then picks up
what arrived. Only the default preemption signals are covered here, before any config is read.
"""

from __future__ import annotations

import signal

received: list[str] = []


def _record(signum: int, frame) -> None:
    received.append(signal.Signals(signum).name)


_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def install() -> None:
    """Catch SIGUSR2 and SIGTERM until the trainer installs its own handlers."""
    for sig in _SIGNALS:
        signal.signal(sig, _record)


def uninstall() -> None:
    """Back to the default actions (the trainer's handlers replace these, then restore these)."""
    for sig in _SIGNALS:
        if signal.getsignal(sig) is _record:
            signal.signal(sig, signal.SIG_DFL)
