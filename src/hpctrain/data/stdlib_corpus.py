"""The embedded default corpus: the Python standard library's own ``.py`` sources, as bytes.

Real text that nobody here wrote and that every machine with Python already has, so the demo and
the tests need no download. A byte-level tokenizer (token id = byte value, vocabulary 256) keeps
the path free of any tokenizer files.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from hpctrain.errors import ConfigError


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's ``.py`` files (site-packages excluded), sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruned, not filtered afterwards: the installed packages there are often ten times
        # the stdlib, and every rank of every run lists these files.
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [p for n in names if n.endswith(".py") and (p := Path(folder, n)).is_file()]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(
            f"no .py files found under {str(root)!r}",
            expected="the Python standard library sources",
            hint="this Python install ships without sources; use another data source",
        )
    return files


def read_stdlib_bytes(max_bytes: int = 0, root: Path | None = None) -> np.ndarray:
    """All ``.py`` files under the stdlib (sorted by relative path), concatenated, as uint8.

    Files are joined with a blank line. ``max_bytes`` > 0 stops after that many bytes so start-up
    stays fast; the order is fixed so every rank and every rerun sees the same corpus.
    """
    files = stdlib_files(root)
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes() + b"\n\n"
        if max_bytes and total + len(data) > max_bytes:
            chunks.append(data[: max_bytes - total])
            total = max_bytes
            break
        chunks.append(data)
        total += len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)
