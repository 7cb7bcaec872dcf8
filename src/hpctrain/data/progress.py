"""A progress bar over input bytes for the data tools (`data prepare`, `data pack-images`).

    with BytesProgress(progress, total_bytes, "pack-images") as bar:
        for f in files:
            ...
            bar.advance(f.size)

Shown with rich only when asked for and stderr is a terminal (a log file gets no bar lines).
"""

from __future__ import annotations

import sys


class BytesProgress:
    """A rich progress bar over input bytes (only on a terminal, only when asked)."""

    def __init__(self, enabled: bool, total: int, label: str = "prepare"):
        self.enabled = enabled and sys.stderr.isatty()
        self.total = total
        self.label = label

    def __enter__(self) -> BytesProgress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(f"[bold]{self.label}", BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self._p.__enter__()
            self._task = self._p.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        if self.enabled:
            self._p.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._p.__exit__(*exc)
