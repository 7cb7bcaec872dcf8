"""Ranks die with their launcher: a ``kill -9`` of ``hpctrain train --nproc N`` must not leave
its ranks training on as orphans, writing a run directory that a rerun then takes over.

The launcher puts its pid in ``HPCTRAIN_LAUNCHER_PID``. A rank, as it starts, asks the kernel to
SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), then checks that its parent
is still that pid: a launcher that died before the request took effect has left the rank to
another parent, and the rank exits at once. Where prctl is missing (macOS), a thread watches
the parent instead. A rank's checkpoint writer process dies with the rank the same way.
(SIGKILL rather than SIGTERM: the peers die at the same moment, so a checkpoint on SIGTERM
would wait on them in vain; the last committed one is what a rerun resumes from.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

LAUNCHER_PID_ENV = "HPCTRAIN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_S = 1.0


def die_with_launcher() -> None:
    """As a rank of the local launcher: be killed when it dies, exit now if it already has."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if raw.isdigit():  # else not started by `hpctrain train --nproc`
        die_with_parent(int(raw), "this rank's launcher")


def die_with_parent(parent: int, who: str = "the parent process") -> None:
    """SIGKILL this process when its parent ``parent`` dies, however it dies; exit now if it
    is gone already (``who`` names it in that message)."""
    if not _kill_me_with_parent():
        threading.Thread(target=_watch, args=(parent,), name="hpctrain-parent-watch",
                         daemon=True).start()
    if os.getppid() != parent:
        print(f"hpctrain: {who} (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def _kill_me_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    """Poll the parent; once it is no longer ``parent``, kill this process."""
    stop = threading.Event()
    while not stop.wait(_WATCH_S):
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
