"""Ranks die with their launcher: a ``kill -9`` of ``hpctrain train --nproc N`` must not leave
its ranks training on as orphans, writing a run directory that a rerun then takes over.

The launcher puts its pid in ``HPCTRAIN_LAUNCHER_PID``. A rank, as it starts, asks the kernel to
SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), then checks that its parent
is still that pid: a launcher that died before the request took effect has left the rank to
another parent, and the rank exits at once. Where prctl is missing (macOS), a thread watches
the parent instead. (SIGKILL rather than SIGTERM: the peers die at the same moment, so a
checkpoint on SIGTERM would wait on them in vain; the last committed one is what a rerun uses.)
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
    if not raw.isdigit():
        return  # not started by `hpctrain train --nproc`
    launcher = int(raw)
    if not _kill_me_with_parent():
        threading.Thread(target=_watch, args=(launcher,), name="hpctrain-launcher-watch",
                         daemon=True).start()
    if os.getppid() != launcher:
        print(f"hpctrain: this rank's launcher (pid {launcher}) is gone; the rank exits",
              file=sys.stderr, flush=True)
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


def _watch(launcher: int) -> None:
    """Poll the parent; once it is no longer the launcher, kill this process."""
    stop = threading.Event()
    while not stop.wait(_WATCH_S):
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGKILL)
