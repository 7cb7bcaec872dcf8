"""A TCP port for the rendezvous of ranks that the tests start themselves.

A port the kernel hands out for ``bind(("", 0))`` comes from its ephemeral range, the same range
every outgoing connection and every gloo pair takes its local port from. Between this process
closing such a port and rank 0 binding it again, another test's ranks (the other xdist worker)
could take it, and their peers then met ours: CI once saw rank 1 of one test connect to another
test's store ("Gloo connectFullMesh failed ... Connection closed by peer"). A port below that
range is never given to a connection, so only another pick from below could clash: one in
thousands, and a pick is checked to be free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port on 127.0.0.1 below the ephemeral range that nobody listens on right now."""
    try:
        low = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found below {low}")
