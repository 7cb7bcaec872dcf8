"""The run directory: one folder per run holding config, logs, metrics, checkpoints, provenance.

runs/llama-123456/
  config/                 resolved config as the run saw it
  logs/rank-000.log       one log per rank
  metrics/rank-000.jsonl  one JSON object per line per rank
  checkpoints/            latest: name of the last committed checkpoint
  provenance/             provenance.json, packages.txt
  exit_info.json          why and how the run ended (written atomically)
  run.lock                held by the run while it runs (see runlock.py)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.exit_info import exit_info_or_none
from hpctrain.runtime.runlock import LOCK_NAME, JobAttempt, acquire

# The checkpoint manager's pointer, moved only after a checkpoint is committed.
LATEST_POINTER = "latest"


def run_name(base: str, env: ProcessEnv) -> str:
    """Return the run's name: `base`, suffixed with the Slurm job (or array task) id if any."""
    if env.array_job_id is not None and env.array_task_id is not None:
        # Matches Slurm's own %A_%a naming, so the run dir sits next to slurm-%A_%a.out.
        return f"{base}-{env.array_job_id}_{env.array_task_id}"
    if env.job_id is not None:
        return f"{base}-{env.job_id}"
    return base


@dataclass
class RunDir:
    """Paths inside one run directory; `create` makes the folders."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def config_dir(self) -> Path:
        """Folder for the resolved config."""
        return self.root / "config"

    @property
    def logs_dir(self) -> Path:
        """Folder for per-rank log files."""
        return self.root / "logs"

    @property
    def metrics_dir(self) -> Path:
        """Folder for per-rank metrics JSONL files."""
        return self.root / "metrics"

    @property
    def checkpoints_dir(self) -> Path:
        """Folder for checkpoints."""
        return self.root / "checkpoints"

    @property
    def provenance_dir(self) -> Path:
        """Folder for provenance (versions, git state, hosts)."""
        return self.root / "provenance"

    @property
    def exit_info_path(self) -> Path:
        """Path of exit_info.json, written when the run ends."""
        return self.root / "exit_info.json"

    def latest_checkpoint(self) -> str | None:
        """The name of the last committed checkpoint (``checkpoints/latest``), if any."""
        try:
            return (self.checkpoints_dir / LATEST_POINTER).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def committed_checkpoints(self) -> list[Path]:
        """Committed checkpoint folders (``checkpoints/step-*``), in no particular order."""
        if not self.checkpoints_dir.is_dir():
            return []
        return [p for p in self.checkpoints_dir.glob("step-*") if p.is_dir()]

    def rank_log(self, rank: int) -> Path:
        """Return the log file of `rank`, e.g. logs/rank-003.log."""
        return self.logs_dir / f"rank-{rank:03d}.log"

    def rank_metrics(self, rank: int) -> Path:
        """Return the metrics file of `rank`, e.g. metrics/rank-003.jsonl."""
        return self.metrics_dir / f"rank-{rank:03d}.jsonl"

    def create(self) -> None:
        """Create all folders; safe when every rank calls it at the same time."""
        for folder in (
            self.config_dir,
            self.logs_dir,
            self.metrics_dir,
            self.checkpoints_dir,
            self.provenance_dir,
        ):
            # exist_ok makes the race between ranks harmless: whoever loses finds it there.
            folder.mkdir(parents=True, exist_ok=True)

    def write_exit_info(
        self,
        *,
        exit_code: int,
        reason: str,
        last_checkpoint: str | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Write exit_info.json atomically: exit code, reason, last checkpoint, time, host, pid."""
        now = time.time()
        info: dict[str, Any] = {
            "exit_code": exit_code,
            "reason": reason,
            "last_checkpoint": last_checkpoint,
            "timestamp": now,
            "time_utc": datetime.fromtimestamp(now, tz=timezone.utc).isoformat(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "extra": extra or {},
        }
        write_json_atomic(self.exit_info_path, info)

    def failure_since(self, since: float) -> dict[str, Any] | None:
        """The failure recorded in exit_info.json at or after ``since``, if any.

        The first failure of an attempt is the cause; the ones that follow (peers losing their
        connection to a dead or hung rank) must not overwrite its account.
        """
        info = exit_info_or_none(self.exit_info_path)  # damaged: no account to keep
        if info is None or info["exit_code"] == 0:
            return None
        return info if info["timestamp"] >= since else None


def archive_run(root: Path, attempt: JobAttempt | None = None) -> Path | None:
    """Move a previous run at ``root`` aside to ``<root>-archived-<time>``; None if none was there.

    Done under the run's lock, so a run that is still going is never moved (RunLockedError).
    Nothing is copied or deleted: a rename within the output folder.
    """
    root = Path(root)
    if not root.is_dir() or not any(root.iterdir()):
        return None
    lock = acquire(root, attempt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = root.with_name(f"{root.name}-archived-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = root.with_name(f"{root.name}-archived-{stamp}-{n}")
    lock.stop()
    try:
        os.rename(root, target)
    except BaseException:
        lock.release()
        raise
    (target / LOCK_NAME).unlink(missing_ok=True)
    fsync_dir(root.parent)
    return target


def json_safe(value: Any) -> Any:
    """Return `value` with non-finite floats as the strings "nan", "inf", "-inf" (strict JSON)."""
    # NaN/Infinity are not JSON; Python writes them anyway and other readers (jq, browsers)
    # then reject the whole file. A diverged loss must not make the metrics unreadable.
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if not isinstance(value, str | int | float | bool) and hasattr(value, "item"):
        value = value.item()  # numpy scalars and 0-d tensors
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` so readers see the old file or the new one, never half."""
    path = Path(path)
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n"
    # The temp file must be in the same folder: os.replace is atomic only within one filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Build the new directory ``out`` in a hidden sibling that becomes ``out`` in one rename.

    Readers see no ``out`` or the whole of it: the block fills the yielded folder, which is then
    fsynced and renamed; if the block raises, the folder is removed and ``out`` never appears.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)


def fsync_dir(folder: Path) -> None:
    """Make a directory's new entries and renames durable (a no-op where it is refused)."""
    # Without it a node crash can lose a renamed file's new directory entry.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory; the data is written
    finally:
        os.close(fd)
