"""Which file system holds a path: the longest mount point of the mount table that contains it.
`hpctrain doctor` judges checkpoint and data folders by it (Lustre striping), and `bench disk` /
`bench checkpoint` say what they measured (tmpfs is memory, not storage)."""

from __future__ import annotations

import os
from pathlib import Path

# File systems whose pages are the storage itself: no device below, no page cache to bypass.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def filesystem(path: Path, mounts: Path = Path("/proc/mounts")) -> str:
    """The type of the filesystem holding `path`, or ``unknown`` (no readable mount table)."""
    try:
        table = mounts.read_text()
    except OSError:
        table = ""
    real = os.path.realpath(nearest_existing(path))
    best, kind = "", "unknown"
    for line in table.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def in_memory(path: Path) -> bool:
    """Whether `path` lies on a file system held in memory (tmpfs, ramfs)."""
    return filesystem(path) in MEMORY_FILESYSTEMS
