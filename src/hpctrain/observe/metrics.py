"""Per-rank metrics as JSON Lines: metrics/rank-NNN.jsonl, one object per line.

Every record gets ``ts`` (Unix seconds), ``rank`` and ``host``. Non-finite floats are written as
the strings "nan", "inf", "-inf" so each line stays strict JSON (jq, pandas, browsers reject bare
NaN); `read_metrics` turns them back into floats.

    with MetricsWriter(run_dir, env) as metrics:
        metrics.write({"step": 10, "loss": 3.21, "tokens_per_s": 12_300.0})

Sinks (``add_sink``, e.g. rank 0's TensorBoard/MLflow tracker) get every record as written and
are closed with the run's outcome: FINISHED, KILLED (preempted, Ctrl-C) or FAILED.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.exit_codes import PREEMPTED
from hpctrain.runtime.rundir import RunDir, json_safe
from hpctrain.runtime.safe_open import make_dir, open_append, open_read

_log = logging.getLogger(__name__)

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricsWriter:
    """Appends metric records for one rank to its JSONL file, flushing each line."""

    def __init__(self, run_dir: RunDir, env: ProcessEnv) -> None:
        self.run_dir = run_dir
        self.path = run_dir.rank_metrics(env.rank)
        self._sinks: list[Any] = []
        self._rank = env.rank
        self._host = env.hostname
        make_dir(self.path.parent)
        # Append mode: a resumed or requeued run continues the same file. Line buffering flushes
        # each record, so a killed job loses at most the line being written.
        self._file = open_append(self.path, buffering=1)
        # A crash mid-write can leave a last line without its newline; start on a fresh line so
        # the first record of a resumed run is not glued onto the broken one.
        if _ends_without_newline(self._file.fileno()):
            self._file.write("\n")

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` with ts, rank and host added; keys in `record` override those three."""
        line = {"ts": time.time(), "rank": self._rank, "host": self._host, **record}
        self._file.write(json.dumps(json_safe(line), allow_nan=False) + "\n")
        for sink in self._sinks:
            sink(line)

    def add_sink(self, sink: Any) -> None:
        """Also hand every record to ``sink(record)``; ``sink.close(status)`` ends it."""
        self._sinks.append(sink)

    def close(self, status: str = "FINISHED") -> None:
        """Close the file and the sinks (``status``: how the run ended); later writes raise."""
        self._file.close()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close(status)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            status = "FINISHED"
        elif isinstance(exc, KeyboardInterrupt) or getattr(exc, "exit_code", None) == PREEMPTED:
            status = "KILLED"
        else:
            status = "FAILED"
        self.close(status)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Return the records of one metrics file; top-level "nan"/"inf"/"-inf" become floats."""
    records: list[dict[str, Any]] = []
    # Never through a link or FIFO planted in a shared run directory (`runs` would hang).
    with io.TextIOWrapper(open_read(path), encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                # A line cut short by a killed job; the rest of the file is still good.
                _log.warning("skipping unreadable line %d of %s", number, path)
                continue
            records.append({key: _restore(value) for key, value in record.items()})
    return records


def _restore(value: Any) -> Any:
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    return value


def _ends_without_newline(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
