"""The run directory: one folder per run holding config, logs, metrics, checkpoints, provenance.

runs/llama-123456/
  config/                 resolved config as the run saw it
  logs/rank-000.log       one log per rank
  metrics/rank-000.jsonl  one JSON object per line per rank
  checkpoints/            latest: name of the last committed checkpoint
  provenance/             provenance.json, packages.txt
  exit_info.json          why and how the run ended (written atomically)
  run.lock                held by the run while it runs (see runlock.py)

Every file in it is opened through ``safe_open.py`` (no link is followed), and a run refuses a
run directory whose entries are links or not the kind of file it writes there (`check_run_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import math
import os
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hpctrain.errors import ConfigError
from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.exit_info import exit_info_or_none
from hpctrain.runtime.runlock import LOCK_NAME, TAKEOVER_SUFFIX, JobAttempt, acquire
from hpctrain.runtime.safe_open import UnsafeRunPath, make_dir, read_bytes, refuse, write_atomic

# The checkpoint manager's pointer, moved only after a checkpoint is committed.
LATEST_POINTER = "latest"

# What runtime/, observe/, checkpoint/, train/ and launch/ write at fixed names in a run
# directory (paths relative to it; patterns as in fnmatch). A link at any name is refused; these
# must moreover be folders, or regular files.
# Not checkpoints/step-*: a stray file there is damage, which resume reports, skips and leaves
# (train/test_resume_fallback.py); only links are refused there, as everywhere.
_FOLDERS = ("config", "logs", "metrics", "checkpoints", "provenance", "goodput", "profiles",
            "forensics", "tensorboard", "mlruns", "logs/launcher", "profiles/step-*")
_FILES = ("exit_info.json", "goodput.json", LOCK_NAME, LOCK_NAME + TAKEOVER_SUFFIX,
          "config/*.yaml", "config/source.*", "logs/rank-*.log", "metrics/rank-*.jsonl",
          f"checkpoints/{LATEST_POINTER}", "provenance/*", "goodput/attempt-*.json",
          "forensics/*.json", "profiles/*.pickle", "report.html")
# Deep enough for every fixed name (checkpoints/step-N/<file> is 3 levels down).
_CHECK_DEPTH = 3


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
            raw = read_bytes(self.checkpoints_dir / LATEST_POINTER)
            return raw.decode().strip() or None
        except (OSError, UnicodeDecodeError, UnsafeRunPath):
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
        """Create all folders (a link at one is refused); safe when every rank calls it at once."""
        for folder in (
            self.config_dir,
            self.logs_dir,
            self.metrics_dir,
            self.checkpoints_dir,
            self.provenance_dir,
        ):
            # exist_ok makes the race between ranks harmless: whoever loses finds it there.
            make_dir(folder)

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


def real_run_root(root: Path) -> Path:
    """The run directory to write: ``root``, or where it points if it is a link of the user's
    own (into scratch space, say); a link made by another user is refused (UnsafeRunPath)."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except OSError:
        return root  # missing (created later) or a name too long (check_can_write says so)
    if not stat.S_ISLNK(st.st_mode):
        return root
    if st.st_uid != os.geteuid():
        raise refuse(root, f"a symbolic link made by another user (uid {st.st_uid})")
    return Path(os.path.realpath(root))


def check_run_dir(root: Path) -> list[str]:
    """Refuse (UnsafeRunPath) a run directory holding a link, or a fixed name of another kind;
    return warnings for one that others can write (empty when all is well or it is new)."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):  # the latter: check_can_write
            raise
        return _writable_warnings(root.parent, parent=True)
    if stat.S_ISLNK(st.st_mode):
        raise refuse(root, "a symbolic link (resolve it first: real_run_root)")
    if not stat.S_ISDIR(st.st_mode):
        raise refuse(root, "not a folder")
    _check_entries(root, root, 1)
    return _writable_warnings(root, parent=False) + _writable_warnings(root.parent, parent=True)


def check_can_write(root: Path) -> None:
    """Refuse (ConfigError) a run directory whose name the file system cannot hold, or that
    (or its checkpoint folder) this process cannot write: found before the first step, not
    at the first save after the steps were trained. Writes nothing that it leaves behind."""
    root = Path(root)
    existing = root
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    hint = "choose another run.out_dir or run.name, or fix the folder's permissions (ls -ld)"
    for part in root.relative_to(existing).parts if root != existing else ():
        if len(os.fsencode(part)) > limit:
            raise ConfigError(
                f"the run directory name {part[:60]!r}... is {len(os.fsencode(part))} bytes",
                expected=f"at most {limit} bytes per name on the file system of {existing}",
                hint="choose a shorter run.name (under Slurm the job id is appended to it)")
    if existing != root:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot create {root}: {existing} is not writable",
                              expected="an output folder this user can write", hint=hint)
        return
    for folder in (root, root / "checkpoints"):
        if folder.is_dir():
            _probe_write(folder, hint)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a name too long to look up does not (Path.exists raises)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            return False
        raise
    return True


def _probe_write(folder: Path, hint: str) -> None:
    """Create and remove a file in ``folder``; ConfigError (with the OS's reason) if refused."""
    probe = folder / f".write-probe-{secrets.token_hex(6)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as e:
        raise ConfigError(f"{folder} is not writable ({e.strerror})",
                          expected="a run directory and checkpoint folder this user can write",
                          hint=hint) from None
    probe.unlink()


def _check_entries(root: Path, folder: Path, depth: int) -> None:
    # A live run may rename or remove entries while we look (a save committing): what is gone
    # is skipped, so a second start gets the lock's "in use" refusal, not a traceback.
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        path = Path(entry.path)
        rel = path.relative_to(root).parts
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise refuse(path, "a symbolic link")
        is_dir = stat.S_ISDIR(st.st_mode)
        if not (is_dir or stat.S_ISREG(st.st_mode)):
            raise refuse(path, "not a regular file")
        if is_dir and _matches(rel, _FILES):
            raise refuse(path, "a folder")
        if not is_dir and _matches(rel, _FOLDERS):
            raise refuse(path, "not a folder")
        if is_dir and depth < _CHECK_DEPTH:
            _check_entries(root, path, depth + 1)


def _matches(parts: tuple[str, ...], patterns: tuple[str, ...]) -> bool:
    """Whether a relative path matches one of ``patterns``, part by part (``*`` stops at /)."""
    return any(len(p := pattern.split("/")) == len(parts)
               and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, p, strict=True))
               for pattern in patterns)


def _writable_warnings(folder: Path, *, parent: bool) -> list[str]:
    """A warning when others than its owner can write ``folder`` (a sticky parent is fine)."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return []
    if not mode & (stat.S_IWGRP | stat.S_IWOTH) or (parent and mode & stat.S_ISVTX):
        return []
    who = "group and others" if mode & stat.S_IWOTH else "its group"
    what = "the folder holding the run directory" if parent else "the run directory"
    return [f"warning: {what} {folder} is writable by {who}: they can plant links and files "
            f"in it (hpctrain refuses those it finds); `chmod go-w {folder}` unless you share "
            "it on purpose"]


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
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n"
    write_atomic(Path(path), text.encode("utf-8"))


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
