"""Training progress on rank 0: a rich bar on a terminal, plain status lines everywhere else.

    with TrainProgress(total=1000, env=env) as progress:
        for step in range(1, 1001):
            ...
            progress.update(step, loss=3.21, tokens_per_s=12_300.0, mfu=0.412)

On a terminal the bar reads ``train ━━━━━━ 120/1000 0:01:02 0:07:35 loss 3.21 | 12.3k tok/s |
MFU 41.2%``; in a log file every `plain_every`-th update prints
``train step 120/1000 (12%) | loss 3.21 | 12.3k tok/s | MFU 41.2% | elapsed 0:01:02``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hpctrain.runtime.env import ProcessEnv


class TrainProgress:
    """Shows training progress on rank 0 when enabled; a no-op on every other rank."""

    def __init__(
        self,
        total: int,
        env: ProcessEnv,
        *,
        description: str = "train",
        enabled: bool = True,
        plain_every: int = 50,
        file: TextIO | None = None,
    ) -> None:
        self.total = total
        self.description = description
        self.plain_every = max(1, plain_every)
        self._active = enabled and env.is_rank0
        self._file = file if file is not None else sys.stdout
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._updates = 0
        self._start = time.monotonic()

    def __enter__(self) -> TrainProgress:
        self._start = time.monotonic()
        # A live bar redraws itself with carriage returns and cursor moves. In a Slurm log file or
        # CI output those either pile up as thousands of lines or only show at the end, so
        # without a terminal we print a plain status line every `plain_every` updates instead.
        if self._active and self._file.isatty():
            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=Console(file=self._file, force_terminal=True),
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, stats="")
        return self

    def update(
        self, step: int, loss: float | None, tokens_per_s: float | None, mfu: float | None
    ) -> None:
        """Report that `step` of `total` steps are done, with the latest loss, speed and MFU."""
        if not self._active:
            return
        stats = format_stats(loss, tokens_per_s, mfu)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            return
        self._updates += 1
        if self._updates % self.plain_every == 0 or step >= self.total:
            elapsed = timedelta(seconds=int(time.monotonic() - self._start))
            percent = 100 * step // self.total if self.total > 0 else 100
            print(
                f"{self.description} step {step}/{self.total} ({percent}%) | {stats} "
                f"| elapsed {elapsed}",
                file=self._file,
                flush=True,  # stdout to a file is block-buffered; tail -f should see each line
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def format_stats(loss: float | None, tokens_per_s: float | None, mfu: float | None) -> str:
    """Return ``loss 3.21 | 12.3k tok/s | MFU 41.2%``; a missing MFU reads as unknown device."""
    loss_text = "loss n/a" if loss is None else f"loss {loss:.2f}"
    speed_text = "n/a tok/s" if tokens_per_s is None else f"{_si(tokens_per_s)} tok/s"
    # MFU is None exactly when the device has no known peak (see observe.peaks).
    mfu_text = "MFU n/a (unknown device)" if mfu is None else f"MFU {100 * mfu:.1f}%"
    return f"{loss_text} | {speed_text} | {mfu_text}"


def _si(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"
